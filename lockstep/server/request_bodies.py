"""How request bodies are read: bounded in size, the big ones within a byte budget, parsed and
validated off the event loop.

- `BodySizeLimit` refuses a body over the byte limit (413) before it is read into memory,
  whether its length is declared or it arrives chunked.
- `big_body_route` makes the API's routes read a body of `BIG_BODY_BYTES` or more (or a
  chunked one) within a `BodyBudget`: the bytes of such bodies in memory, counted as they
  arrive, stay within `BODY_BUDGET_BYTES` (plus the oldest body being read, which never waits,
  so bodies cannot wait for each other for ever). A body whose next bytes do not fit waits
  for them unread, its connection paused by flow control; a client that stops sending holds
  only what it sent, until its connection's idle timeout (`connections.py`) closes it. So
  twenty 16 MB bodies at once cost about the budget, and a stalled body blocks no other. Each
  body is then parsed as JSON and validated against the route's model in a worker thread,
  one at a time (`json.loads` holds the interpreter lock anyway), so `/health` and small
  requests keep the event loop while a 16 MB body is parsed (16 MB of token ids take seconds
  to validate). Once its request is answered, the allocator's free pages go back to the OS.
- In a big body, a list longer than `max_model_len` is refused before validation: no prompt of
  more tokens fits, and validating millions of ids is the expensive part.
- `UnfinishedBodies` handles a body that has not all arrived when its answer goes: the answer
  says `Connection: close` (the connection cannot carry another request before the rest is
  read, and reading it is what a refusal avoids; `connections.py` closes it), and once the
  body reads are shed (the end of a shutdown's grace period, or the engine process's death:
  `BodyReads`) a body still awaited is answered with a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import email.message
import itertools
import json
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from lockstep.server.protocol import APIError

MAX_BODY_BYTES = 32 * 1024 * 1024
# Smaller bodies are parsed on the event loop: at most a few milliseconds each.
BIG_BODY_BYTES = 64 * 1024
# Bytes of big bodies held at once, besides the oldest one being read: one body of the size
# limit, what the single slot that came before the budget held at most.
BODY_BUDGET_BYTES = MAX_BODY_BYTES

_T = TypeVar("_T")


class BodyRefused(StarletteHTTPException):
    """A big body refused while it was parsed off the event loop. An `HTTPException`, the one
    kind FastAPI lets out of its body parsing unchanged; `http_errors.py` answers `error`."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.status, error.message)
        self.error = error


class BodySizeLimit:
    """Refuses a body over `max_bytes` (413) before it is read into memory: at once when its
    declared length is over, else (chunked) as soon as the bytes received pass it. Once a
    request that brought a big body is answered, the allocator's free pages go back to the OS.
    Plain ASGI, not `BaseHTTPMiddleware`, which would hide client disconnects from the routes."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            error = self._too_large()
            return await JSONResponse(error.body(), status_code=413)(scope, receive, send)
        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise BodyRefused(self._too_large())
            return message

        try:
            await self.app(scope, limited_receive, send)
        finally:
            if received >= BIG_BODY_BYTES:
                await asyncio.to_thread(release_free_memory)

    def _too_large(self) -> APIError:
        return APIError(
            f"The request body is larger than {self.max_bytes} bytes.",
            status=413,
            code="request_too_large",
        )


class BodyReads:
    """The end of the body reads: after `shed(reason)`, every body read waiting for bytes (or
    for room in the `BodyBudget`), and every one begun later, fails with a 503 (`code:
    unavailable`, `reason` its message), as `AsyncEngine.shed` fails the requests it runs. Shed
    at the end of a shutdown's grace period and when the engine process dies. Otherwise a
    client still sending (or one that never finishes) would hold its handler until uvicorn's
    own deadline, which cancels it: a plain-text 500 and a traceback."""

    def __init__(self) -> None:
        self._reason: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shed: asyncio.Event | None = None

    def shed(self, reason: str) -> None:
        """Callable from any thread (the shutdown's grace timer, the engine's reader)."""
        if self._reason is None:
            self._reason = reason
        if self._loop is not None and self._shed is not None:
            self._loop.call_soon_threadsafe(self._shed.set)

    async def receive(self, receive: Any) -> dict:
        """`receive()`, or `BodyRefused` (503) once shed."""
        return await self.wait(receive())

    async def wait(self, awaitable: Awaitable[_T]) -> _T:
        """`awaitable`'s result, or `BodyRefused` (503) once shed (`awaitable` cancelled)."""
        if self._shed is None:
            self._loop, self._shed = asyncio.get_running_loop(), asyncio.Event()
        if self._reason is not None:
            if isinstance(awaitable, Coroutine):
                awaitable.close()
            raise self._refusal()
        task = asyncio.ensure_future(awaitable)
        shed = asyncio.ensure_future(self._shed.wait())
        done = False
        try:
            await asyncio.wait((task, shed), return_when=asyncio.FIRST_COMPLETED)
            done = task.done()
        finally:  # this task cancelled too (uvicorn's deadline): neither is left pending
            shed.cancel()
            if not done:
                task.cancel()
        if done:
            return task.result()
        raise self._refusal()

    def _refusal(self) -> BodyRefused:
        return BodyRefused(
            APIError(str(self._reason), status=503, type="server_error", code="unavailable")
        )


class BodyBudget:
    """The bytes of big bodies in memory, bounded by `limit`. A body being read takes each
    chunk's bytes as it arrives (`BodyHold.take`) and gives them all back when its hold ends
    (read and parsed). Chunks that do not fit wait, first come first served, while their body
    stops reading (flow control then pauses its connection). The oldest body still being read
    never waits: it may go past the limit by its own bytes (one body of the size limit at most),
    and bodies waiting for each other's bytes always have one among them that goes on. A body
    whose client stops sending holds only the bytes it sent. Event-loop only."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._reading: dict[int, BodyHold] = {}  # oldest first
        self._waiting: deque[tuple[BodyHold, int, asyncio.Future[None]]] = deque()
        self._ids = itertools.count()

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[BodyHold]:
        """A hold for one body's bytes, given back on exit."""
        hold = BodyHold(self, next(self._ids))
        self._reading[hold.id] = hold
        try:
            yield hold
        finally:
            self._reading.pop(hold.id, None)
            for _, _, future in (entry for entry in self._waiting if entry[0] is hold):
                future.cancel()  # a wait left behind gets nothing more
            self.used -= hold.bytes
            hold.bytes = 0
            self._grant()

    def _fits(self, hold: BodyHold, n: int) -> bool:
        oldest = next(iter(self._reading.values()), None)
        return hold is oldest or (not self._waiting and self.used + n <= self.limit)

    def _give(self, hold: BodyHold, n: int) -> None:
        self.used += n
        hold.bytes += n

    def _grant(self) -> None:
        """Give waiting chunks their bytes: the oldest body's at once, the others in order
        while they fit."""
        oldest = next(iter(self._reading.values()), None)
        for entry in self._waiting:
            if entry[0] is oldest and not entry[2].done():
                self._waiting.remove(entry)
                self._give(oldest, entry[1])
                entry[2].set_result(None)
                break
        while self._waiting:
            hold, n, future = self._waiting[0]
            if future.done():  # its body stopped waiting (refused, shed, cancelled)
                self._waiting.popleft()
                continue
            if self.used + n > self.limit:
                break
            self._waiting.popleft()
            self._give(hold, n)
            future.set_result(None)


class BodyHold:
    """One body's bytes in a `BodyBudget`."""

    def __init__(self, budget: BodyBudget, hold_id: int) -> None:
        self.budget = budget
        self.id = hold_id
        self.bytes = 0

    def try_take(self, n: int) -> bool:
        """Take `n` bytes if they fit now."""
        if not self.budget._fits(self, n):
            return False
        self.budget._give(self, n)
        return True

    async def take(self, n: int) -> None:
        """Take `n` bytes, waiting until they fit."""
        if self.try_take(n):
            return
        budget = self.budget
        entry = (self, n, asyncio.get_running_loop().create_future())
        budget._waiting.append(entry)
        try:
            await entry[2]
        finally:
            if not entry[2].done() or entry[2].cancelled():
                entry[2].cancel()
                budget._grant()  # it may have been the head of the queue

    def done_reading(self) -> None:
        """The body has arrived: it is no longer the oldest being read (its bytes stay
        taken until the hold ends)."""
        self.budget._reading.pop(self.id, None)
        self.budget._grant()


class UnfinishedBodies:
    """For a request whose body has not all arrived: its response (a refusal sent before the
    body was read, such as a 413, 401 or 429) says `Connection: close`, and its body reads end
    when `reads` is shed. Once the body has arrived, `receive` is passed on untouched (the
    routes use it after that to notice a client going away). Plain ASGI, as above."""

    def __init__(self, app: Any, reads: BodyReads) -> None:
        self.app = app
        self.reads = reads

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        declared = headers.get(b"content-length", b"0")
        arrived = b"transfer-encoding" not in headers and declared in (b"0", b"")

        async def receive_body() -> dict:
            nonlocal arrived
            if arrived:
                return await receive()
            message = await self.reads.receive(receive)
            if message["type"] != "http.request" or not message.get("more_body", False):
                arrived = True
            return message

        # A client waiting for "100 Continue" has sent no body: asking uvicorn for it would
        # invite it to send the body that the answer refuses.
        waits_to_send = headers.get(b"expect", b"").lower() == b"100-continue"

        async def send_closing(message: dict) -> None:
            nonlocal arrived
            if message["type"] == "http.response.start" and not arrived:
                arrived = not waits_to_send and await _rest_has_arrived(receive)
                if not arrived:
                    message = {**message, "headers": [*message.get("headers", ()), _CLOSE]}
            await send(message)

        await self.app(scope, receive_body, send_closing)


_CLOSE = (b"connection", b"close")


async def _rest_has_arrived(receive: Any) -> bool:
    """Whether the end of a body the app answers without reading (a route that takes none, a
    refusal) is among the bytes already received: they are taken (the app is done with the
    body), without waiting for more."""
    while True:
        message = asyncio.ensure_future(receive())
        await asyncio.sleep(0)  # one turn: what is buffered is returned at once
        if not message.done():
            message.cancel()
            return False
        if message.result()["type"] != "http.request" or not message.result().get("more_body"):
            return True


def big_body_route(
    max_list_items: int, reads: BodyReads, budget_bytes: int = BODY_BUDGET_BYTES
) -> type[APIRoute]:
    """The route class of the API (set as `app.router.route_class` before routes are
    added): bodies of `BIG_BODY_BYTES` or more (or chunked) are read within a `BodyBudget` of
    `budget_bytes`, parsed and validated in a worker thread one at a time, and any list in
    them longer than `max_list_items` is refused. `reads` ends the waits for the budget."""
    budget = BodyBudget(budget_bytes)
    parsing = asyncio.Semaphore(1)

    class BigBodyRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()
            field = self.body_field
            model = field.field_info.annotation if field is not None else None
            if not (isinstance(model, type) and issubclass(model, BaseModel)):
                return handler

            async def budgeted(request: Request) -> Response:
                if not _is_big(request):
                    return await handler(request)
                async with budget.hold() as hold:
                    try:
                        body = await _read_body(request, hold, reads)
                    except ClientDisconnect:  # gone, or dropped at its idle or read deadline
                        return Response(status_code=499)
                    if body:
                        async with parsing:
                            # FastAPI takes the cached model from `json()` and accepts it as is.
                            parsed = await asyncio.to_thread(_parse, body, model, max_list_items)
                        request._json = parsed
                        if _json_typed(request):  # FastAPI reads `_json`: the bytes can go
                            request._body = _PARSED
                    del body
                return await handler(request)

            return budgeted

    return BigBodyRoute


async def _read_body(request: Request, hold: BodyHold, reads: BodyReads) -> bytearray:
    """The whole body, each chunk's bytes taken from `hold`'s budget as it arrives (waiting,
    unread, while they do not fit); kept as the request's body for FastAPI."""
    body = bytearray()
    async for chunk in request.stream():
        if chunk and not hold.try_take(len(chunk)):
            await reads.wait(hold.take(len(chunk)))
        body += chunk
    hold.done_reading()
    request._body = body
    return body


def _parse(body: bytes, model: type[BaseModel], max_items: int) -> Any:
    """JSON bytes -> a validated `model`, or `BodyRefused` with the error the small-body
    path would give (`http_errors.py` maps pydantic's errors the same way)."""
    from lockstep.server.http_errors import validation_error

    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        # Not JSON, or JSON Python cannot read (too deep, an integer of 4300+ digits).
        loc = getattr(exc, "pos", 0)
        error = {"type": "json_invalid", "loc": ("body", loc), "ctx": {"error": str(exc)}}
        raise BodyRefused(validation_error(RequestValidationError([error]))) from None
    del body
    _check_list_lengths(data, max_items)
    try:
        return model.model_validate(data)
    except APIError as exc:
        raise BodyRefused(exc) from None
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        raise BodyRefused(validation_error(RequestValidationError(errors))) from None


def _check_list_lengths(data: Any, max_items: int) -> None:
    """Refuses a list longer than `max_items` anywhere in `data`, naming its path."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, list):
            if len(value) > max_items:
                param = path or "body"
                raise BodyRefused(
                    APIError(
                        f"{param!r} has {len(value)} items: no request with a list of more"
                        f" than {max_items} fits this server (its maximum context length,"
                        " or the sequences one request may hold).",
                        param=param,
                        code="context_length_exceeded",
                    )
                )
            items = enumerate(value)
        elif isinstance(value, dict):
            items = value.items()
        else:
            continue
        for key, item in items:
            if isinstance(item, (list, dict)):
                stack.append((f"{path}.{key}" if path else str(key), item))


# What FastAPI sees as the body of a big one once parsed: it only asks whether there is one
# (the model is `request._json`), so the bytes need not live as long as the request.
_PARSED = b"{}"


def _json_typed(request: Request) -> bool:
    """Whether FastAPI will take the request's body from `json()`: its content type is JSON
    (`application/json` or `application/*+json`), as FastAPI decides."""
    value = request.headers.get("content-type")
    if not value:
        return False
    message = email.message.Message()
    message["content-type"] = value
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def _is_big(request: Request) -> bool:
    """Declared at `BIG_BODY_BYTES` or more, or of unknown length (chunked)."""
    if request.method in ("GET", "HEAD"):
        return False
    declared = request.headers.get("content-length")
    if declared is None:
        return "chunked" in request.headers.get("transfer-encoding", "")
    return not declared.isdigit() or int(declared) >= BIG_BODY_BYTES


_LIBC: Any = None


def release_free_memory() -> None:
    """Give the allocator's free pages back to the OS (glibc's `malloc_trim`; nothing where
    there is no glibc): a refused 16 MB body otherwise leaves its pages in the process's
    heaps, and the RSS of a server that refused a few big bodies would stay up."""
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else False
        except OSError:
            _LIBC = False
    if _LIBC and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)
