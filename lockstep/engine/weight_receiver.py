"""The engine's side of weights sent by a trainer: over its process group (SGLang's
`/init_weights_update_group`, `/update_weights_from_distributed`,
`/destroy_weights_update_group`), or as safetensors bytes (`/update_weights_from_tensor`); the
trainer's side is lockstep/training/weight_sync.py.

Runs in the engine process, between steps (engine_loop.ENGINE_CALLS): joining a group and
receiving a set of tensors block the loop until the trainer has done its part, or the group's
timeout passes. An update receives every tensor the request declares (so the trainer's
broadcasts complete whatever the verdict), then checks the whole set against the served model
(names, shapes, dtypes) before any weight changes: a refused set leaves the old weights
serving, bit for bit (`Engine.update_weights`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from lockstep.errors import ModelLoadError, RequestError
from lockstep.models.decoder import _stored_dtype
from lockstep.training.weight_sync import BACKENDS, join_weight_group, leave_weight_group

# The dtypes a weight may be sent in, by torch's name ("torch." prefixes are taken too).
DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "bfloat16", "float16", "float64", "float8_e4m3fn", "int64", "int32")
}


@dataclass
class _Group:
    group: Any
    backend: str
    rank: int
    world_size: int


_GROUPS: weakref.WeakKeyDictionary[Any, dict[str, _Group]] = weakref.WeakKeyDictionary()


def _groups(engine: Any) -> dict[str, _Group]:
    return _GROUPS.setdefault(engine, {})


def parse_dtype(name: str) -> torch.dtype:
    """A dtype named as SGLang's clients name them; `RequestError` for any other."""
    dtype = DTYPES.get(name.removeprefix("torch."))
    if dtype is None:
        raise RequestError(f"dtype {name!r} is not supported: expected one of {sorted(DTYPES)}")
    return dtype


def init_group(
    engine: Any,
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
) -> None:
    """Join the trainer's group as rank `rank_offset` (the trainer is rank 0)."""
    if backend not in BACKENDS:
        raise RequestError(f"backend={backend!r} is not supported: expected one of {BACKENDS}")
    if backend == "nccl" and engine.device.type != "cuda":
        raise RequestError(
            f"backend='nccl' needs a CUDA engine; this one runs on {engine.device.type}:"
            " use backend='gloo'"
        )
    if engine.config.tp != 1:
        raise RequestError(
            f"a weights update group needs a tensor-parallel degree of 1; this engine runs at"
            f" tp={engine.config.tp}: update from disk instead"
        )
    if not 0 < rank_offset < world_size:
        raise RequestError(
            f"rank_offset={rank_offset} is invalid for world_size={world_size}: expected 1 to"
            f" {world_size - 1} (the trainer is rank 0)"
        )
    groups = _groups(engine)
    if group_name in groups:
        raise RequestError(
            f"group_name={group_name!r} is already joined: destroy it first"
            " (/destroy_weights_update_group)"
        )
    group = join_weight_group(
        master_address, master_port, rank_offset, world_size, group_name, backend, timeout_s
    )
    groups[group_name] = _Group(group, backend, rank_offset, world_size)


def destroy_group(engine: Any, group_name: str) -> None:
    entry = _groups(engine).pop(group_name, None)
    if entry is None:
        raise RequestError(f"group_name={group_name!r} is not joined: nothing to destroy")
    leave_weight_group(entry.group)


def update_from_group(
    engine: Any,
    group_name: str,
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    version: str | None,
) -> dict[str, Any]:
    """Receive `names` (broadcast by rank 0, in this order) and serve them; returns the
    engine's fingerprint. Raises `RequestError` or `ModelLoadError` (old weights intact)."""
    entry = _groups(engine).get(group_name)
    if entry is None:
        raise RequestError(
            f"group_name={group_name!r} is not joined: call /init_weights_update_group first"
        )
    kinds = [parse_dtype(d) for d in dtypes]
    device = engine.device if entry.backend == "nccl" else torch.device("cpu")
    received = []
    for name, dtype, shape in zip(names, kinds, shapes, strict=True):
        tensor = torch.empty(shape, dtype=dtype, device=device)
        torch.distributed.broadcast(tensor, src=0, group=entry.group)
        # Staged on the host (where `update_weights` checks the whole set before any weight
        # changes): the device holds one received tensor at a time beside the weights.
        received.append((name, tensor.cpu()))
    check_dtypes(engine, received)
    engine.update_weights(received, f"process group {group_name}", version)
    return engine.fingerprint()


def update_from_safetensors(engine: Any, blob: bytes, version: str | None) -> dict[str, Any]:
    """Serve the tensors of one safetensors file held in memory (`/update_weights_from_tensor`,
    a colocated trainer's bytes); returns the engine's fingerprint. Raises `RequestError` or
    `ModelLoadError` (old weights intact)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        weights = list(load(blob).items())
    except SafetensorError as exc:
        raise RequestError(
            f"serialized_named_tensors[0] is not a safetensors file: {exc}"
        ) from None
    check_dtypes(engine, weights)
    engine.update_weights(weights, "tensors", version)
    return engine.fingerprint()


def check_dtypes(engine: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Refuse a tensor whose dtype the engine would have to round: it must be the dtype the
    engine keeps it in, or one that widens to it exactly (bfloat16 or float16 for a tensor
    kept in float32, such as a norm). Names and shapes are checked by `update_weights`."""
    spec = engine.decoder.spec
    for name, tensor in weights:
        kept = _stored_dtype(spec, name, engine.dtype)
        exact = tensor.dtype == kept or (
            kept == torch.float32 and tensor.dtype in (torch.bfloat16, torch.float16)
        )
        if not exact:
            raise ModelLoadError(
                f"tensor {name!r} was sent as {str(tensor.dtype).removeprefix('torch.')}; the"
                f" engine keeps it as {str(kept).removeprefix('torch.')}: send that dtype (a"
                " cast here would change the values the trainer computes with)"
            )
