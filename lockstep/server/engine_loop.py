"""The engine side of the server: one loop that owns the `Engine`, runs commands between steps
and reports what happened as events. The same loop runs in the engine process
(engine_process.py, what `lockstep serve` uses) and on a thread of the HTTP process
(`EngineThread`, for tests that serve a fake engine); the front end (async_engine.py) sees
the same commands and events either way.

Commands (front end -> loop) and events (loop -> front end) are the frozen dataclasses of
engine_wire.py:

    AddRequests(call_id, [(request_id, prompt_ids, params), ...], namespace, stream)   all or none
    Abort([request_id, ...])                  free the requests' slots, no further output
    Finish([request_id, ...] | None)          abort, each with its closing output (None: all)
    Call(call_id, name, args)                 a named engine call (`ENGINE_CALLS`)
    Pause(call_id, mode)                      stop stepping: "abort" | "retract" | "in_place"
    Continue(call_id)                         step again
    ReleaseMemory(call_id, tags | None)       free the KV pool and/or the weights' memory
    ResumeMemory(call_id, tags | None)        take it again (memory_occupation.py)
    Stop()                                    abort whatever runs and end the loop

    Outputs([StepOutput, ...], step_seconds | None, new_tokens)
    Reply(call_id, value, error)              error: None or the exception the call raised
    StepFailed(message, [request_id, ...])    a step raised; those requests were aborted
    Fatal(message)                            the engine cannot compute another step

A request answered whole (not streamed) without stop strings gets its first output as it
comes and the rest merged into one at its end (held_outputs.py): no per-token traffic.

While requests are unfinished the loop steps continuously, taking new commands between steps;
when idle it sleeps on a condition variable. A command therefore waits at most one step.
A paused loop (SGLang's `/pause_generation`, lockstep/server/rl_api.py) takes commands and
queues new requests but runs no step until "continue"; before it pauses it completes the step
launched ahead, so nothing runs on the device and every output computed so far is delivered.
While memory is released (lockstep/engine/memory_occupation.py) the loop takes no step either,
and refuses weight updates while the weights are released.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from lockstep.errors import LockstepError, RequestError
from lockstep.server.engine_wire import (
    Abort,
    AddRequests,
    Call,
    Command,
    Continue,
    EngineInfo,
    Event,
    Fatal,
    Finish,
    Outputs,
    Pause,
    ReleaseMemory,
    Reply,
    ResumeMemory,
    StepFailed,
    Stop,
)
from lockstep.server.held_outputs import HeldOutputs

logger = logging.getLogger(__name__)


def _snapshot(engine: Any) -> dict[str, Any]:
    budget = engine.kv_budget
    return {
        "stats": engine.stats(),
        "fingerprint": engine.fingerprint(),
        "config": engine.config,
        # How the pool was sized (None: kv_tokens given) and the memory it may reach (CUDA).
        "kv_budget": None if budget is None else budget.as_dict(),
        "memory": engine.memory_bound(),
    }


def _update_weights_from_disk(engine: Any, path: str, version: str | None) -> dict[str, Any]:
    engine.update_weights_from_disk(path, version)
    return engine.fingerprint()  # the weights now served, for the front end's copy


def _set_weight_version(engine: Any, version: str) -> dict[str, Any]:
    engine.weight_version = version  # the same weights under a new name
    return engine.fingerprint()


def _weight_receiver() -> Any:
    from lockstep.engine import weight_receiver  # torch.distributed: loaded on first use

    return weight_receiver


_WEIGHT_UPDATES = (
    "update_weights_from_disk",
    "update_weights_from_distributed",
    "update_weights_from_tensor",
)

# What the front end may ask of the engine by name: the only engine calls that cross to it.
ENGINE_CALLS: dict[str, Callable[..., Any]] = {
    "stats": lambda engine: engine.stats(),
    "snapshot": _snapshot,
    "flush_cache": lambda engine: engine.flush_cache(),
    "update_weights_from_disk": _update_weights_from_disk,
    "init_weights_update_group": lambda e, *a: _weight_receiver().init_group(e, *a),
    "update_weights_from_distributed": lambda e, *a: _weight_receiver().update_from_group(e, *a),
    "destroy_weights_update_group": lambda e, *a: _weight_receiver().destroy_group(e, *a),
    "update_weights_from_tensor": lambda e, *a: _weight_receiver().update_from_safetensors(e, *a),
    "update_weight_version": _set_weight_version,
}


class EngineLoop:
    """Runs `engine` and its commands on the calling thread (`run`); `post` is callable from
    any thread. `emit(event)` is called on the loop's thread and must not block for long."""

    def __init__(self, engine: Any, emit: Callable[[Event], None]) -> None:
        self.engine = engine
        self._emit = emit
        self._commands: deque[Command] = deque()
        self._wakeup = threading.Condition()
        self._stopping = False
        self.paused: str | None = None  # the pause mode while paused
        self._memory: Any = None  # a MemoryOccupation, made at the first release
        # Requests answered whole: their outputs past the first go out merged at their end.
        self._held = HeldOutputs()

    def post(self, command: Command) -> None:
        with self._wakeup:
            self._commands.append(command)
            if isinstance(command, Stop):
                self._stopping = True
            self._wakeup.notify()

    def run(self) -> None:
        """Step while requests are unfinished, run commands between steps; return after a
        "stop" command, with every request aborted."""
        busy = False
        while True:
            with self._wakeup:
                while not self._commands and not busy and not self._stopping:
                    self._wakeup.wait()
                commands = list(self._commands)
                self._commands.clear()
            for command in commands:
                if isinstance(command, Stop):
                    self._abort_all()
                    return
                self._run_command(command)
            busy = self._may_step()
            if busy:
                self._step()
                busy = self._may_step()

    def _may_step(self) -> bool:
        released = self._memory is not None and self._memory.released
        return self.engine.has_unfinished() and self.paused is None and not released

    def _step(self) -> None:
        try:
            started = time.perf_counter()
            outputs = self.engine.step()
        except Exception as exc:
            # A bug, not a client mistake: fail what is in flight, keep serving.
            logger.exception("engine step failed")
            message = f"{type(exc).__name__}: {exc}"
            self._emit(StepFailed(message, self._abort_all()))
            return
        took = time.perf_counter() - started
        new_tokens = sum(len(o.new_token_ids) for o in outputs)
        self._emit(Outputs(self._held.pass_on(outputs), took, new_tokens))

    def _run_command(self, command: Command) -> None:
        match command:
            case AddRequests(call_id, requests, namespace, stream):
                self._reply(call_id, lambda: self._add(requests, namespace, stream))
            case Abort(request_ids):
                for request_id in request_ids:
                    self._abort(request_id)
            case Finish(request_ids):
                ids = list(self.engine.requests) if request_ids is None else request_ids
                closing = [out for out in map(self._abort, ids) if out is not None]
                if closing:
                    self._emit(Outputs(closing, None, 0))
            case Call(call_id, name, args):
                if name in _WEIGHT_UPDATES and self._memory is not None:
                    if "weights" in self._memory.released:
                        error = RequestError("the weights are released: resume them first"
                                             " (/resume_memory_occupation)")  # fmt: skip
                        self._emit(Reply(call_id, None, error))
                        return
                self._reply(call_id, lambda: ENGINE_CALLS[name](self.engine, *args))
            case ReleaseMemory(call_id, tags):
                self._reply(call_id, lambda: self._occupation("release", tags))
            case ResumeMemory(call_id, tags):
                self._reply(call_id, lambda: self._occupation("resume", tags))
            case Pause(call_id, mode):
                self._reply(call_id, lambda: self._pause(mode))
            case Continue(call_id):
                self.paused = None
                self._emit(Reply(call_id, None, None))
            case _:
                raise ValueError(f"unknown engine command {command!r}")

    def _occupation(self, kind: str, tags: list[str] | None) -> list[str]:
        """Release or resume memory; returns the tags released afterwards."""
        from lockstep.engine.memory_occupation import MemoryOccupation, parse_tags

        if self._memory is None:
            self._memory = MemoryOccupation(self.engine)
        if kind == "release":
            self._memory.release(parse_tags(tags))
        else:
            self._memory.resume(parse_tags(tags))
        return sorted(self._memory.released)

    def _pause(self, mode: str) -> int:
        """Stop stepping after delivering the step launched ahead. "abort": every request
        ends with finish reason "abort" and what it has; "retract": running requests wait
        again, their KV in the radix cache; "in_place": they keep their KV. Returns how many
        requests it ended, retracted or holds."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"unknown pause mode {mode!r}")
        self.paused = mode
        done = self.engine.complete_launched_step()
        if done:
            new_tokens = sum(len(o.new_token_ids) for o in done)
            self._emit(Outputs(self._held.pass_on(done), None, new_tokens))
        if mode == "abort":
            closing = [out for out in map(self._abort, list(self.engine.requests)) if out]
            if closing:
                self._emit(Outputs(closing, None, 0))
            return len(closing)
        if mode == "retract":
            return self.engine.retract_running()
        return len(self.engine.requests)

    def _reply(self, call_id: int, fn: Callable[[], Any]) -> None:
        try:
            value = fn()
        except LockstepError as exc:  # the user's mistake or the model's: said as is
            self._emit(Reply(call_id, None, exc))
        except Exception as exc:
            logger.exception("engine call failed")
            # Re-raised on the front end, perhaps in another process: a plain error that is
            # sure to cross.
            self._emit(Reply(call_id, None, RuntimeError(f"{type(exc).__name__}: {exc}")))
        else:
            self._emit(Reply(call_id, value, None))

    def _add(
        self, requests: list[tuple[str, list[int], Any]], namespace: str | None, stream: bool
    ) -> None:
        added: list[str] = []
        try:
            for request_id, prompt, params in requests:
                self.engine.add_request(
                    request_id, prompt, params, namespace=namespace, stream=stream
                )
                added.append(request_id)
                self._held.track(request_id, params, stream)
        except BaseException:
            for request_id in added:
                self._abort(request_id)
            raise

    def _abort(self, request_id: str) -> Any:
        """The request's closing output, with what was held of it (None: it had finished
        already, or is unknown)."""
        try:
            closing = self.engine.abort_request(request_id)
        except Exception:
            logger.exception("aborting %s failed", request_id)
            closing = None
        return self._held.close(request_id, closing)

    def _abort_all(self) -> list[str]:
        ids = list(self.engine.requests)
        for request_id in ids:
            self._abort(request_id)
        return ids


class EngineThread:
    """An engine in the HTTP process, its loop on a thread: for tests that serve a fake
    engine in-process (tests/server/test_server.py's `_FaultyEngine`). `lockstep serve` runs
    the engine in a process of its own (engine_process.py); both are an `EngineLink`."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.info = EngineInfo.of(engine)
        self.grammars = getattr(engine, "grammars", None)  # shares the engine's cache
        self._loop: EngineLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, deliver: Callable[[Event], None]) -> None:
        self._loop = EngineLoop(self.engine, deliver)
        on_failure = getattr(self.engine, "on_failure", None)
        if on_failure is not None:
            on_failure(lambda message: deliver(Fatal(message)))
        self._thread = threading.Thread(target=self._loop.run, name="lockstep-engine", daemon=True)
        self._thread.start()

    def send(self, command: Command) -> None:
        assert self._loop is not None
        self._loop.post(command)

    def close(self, timeout: float = 10.0) -> None:
        if self._loop is not None:
            self._loop.post(Stop())
        if self._thread is not None:
            self._thread.join(timeout)
