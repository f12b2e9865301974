"""Rank 0's side of tensor parallelism: the worker processes and the decoder that drives them.

`WorkerGroup.start` spawns ranks 1..tp-1 (lockstep.parallel.worker), hosts the process group's
store and joins the group as rank 0. `ShardedDecoder` stands where the engine's `Decoder`
stands: each call sends the command to every worker first, then runs rank 0's shard, so all
ranks enter the same collectives in the same order. The scheduler, the KV pool's allocator,
the sampler and everything else of the engine run on rank 0 only.

Failure: a watchdog thread waits on the workers' process handles. When one ends while the
group is not closing, it records one line naming the rank, its pid and exit status
(`WorkerGroup.failure`), stops the other workers (so a collective rank 0 waits in fails at
once instead of hanging) and calls the `on_failure` callbacks (the server exits). Every later
command raises `TensorParallelError` with that line.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from lockstep.cache.linear_snapshots import LinearSnapshotPool
from lockstep.config import EngineConfig
from lockstep.errors import LockstepError, ModelLoadError, RequestError
from lockstep.models.decoder import Decoder, KVStorage, ScratchKV
from lockstep.models.forward_batch import ForwardBatch
from lockstep.models.linear_attention import LinearSnapshot, LinearState, LinearStatePool
from lockstep.parallel import worker
from lockstep.parallel.linear_states import gather_state, wire_states
from lockstep.parallel.worker import gather_kv

logger = logging.getLogger(__name__)

STORE_TIMEOUT_S = 120  # every rank must reach the store within this (process start, imports)
STOP_TIMEOUT_S = 5.0


class TensorParallelError(LockstepError, RuntimeError):
    """A tensor-parallel rank is gone: the engine cannot compute another step. Its message
    is the one line users see (the CLI prints it and exits with status 1, a failure of the
    engine rather than of the command line)."""

    exit_status = 1


class WorkerGroup:
    """Ranks 1..tp-1 of an engine, and rank 0's membership of the process group."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.failure: str | None = None
        self._closing = False
        self._callbacks: list[Callable[[str], None]] = []
        ctx = mp.get_context("spawn")  # never fork a process that holds torch's threads
        # Rank 0 hosts the store; port 0 lets the OS pick a free one, the workers are told it.
        store = dist.TCPStore("127.0.0.1", 0, config.tp, is_master=True,
                              timeout=timedelta(seconds=STORE_TIMEOUT_S),
                              wait_for_workers=False)  # fmt: skip
        self.processes: list[Any] = []
        self.conns: list[Connection] = []
        for rank in range(1, config.tp):
            parent, child = ctx.Pipe()
            process = ctx.Process(
                target=worker.worker_main, args=(config, rank, store.port, child),
                name=f"lockstep-tp-rank-{rank}", daemon=True,
            )  # fmt: skip
            process.start()
            child.close()
            self.processes.append(process)
            self.conns.append(parent)
        self._watchdog = threading.Thread(target=self._watch, name="lockstep-tp-watchdog",
                                          daemon=True)  # fmt: skip
        self._watchdog.start()
        # Before multiprocessing's own exit handler (registered earlier, so run later), which
        # would SIGTERM the workers and read as their failure.
        atexit.register(self.close)
        try:
            # Joining blocks until every rank has joined; a worker that died on its way would
            # leave rank 0 waiting out the store's timeout, so wait for each to say it started.
            self._wait_until_started()
            self.collectives = worker.join_group(config, 0, store)
        except Exception as exc:
            self.close()
            if isinstance(exc, TensorParallelError):
                raise
            raise TensorParallelError(self.failure or f"joining the tp={config.tp} process "
                                      f"group failed: {exc}") from exc  # fmt: skip
        self._store = store

    @property
    def pids(self) -> list[int]:
        """The workers' process ids, rank 1 first."""
        return [p.pid for p in self.processes]

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call `callback(message)` (from the watchdog thread) when a worker dies."""
        self._callbacks.append(callback)
        if self.failure is not None:
            callback(self.failure)

    def _wait_until_started(self) -> None:
        """Return once every worker has said "joining"; raise `TensorParallelError` naming the
        first that died or failed before it (within a second of its death), or that is not
        there after STORE_TIMEOUT_S."""
        pending = dict(enumerate(zip(self.conns, self.processes, strict=True), start=1))
        deadline = time.monotonic() + STORE_TIMEOUT_S
        while pending:
            left = deadline - time.monotonic()
            handles = [h for conn, p in pending.values() for h in (conn, p.sentinel)]
            if left <= 0 or not wait(handles, timeout=left):
                raise TensorParallelError(
                    f"tensor-parallel worker rank(s) {', '.join(map(str, pending))} did not start "
                    f"within {STORE_TIMEOUT_S} s"
                )
            for rank, (conn, process) in list(pending.items()):
                try:
                    message = conn.recv() if conn.poll() else None
                except (EOFError, OSError):  # its end of the pipe closed: it is exiting
                    raise TensorParallelError(_died_at_start(rank, process)) from None
                if message is not None and message[0] == "joining":
                    del pending[rank]
                elif message is not None:  # ("error", text): worker_main caught it
                    raise TensorParallelError(f"tensor-parallel worker rank {rank} failed at "
                                              f"start: {message[1]}")  # fmt: skip
                elif not process.is_alive():
                    raise TensorParallelError(_died_at_start(rank, process))

    def wait_ready(self) -> None:
        """Wait until every worker has loaded its shard; a worker that failed raises
        `ModelLoadError` with its message."""
        for rank, conn in enumerate(self.conns, start=1):
            try:
                kind, message = conn.recv()
            except (EOFError, OSError):
                self._wait_for_failure()
                raise ModelLoadError(self.failure or f"tp worker rank {rank} is gone") from None
            if kind == "error":
                raise ModelLoadError(f"tp worker rank {rank}: {message}")

    def send(self, command: str, arg: Any = None) -> None:
        """Send one command to every worker (raises `TensorParallelError` once one is gone)."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send((command, arg))
            except OSError:
                self._wait_for_failure()
                raise TensorParallelError(
                    self.failure or f"tp worker rank {rank} is gone"
                ) from None

    def failed(self, exc: BaseException) -> BaseException:
        """The error to raise for `exc`, raised while a collective ran: the worker's death
        when that is its cause."""
        self._wait_for_failure()
        if self.failure is not None:
            return TensorParallelError(self.failure)
        return exc

    def close(self) -> None:
        """Stop every worker and leave the process group. Idempotent."""
        if self._closing:
            return
        self._closing = True
        for conn in self.conns:
            try:
                conn.send(("stop", None))
            except OSError:
                pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        self._stop_all()
        for conn in self.conns:
            conn.close()
        atexit.unregister(self.close)

    # ------------------------------------------------------------------ internals
    def _watch(self) -> None:
        handles = {p.sentinel: (rank, p) for rank, p in enumerate(self.processes, start=1)}
        while handles and not self._closing:
            for sentinel in wait(list(handles), timeout=0.2):
                rank, process = handles.pop(sentinel)
                if self._closing:
                    return
                self._fail(f"tensor-parallel worker rank {rank} (pid {process.pid}) exited "
                           f"with status {_exit_status(process)}: the engine cannot "
                           "continue")  # fmt: skip
                return

    def _fail(self, message: str) -> None:
        self.failure = message
        logger.error("%s", message)
        self._stop_all()
        for callback in self._callbacks:
            try:
                callback(message)
            except Exception:
                logger.exception("tensor-parallel failure callback failed")

    def _stop_all(self) -> None:
        """Terminate the workers still running (SIGTERM, then SIGKILL)."""
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join(STOP_TIMEOUT_S)

    def _wait_for_failure(self, timeout: float = 2.0) -> None:
        """Give the watchdog time to see a death that rank 0 noticed first."""
        deadline = time.monotonic() + timeout
        while self.failure is None and time.monotonic() < deadline:
            if not any(p.is_alive() for p in self.processes):
                time.sleep(0.3)
                return
            time.sleep(0.05)


class ShardedDecoder:
    """Rank 0's decoder of a tensor-parallel engine: the `Decoder` interface the engine uses,
    each call mirrored on every worker. Logits come back whole (vocabulary shards gathered);
    KV entries read through `read_kv` and `cold_prefill` come back with every KV head."""

    def __init__(self, local: Decoder, group: WorkerGroup) -> None:
        self.local = local
        self.group = group
        self.spec = local.spec
        self.ops = local.ops
        self.dtype = local.dtype
        self.device = local.device
        self.act_dtype = local.act_dtype
        self.plan = local.plan
        self.parallel = local.parallel
        self.max_position = local.max_position
        self.state_pool: LinearStatePool | None = None  # hybrid: rank 0's (`set_linear_pools`)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.local, name)  # what needs no other rank (linear_layout, ...)

    def forward(self, batch: ForwardBatch, kv: KVStorage) -> torch.Tensor:
        """`Decoder.forward` on every rank (workers write their KV heads into their own
        stores at the same slots, and a hybrid model's states into their own state and
        snapshot slots: lockstep/parallel/linear_states.py); float32 logits [R, vocab]."""
        wires = None
        if batch.linear_states is not None:
            wires = wire_states(batch.linear_states)
        wire_batch = dataclasses.replace(batch.to("cpu"), linear_states=None)
        self.group.send("forward", (wire_batch, wires))
        try:
            return self.local.forward(batch, kv)
        except RuntimeError as exc:
            raise self.group.failed(exc) from exc

    def cold_prefill(self, token_ids: list[int]) -> tuple[torch.Tensor, ScratchKV]:
        """`Decoder.cold_prefill` on every rank; the returned cache holds every KV head."""
        self.group.send("cold_prefill", list(token_ids))
        try:
            logits, scratch = self.local.cold_prefill(token_ids)
            k, v = gather_kv(self.local, scratch.k, scratch.v)
            state = scratch.linear_state
            if state is not None:
                assert self.parallel.collectives is not None
                state = gather_state(state, self.parallel.collectives)
        except RuntimeError as exc:
            raise self.group.failed(exc) from exc
        full = ScratchKV(self.spec, len(token_ids), self.dtype, self.device)
        full.k, full.v, full.linear_state = k, v, state
        return logits, full

    def resume_linear_state(self, snapshot: LinearSnapshot | None) -> LinearState:
        """A running sequence's state in a slot of rank 0's state pool, resumed from a radix
        snapshot (None: from nothing), and the same slot filled alike on every worker: the
        engine's `Scheduler.new_linear_state` at tp > 1."""
        assert self.state_pool is not None, "resume_linear_state before the state pool"
        if snapshot is not None and snapshot.pool is None:
            raise ValueError("a tensor-parallel hybrid state resumes from pooled snapshots only")
        state = LinearState.resume(self.local.linear_layout, snapshot, self.state_pool,
                                   keep_all=False)  # fmt: skip
        self.group.send("linear_resume", (state.slot, None if snapshot is None else snapshot.slot))
        return state

    def set_linear_pools(self, states: LinearStatePool, snapshots: LinearSnapshotPool) -> None:
        """Rank 0's state and snapshot pools; every worker allocates pools of as many slots."""
        self.state_pool = states
        self.group.send("linear_slots", (states.num_slots, snapshots.num_slots))

    def logits_for_sequence(self, token_ids: list[int]) -> torch.Tensor:
        return self.cold_prefill(token_ids)[0]

    def read_kv(self, kv: KVStorage, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [layers, n, Hkv, D] at `slots`, every rank's heads joined."""
        slots = slots.to(torch.int64).cpu()
        self.group.send("read_kv", slots)
        k, v = self.local.read_kv(kv, slots)
        try:
            return gather_kv(self.local, k, v)
        except RuntimeError as exc:
            raise self.group.failed(exc) from exc

    def update_weights(self, weights: Any, source: str) -> None:
        raise RequestError(
            f"updating weights is not supported at tp={self.group.config.tp}: expected tp=1"
            " (or restart the server with the new --model)"
        )


def _exit_status(process: Any, timeout: float = 2.0) -> int | None:
    """The exit status of a worker that is exiting (its pipe or sentinel said so). Its pipe
    closes a moment before the status is readable; and the watchdog and the thread that
    started the group both reap it: the one that loses that race reads no status until the
    other has stored it. None only if it is still running after `timeout`."""
    deadline = time.monotonic() + timeout
    while process.exitcode is None and time.monotonic() < deadline:  # `exitcode` reaps
        time.sleep(0.01)
    return process.exitcode


def _died_at_start(rank: int, process: Any) -> str:
    """The line for a worker that exited before running Lockstep's code: the cause is in its
    traceback on stderr; the usual one is a script without a `__main__` guard, which every
    spawned worker re-runs when it imports the script."""
    return (
        f"tensor-parallel worker rank {rank} (pid {process.pid}) exited with status "
        f"{_exit_status(process)} before it started (its error is above, on stderr); a script that "
        'starts an engine with tp > 1 must do so under `if __name__ == "__main__":`, '
        "since each worker process re-imports the script"
    )
