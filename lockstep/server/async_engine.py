"""The front end's view of the engine: admission, request routing and named engine calls,
on the HTTP process's event loop. The engine itself runs behind an `EngineLink`: in a process
of its own (engine_process.py, what `lockstep serve` uses) or on a thread of this process
(engine_loop.EngineThread, for tests serving a fake engine). Both take the commands and give
the events of engine_wire.py:

    handler (event loop)                 engine loop (engine process or thread)
    --------------------                 --------------------------------------
    RequestGroup.add ----- AddRequests --> engine.add_request   (RequestError comes back)
    RequestGroup.abort --- Abort --------> engine.abort_request (slots freed at once)
    AsyncEngine.stats() -- Call ---------> ENGINE_CALLS["stats"](engine), flush_cache, ...
    group.queue <-- _on_event <-- Outputs -- engine.step()

Which HTTP request an engine request belongs to is known here only: outputs of a request
whose group has left (aborted) are dropped on arrival. When the engine sends token ids only
(the engine process), each request's text and stop strings are made here (output_text.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from lockstep.engine.outputs import StepOutput
from lockstep.engine.sampling_params import SamplingParams
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
)
from lockstep.server.metrics import ServerMetrics
from lockstep.server.output_text import OutputText

logger = logging.getLogger(__name__)

_DRAIN_POLL_S = 0.02  # how often a weight update looks whether the requests in flight ended


class EngineFailure(Exception):
    """The engine raised inside `step()`, is stopping, or is gone: every request in flight is
    failed with this. `unavailable` marks the last two (a 503, not a bug)."""

    def __init__(self, message: str, *, unavailable: bool = False) -> None:
        super().__init__(message)
        self.unavailable = unavailable


class Overloaded(Exception):
    """More sequences than the server admits are in flight: the request is refused before
    any work (a 429 with Retry-After), so a client or load balancer can go elsewhere."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineLink(Protocol):
    """An engine loop somewhere (engine_process.EngineProcess, engine_loop.EngineThread)."""

    info: EngineInfo
    grammars: Any  # a GrammarCompiler for the front end's checks, or None

    def start(self, deliver: Callable[[Event], None]) -> None:
        """Start the loop; `deliver(event)` is then called for every event, on any thread."""

    def send(self, command: Command) -> None:
        """Queue a command (never blocks for long; ignored once the engine is gone)."""

    def close(self, timeout: float = 10.0) -> None:
        """Stop the loop (it aborts what still runs) and wait for it."""


class AsyncEngine:
    """The engine as the routes see it. Create it, `start()` it inside the event loop,
    `await stop()` on shutdown (after the HTTP server has drained its connections).

    Admission: at most `capacity` engine requests (sequences) are in flight at once, the
    running ones and those waiting for a running slot; `RequestGroup.add` reserves its
    sequences first and raises `Overloaded` beyond that. Everything here runs on the event
    loop, but `shed` (any thread)."""

    def __init__(
        self, link: EngineLink, metrics: ServerMetrics, capacity: int | None = None
    ) -> None:
        self.link = link
        self.info = link.info
        self.metrics = metrics
        self.capacity = capacity
        self.in_flight = 0
        self.fingerprint = dict(link.info.fingerprint)  # refreshed by a weight update
        self.failure: str | None = None  # why the engine cannot go on (its process died)
        self.last_failure: str | None = None  # the last engine step error, for /v1/engine
        self._stopping = False
        self._shedding = False
        self._loop: asyncio.AbstractEventLoop | None = None
        # request_id -> its group, its choice index there, and its text when made here.
        self._routes: dict[str, tuple[RequestGroup, int, OutputText | None]] = {}
        self._replies: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._calls = itertools.count()
        self._admission_open = asyncio.Event()  # cleared while a weight update drains
        self._admission_open.set()
        # RL control (rl_api.py): the pause mode while generation is paused, and the lock
        # that runs one weight update (or pause, or memory change) at a time.
        self.generation_paused: str | None = None
        self.memory_released: list[str] = []  # tags of memory handed back to the device
        self.control_lock = asyncio.Lock()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        loop = self._loop
        self.link.start(lambda event: loop.call_soon_threadsafe(self._on_event, event))

    async def stop(self, timeout: float = 10.0) -> None:
        """Fail whatever still runs (the HTTP server has already drained or given up on its
        connections) and stop the engine."""
        self._stopping = True
        self._fail_all(EngineFailure("the server is shutting down", unavailable=True))
        await asyncio.to_thread(self.link.close, timeout)

    @property
    def alive(self) -> bool:
        return (
            self._loop is not None
            and not self._stopping
            and not self._shedding
            and self.failure is None
        )

    @property
    def weight_version(self) -> str:
        # (An engine without versions, a test's fake, serves SGLang's first one.)
        return self.fingerprint.get("weight_version", "default")

    def shed(self, reason: str) -> None:
        """Fail every request in flight as unavailable (a 503, or an error event ending a
        stream) and refuse new ones: the end of a shutdown's grace period, so that each
        client gets an answer before the connections close. Callable from any thread."""
        self._shedding = True
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._shed, reason)

    def _shed(self, reason: str) -> None:
        ids = list(self._routes)
        self._fail_all(EngineFailure(reason, unavailable=True))
        if ids:
            self.link.send(Abort(ids))

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{time.time_ns()}"

    def reserve(self, n: int) -> None:
        """Admit n more sequences, or raise `Overloaded`."""
        self._refuse_beyond(n)
        self.in_flight += n

    def refuse_if_full(self) -> None:
        """Raise `Overloaded` while no sequence can be admitted: the routes ask before any
        work (tokenizing, templating), so a full server refuses at the cost of parsing."""
        self._refuse_beyond(1)

    def _refuse_beyond(self, n: int) -> None:
        if self.capacity is not None and self.in_flight + n > self.capacity:
            raise Overloaded(
                f"The server is at capacity ({self.in_flight} of {self.capacity} sequences in"
                f" flight, {n} more asked for): retry later",
                retry_after_s=1,
            )

    def release(self, n: int) -> None:
        self.in_flight -= n

    # -- named engine calls ----------------------------------------------------------------

    async def _call(self, command: type[Command], *args: Any) -> Any:
        """Send `command(call_id, *args)`, one of the commands answered with a `Reply`, and
        return its value (or raise its error)."""
        if not self.alive:
            raise EngineFailure(self.failure or "the engine is not running", unavailable=True)
        assert self._loop is not None
        call_id = next(self._calls)
        future = self._loop.create_future()
        self._replies[call_id] = future
        try:
            self.link.send(command(call_id, *args))
            return await future
        finally:
            self._replies.pop(call_id, None)

    async def stats(self) -> dict[str, Any]:
        return await self._call(Call, "stats", ())

    async def snapshot(self) -> dict[str, Any]:
        """The engine's stats, fingerprint and config, read in one command turn."""
        return await self._call(Call, "snapshot", ())

    async def flush_cache(self) -> int:
        return await self._call(Call, "flush_cache", ())

    async def update_weights_from_disk(self, path: str, version: str | None) -> None:
        self.fingerprint = await self._call(Call, "update_weights_from_disk", (path, version))

    async def add_requests(
        self,
        group: RequestGroup,
        requests: list[tuple[str, list[int], SamplingParams]],
        namespace: str | None,
        stream: bool = False,
    ) -> None:
        """Add a group's requests in one command turn, all or none: if the engine refuses one,
        its `RequestError` is re-raised here and none was added. `stream`: the client reads
        their tokens as they come (the scheduler bounds their inter-token latency)."""
        tokenizer = None if self.info.detokenizes else self.info.tokenizer
        for index, (request_id, prompt, params) in enumerate(requests):
            text = None if tokenizer is None else OutputText(tokenizer, prompt, params)
            self._routes[request_id] = (group, index, text)
        try:
            await self._call(AddRequests, requests, namespace, stream)
        except BaseException:
            for request_id, _, _ in requests:
                self._routes.pop(request_id, None)
            raise

    async def pause_generation(self, mode: str) -> int:
        """Stop the engine's steps (engine_loop.py, `Pause`); returns how many requests it
        ended ("abort"), retracted ("retract") or holds ("in_place")."""
        count = await self._call(Pause, mode)
        self.generation_paused = mode
        return count

    async def continue_generation(self) -> None:
        await self._call(Continue)
        self.generation_paused = None

    async def release_memory(self, tags: list[str] | None) -> list[str]:
        """Free the KV pool's and/or the weights' memory (engine_loop.py, `ReleaseMemory`); returns
        the tags now released."""
        self.memory_released = await self._call(ReleaseMemory, tags)
        return self.memory_released

    async def resume_memory(self, tags: list[str] | None) -> list[str]:
        self.memory_released = await self._call(ResumeMemory, tags)
        return self.memory_released

    async def engine_call(self, name: str, *args: Any) -> Any:
        """A named engine call (engine_loop.ENGINE_CALLS) and its value."""
        return await self._call(Call, name, args)

    async def quiesce_for_weights(self, abort_all: bool) -> None:
        """Make the engine ready for new weights, SGLang's way: `abort_all` ends every
        request with what it has; otherwise, unless generation is paused (nothing then
        runs: a pause in place leaves its requests running, and the engine refuses the
        update), the requests in flight finish on the old weights. Call with admission
        paused."""
        if abort_all:
            self.finish_aborted(None)
        if self.generation_paused is not None:
            return
        while self.in_flight:
            await asyncio.sleep(_DRAIN_POLL_S)

    def finish_aborted(self, request_ids: list[str] | None = None) -> None:
        """Abort requests (None: every request in flight) and hand each its closing output
        (finish reason "abort", the text and counts so far), queued behind the outputs it
        already produced, so its handler answers with what was generated (SGLang's
        `/abort_request`). Fire and forget, like `abort`."""
        self.link.send(Finish(request_ids))

    def abort(self, request_ids: list[str]) -> None:
        """Fire and forget: the engine frees the requests' KV slots at its next command turn."""
        for request_id in request_ids:
            self._routes.pop(request_id, None)
        if request_ids:
            self.link.send(Abort(request_ids))

    # -- admission pause (weight updates) --------------------------------------------------

    def pause_admission(self) -> None:
        """New request groups wait in `RequestGroup.add` until `resume_admission`; those
        already admitted run on."""
        self._admission_open.clear()

    def resume_admission(self) -> None:
        self._admission_open.set()

    async def wait_for_admission(self) -> None:
        await self._admission_open.wait()

    # -- events ----------------------------------------------------------------------------

    def _on_event(self, event: Event) -> None:
        match event:
            case Outputs(outputs, step_seconds, new_tokens):
                if step_seconds is not None:
                    self.metrics.observe_step(step_seconds, new_tokens)
                self._dispatch(outputs)
            case Reply(call_id, value, error):
                future = self._replies.get(call_id)
                if future is None or future.done():
                    return  # its caller was cancelled
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(value)
            case StepFailed(message, request_ids):
                self.last_failure = message
                failure = EngineFailure(f"engine step failed: {message}")
                for request_id in request_ids:
                    route = self._routes.pop(request_id, None)
                    if route is not None:
                        route[0].queue.put_nowait((route[1], failure))
            case Fatal(message):
                if self.failure is None:
                    logger.error("%s", message)
                self.failure = message
                self._fail_all(EngineFailure(message, unavailable=True))
            case _:
                raise TypeError(f"unknown engine event {event!r}")

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        routes = self._routes
        stopped: list[str] = []  # ended here by a stop string, still running in the engine
        for output in outputs:
            route = routes.get(output.request_id)
            if route is None:
                continue  # aborted by its client after this step began, or stopped here
            group, index, text = route
            if text is not None and text.fill(output):
                stopped.append(output.request_id)
            if output.finished:
                del routes[output.request_id]
            group.queue.put_nowait((index, output))
        if stopped:
            self.link.send(Abort(stopped))

    def _fail_all(self, failure: EngineFailure) -> None:
        for group, index, _ in self._routes.values():
            group.queue.put_nowait((index, failure))
        self._routes.clear()
        for future in self._replies.values():
            if not future.done():
                future.set_exception(failure)


class RequestGroup:
    """The engine requests behind one HTTP request (one per prompt and choice), with one
    queue that merges their outputs. Use as an async context manager: leaving it aborts every
    request that has not finished (client gone, error, cancellation), so no slot leaks."""

    def __init__(self, engine: AsyncEngine, prefix: str) -> None:
        self._engine = engine
        self._prefix = prefix
        self.queue: asyncio.Queue[tuple[int, StepOutput | EngineFailure]] = asyncio.Queue()
        self.request_ids: list[str] = []
        self._unfinished: set[int] = set()
        self._reserved = 0  # sequences admitted by the engine's capacity, released on exit

    async def __aenter__(self) -> RequestGroup:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.abort()

    async def add(
        self,
        requests: list[tuple[list[int], SamplingParams]],
        namespace: str | None,
        stream: bool = False,
    ) -> None:
        """Add one engine request per (prompt, params), indexed in order; raises `Overloaded`
        beyond the server's capacity, or the engine's `RequestError` if it refuses one (and
        adds none either way). While a weight update pauses admission, it waits first.
        `stream`: the response is streamed (`AsyncEngine.add_requests`)."""
        await self._engine.wait_for_admission()
        self._engine.reserve(len(requests))
        self._reserved = len(requests)
        ids = [f"{self._prefix}-{i}" for i in range(len(requests))]
        # Known before the await: a cancellation mid-add still aborts them (below; the abort
        # commands queue behind the add command).
        self.request_ids = ids
        self._unfinished = set(range(len(ids)))
        try:
            await self._engine.add_requests(
                self,
                [(rid, p, sp) for rid, (p, sp) in zip(ids, requests, strict=True)],
                namespace,
                stream,
            )
        except Exception:  # refused: nothing was added
            self._unfinished.clear()
            self.abort()
            raise
        except BaseException:  # cancelled: abort what the add command may still register
            self.abort()
            raise

    def abort(self) -> None:
        """Abort every unfinished request and give back the group's admitted sequences
        (idempotent: called on exit, after a stream ends and by its background task)."""
        self._engine.abort([self.request_ids[i] for i in sorted(self._unfinished)])
        self._unfinished.clear()
        self._engine.release(self._reserved)
        self._reserved = 0

    async def outputs(self) -> AsyncIterator[tuple[int, StepOutput]]:
        """Yield (choice index, output) until every request finished; records TTFT and
        inter-token latency. Raises `EngineFailure` if the engine failed them."""
        metrics = self._engine.metrics
        started = time.perf_counter()
        last_token_at: dict[int, float] = {}
        while self._unfinished:
            index, output = await self.queue.get()
            if isinstance(output, EngineFailure):
                self._unfinished.clear()
                raise output
            now = time.perf_counter()
            if output.new_token_ids:
                if index not in last_token_at:
                    metrics.time_to_first_token.observe(now - started)
                else:
                    gap = (now - last_token_at[index]) / len(output.new_token_ids)
                    for _ in output.new_token_ids:
                        metrics.inter_token_latency.observe(gap)
                last_token_at[index] = now
            if output.finished:
                self._unfinished.discard(index)
                metrics.request_latency.observe(now - started)
                metrics.requests_finished.labels(output.finish_reason or "unknown").inc()
            yield index, output
