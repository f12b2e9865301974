"""The bridge between asyncio handlers and the single-threaded `Engine`.

`Engine` is not thread-safe, so exactly one dedicated thread ever touches it. Handlers talk to
that thread through a command queue; the thread runs commands between engine steps and hands
each `StepOutput` back to the event loop with `call_soon_threadsafe`:

    handler (event loop)                 engine thread
    --------------------                 -------------
    RequestGroup.add ----- command ----> engine.add_request   (RequestError comes back)
    RequestGroup.abort --- command ----> engine.abort_request (slots freed at once)
    AsyncEngine.call(fn) - command ----> fn(engine)           (stats, flush_cache, ...)
    group.queue <-- call_soon_threadsafe -- engine.step() outputs

While requests are unfinished the thread steps continuously, taking new commands between
steps; when idle it sleeps on a condition variable. A command therefore waits at most one step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from lockstep.engine.outputs import StepOutput
from lockstep.engine.sampling_params import SamplingParams
from lockstep.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineFailure(Exception):
    """The engine raised inside `step()`, or is stopping: every request in flight is failed
    with this. `unavailable` marks the second case (a 503, not a bug)."""

    def __init__(self, message: str, *, unavailable: bool = False) -> None:
        super().__init__(message)
        self.unavailable = unavailable


class Overloaded(Exception):
    """More sequences than the server admits are in flight: the request is refused before
    any work (a 429 with Retry-After), so a client or load balancer can go elsewhere."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class AsyncEngine:
    """Owns the engine and its thread. Create it, `start()` it inside the event loop,
    `stop()` it on shutdown (after the HTTP server has drained its connections).

    Admission: at most `capacity` engine requests (sequences) are in flight at once, the
    running ones and those waiting for a running slot; `RequestGroup.add` reserves its
    sequences first and raises `Overloaded` beyond that. Counted on the event loop only."""

    def __init__(self, engine: Any, metrics: ServerMetrics, capacity: int | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.capacity = capacity
        self.in_flight = 0
        self._commands: deque[Callable[[], None]] = deque()
        self._wakeup = threading.Condition()
        self._stopping = False
        self._shedding = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # request_id -> (group, choice index); touched only on the engine thread.
        self._routes: dict[str, tuple[RequestGroup, int]] = {}
        self._ids = itertools.count()
        self.last_failure: str | None = None  # the last engine step error, for /v1/engine
        self._admission_open = asyncio.Event()  # cleared while a weight update drains
        self._admission_open.set()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="lockstep-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever still runs (the HTTP server has already drained or given up on its
        connections) and end the thread."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return (
            self._thread is not None
            and self._thread.is_alive()
            and not self._stopping
            and not self._shedding
            and getattr(self.engine, "failure", None) is None
        )

    def shed(self, reason: str) -> None:
        """Fail every request in flight as unavailable (a 503, or an error event ending a
        stream) and refuse new ones: the end of a shutdown's grace period, so that each
        client gets an answer before the connections close. Callable from any thread."""
        self._shedding = True
        self._post(lambda: self._abort_all(reason, unavailable=True))

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{time.time_ns()}"

    def reserve(self, n: int) -> None:
        """Admit n more sequences, or raise `Overloaded` (event loop only)."""
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

    # -- commands --------------------------------------------------------------------------

    def _post(self, command: Callable[[], None]) -> None:
        with self._wakeup:
            self._commands.append(command)
            self._wakeup.notify()

    async def call(self, fn: Callable[[Any], T]) -> T:
        """Run `fn(engine)` on the engine thread and return its result (or raise its error)."""
        if not self.alive:
            raise EngineFailure("the engine is not running", unavailable=True)
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def command() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(self.engine))
            except BaseException as exc:  # handed to the awaiting handler, whatever it is
                future.set_exception(exc)

        self._post(command)
        return await asyncio.wrap_future(future)

    async def add_requests(
        self,
        group: RequestGroup,
        requests: list[tuple[str, list[int], SamplingParams]],
        namespace: str | None,
    ) -> None:
        """Add a group's requests in one command turn, all or none: if the engine refuses one
        (its `RequestError` is re-raised here), those already added are aborted."""

        def register(engine: Any) -> None:
            added: list[str] = []
            try:
                for index, (request_id, prompt, params) in enumerate(requests):
                    engine.add_request(request_id, prompt, params, namespace=namespace)
                    added.append(request_id)
                    self._routes[request_id] = (group, index)
            except BaseException:
                for request_id in added:
                    self._routes.pop(request_id, None)
                    engine.abort_request(request_id)
                raise

        await self.call(register)

    def finish_aborted(self, request_ids: list[str] | None = None) -> None:
        """Abort requests (None: every request in flight) and hand each its closing output
        (finish reason "abort", the text and counts so far), queued behind the outputs it
        already produced, so its handler answers with what was generated (SGLang's
        `/abort_request`). Fire and forget, like `abort`."""

        def command() -> None:
            ids = list(self._routes) if request_ids is None else request_ids
            for request_id in ids:
                route = self._routes.pop(request_id, None)
                if route is None:
                    continue
                try:
                    output = self.engine.abort_request(request_id)
                except Exception:
                    logger.exception("aborting %s failed", request_id)
                    continue
                if output is not None:
                    assert self._loop is not None
                    group, index = route
                    self._loop.call_soon_threadsafe(group.queue.put_nowait, (index, output))

        self._post(command)

    # -- admission pause (weight updates) --------------------------------------------------

    def pause_admission(self) -> None:
        """New request groups wait in `RequestGroup.add` until `resume_admission` (event
        loop only); those already admitted run on."""
        self._admission_open.clear()

    def resume_admission(self) -> None:
        self._admission_open.set()

    async def wait_for_admission(self) -> None:
        await self._admission_open.wait()

    def abort(self, request_id: str) -> None:
        """Fire and forget: the engine frees the request's KV slots at its next command turn."""

        def command() -> None:
            if self._routes.pop(request_id, None) is not None:
                try:
                    self.engine.abort_request(request_id)
                except Exception:
                    logger.exception("aborting %s failed", request_id)

        self._post(command)

    # -- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        busy = False
        while True:
            with self._wakeup:
                while not self._commands and not busy and not self._stopping:
                    self._wakeup.wait()
                commands = list(self._commands)
                self._commands.clear()
                stopping = self._stopping
            for command in commands:
                command()
            if stopping:
                self._abort_all("the server is shutting down", unavailable=True)
                return
            busy = self.engine.has_unfinished()
            if not busy:
                continue
            try:
                started = time.perf_counter()
                outputs = self.engine.step()
            except Exception as exc:
                # A bug, not a client mistake: fail what is in flight, keep serving.
                logger.exception("engine step failed")
                self.last_failure = f"{type(exc).__name__}: {exc}"
                self._abort_all(f"engine step failed: {exc}")
                busy = self.engine.has_unfinished()
                continue
            self.metrics.observe_step(
                time.perf_counter() - started, sum(len(o.new_token_ids) for o in outputs)
            )
            self._dispatch(outputs)
            busy = self.engine.has_unfinished()

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        assert self._loop is not None
        for output in outputs:
            route = self._routes.get(output.request_id)
            if route is None:
                continue  # aborted by its client after this step began
            if output.finished:
                del self._routes[output.request_id]
            group, index = route
            self._loop.call_soon_threadsafe(group.queue.put_nowait, (index, output))

    def _abort_all(self, reason: str, *, unavailable: bool = False) -> None:
        assert self._loop is not None
        for request_id, (group, index) in list(self._routes.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("aborting %s failed", request_id)
            self._loop.call_soon_threadsafe(
                group.queue.put_nowait, (index, EngineFailure(reason, unavailable=unavailable))
            )
        self._routes.clear()


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
        self, requests: list[tuple[list[int], SamplingParams]], namespace: str | None
    ) -> None:
        """Add one engine request per (prompt, params), indexed in order; raises `Overloaded`
        beyond the server's capacity, or the engine's `RequestError` if it refuses one (and
        adds none either way). While a weight update pauses admission, it waits first."""
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
                self, [(rid, p, sp) for rid, (p, sp) in zip(ids, requests, strict=True)], namespace
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
        for index in sorted(self._unfinished):
            self._engine.abort(self.request_ids[index])
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
