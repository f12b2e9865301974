"""Handing the engine's memory back to the device and taking it again (SGLang's
`/release_memory_occupation` and `/resume_memory_occupation`, tags `kv_cache` and `weights`),
so that a trainer on the same GPU can use it between rollouts (docs/rl.md).

    release(kv_cache)   the prefix cache is flushed; the KV pool's storage is freed
    release(weights)    each weight storage is copied to host memory (pinned on CUDA), then
                        its device storage is freed
    resume(...)         the storages are allocated again (the KV pool zeroed, the weights
                        copied back); the same bits as before the release

The tensors stay the same Python objects (views included): only their storages shrink to
nothing and grow back, at new device addresses (a weight whose storage cannot shrink, memory
another library allocated on the CPU, is given a new one), so captured CUDA graphs are dropped
and captured again on first use (`DecodeGraphRunner.drop_graphs`). On CUDA the allocator's cache
is emptied, so `torch.cuda.mem_get_info` sees the memory free. On the CPU the same code runs:
the KV pool's RAM is really freed (`KVPool.release_memory`: its pages dropped), the weights'
is not (their copy is in RAM too).

Only between requests: a release is refused while requests hold KV (pause them with `retract`
or `abort` first); the engine loop takes no step while anything is released (engine_loop.py),
so requests that arrive meanwhile wait in the queue.
"""

from __future__ import annotations

from typing import Any

import torch

from lockstep.errors import RequestError

TAGS = ("kv_cache", "weights")


def parse_tags(tags: list[str] | None) -> tuple[str, ...]:
    """SGLang's `tags`: None means both."""
    if tags is None:
        return TAGS
    bad = [t for t in tags if t not in TAGS]
    if bad or not tags:
        raise RequestError(f"tags={tags!r} is invalid: expected a non-empty list of {TAGS}")
    return tuple(t for t in TAGS if t in tags)


class MemoryOccupation:
    """What one engine has released, and the host copies to restore it."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.released: set[str] = set()
        # The weights' host copies: whole storages (shrunk in place), and tensors whose
        # storage cannot shrink (given a new storage on resume).
        self._host: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self._moved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def release(self, tags: tuple[str, ...]) -> None:
        engine = self.engine
        if "weights" in tags and engine.config.tp != 1:
            raise RequestError(
                f"tags=['weights'] needs a tensor-parallel degree of 1; this engine runs at"
                f" tp={engine.config.tp}: release kv_cache only"
            )
        running = len(engine.scheduler.running)
        if running or engine._inflight is not None:
            raise RequestError(
                f"{running} request(s) are running: pause them (/pause_generation with mode"
                " retract or abort) before releasing memory"
            )
        for graphs in (engine.runner.graphs, engine.runner.piecewise):
            if graphs is not None:
                graphs.drop_graphs()
        if "kv_cache" in tags and "kv_cache" not in self.released:
            engine.radix.flush()
            engine.pool.release_memory()
            self.released.add("kv_cache")
        if "weights" in tags and "weights" not in self.released:
            pin = engine.device.type == "cuda"
            shared, alone = _plan_weights(_weight_tensors(engine.decoder))
            for storage in shared:
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                host.copy_(_bytes(storage))
                storage.resize_(0)
                self._host.append((storage, host))
            for tensor in alone:
                host = tensor.to("cpu", copy=True)
                self._moved.append((tensor, host.pin_memory() if pin else host))
                tensor.set_()  # its storage, which nothing else holds, is freed
            self.released.add("weights")
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
            torch.cuda.empty_cache()

    def resume(self, tags: tuple[str, ...]) -> None:
        engine = self.engine
        if "kv_cache" in tags and "kv_cache" in self.released:
            engine.pool.restore_memory()
            self.released.discard("kv_cache")
        if "weights" in tags and "weights" in self.released:
            for storage, host in self._host:
                storage.resize_(host.numel())
                _bytes(storage).copy_(host)
            for tensor, host in self._moved:
                tensor.set_(host.to(engine.device, copy=True))
            self._host.clear()
            self._moved.clear()
            self.released.discard("weights")
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)


def _weight_tensors(decoder: Any) -> list[torch.Tensor]:
    """Every tensor the decoder reaches through its layers and parts (the prepared weights,
    norms, tables), found by walking the Lockstep objects it holds."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(value: Any, depth: int) -> None:
        if id(value) in seen or depth > 8:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item, depth + 1)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item, depth + 1)
        elif type(value).__module__.startswith(("lockstep.models", "lockstep.parallel")):
            fields = getattr(value, "__dict__", None)
            if fields is None:
                fields = {n: getattr(value, n) for n in getattr(value, "__slots__", ())}
            for item in fields.values():
                walk(item, depth + 1)

    walk(decoder, 0)
    return found


def _plan_weights(
    tensors: list[torch.Tensor],
) -> tuple[list[torch.UntypedStorage], list[torch.Tensor]]:
    """How each weight's memory is freed: storages that can shrink in place (every one the
    caching allocator made: all of them on CUDA), and tensors that are alone on a storage
    that cannot (memory another library allocated, on the CPU), which get a new storage on
    resume. Refused, before anything changes, for a storage that can neither shrink nor be
    replaced through the one tensor that holds it."""
    by_storage: dict[int, list[torch.Tensor]] = {}
    storages: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            by_storage.setdefault(storage.data_ptr(), []).append(tensor)
            storages.setdefault(storage.data_ptr(), storage)
    shared, alone = [], []
    for key, storage in storages.items():
        if storage.resizable():
            shared.append(storage)
            continue
        held = {id(t): t for t in by_storage[key]}
        tensor = next(iter(held.values()))
        whole = tensor.storage_offset() == 0 and tensor.is_contiguous()
        if len(held) != 1 or not whole or tensor.nbytes != storage.nbytes():
            raise RequestError(
                "the weights cannot be released: a weight storage is shared and cannot be"
                " freed in place; release kv_cache only"
            )
        alone.append(tensor)
    return shared, alone


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
