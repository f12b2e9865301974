"""How request bodies are read: bounded in size, and the big ones one at a time, parsed and
validated off the event loop.

- `BodySizeLimit` refuses a body over the byte limit (413) before it is read into memory,
  whether its length is declared or it arrives chunked.
- `big_body_route` makes the API's routes read a body of `BIG_BODY_BYTES` or more under a
  one-slot gate: its bytes are read, parsed as JSON and validated against the route's model in
  a worker thread. So `/health` and small requests keep the event loop while a 16 MB body is
  parsed (16 MB of token ids take seconds to validate), and twenty such bodies at once cost
  one body's memory, not twenty: the others wait unread, their connections paused by flow
  control. A body that arrives slowly holds the gate until the connection's read deadline
  (`connections.py`) at most. Once its request is answered, the allocator's free pages go
  back to the OS.
- In a big body, a list longer than `max_model_len` is refused before validation: no prompt of
  more tokens fits, and validating millions of ids is the expensive part.
- `UnfinishedBodies` handles a body that has not all arrived when its answer goes: the answer
  says `Connection: close` (the connection cannot carry another request before the rest is
  read, and reading it is what a refusal avoids; `connections.py` closes it), and at the end
  of a shutdown's grace period a body still awaited is answered with a 503.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import json
from collections.abc import Callable, Coroutine
from typing import Any

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
    """The end of a shutdown's grace period for request bodies: after `shed(reason)`, every
    body read waiting for bytes, and every one begun later, fails with a 503 (`code:
    unavailable`, `reason` its message), as `AsyncEngine.shed` fails the requests it runs.
    Otherwise a client still sending (or one that never finishes) would hold its handler
    until uvicorn's own deadline, which cancels it: a plain-text 500 and a traceback."""

    def __init__(self) -> None:
        self._reason: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shed: asyncio.Event | None = None

    def shed(self, reason: str) -> None:
        """Callable from any thread (the shutdown's grace timer runs on its own)."""
        self._reason = reason
        if self._loop is not None and self._shed is not None:
            self._loop.call_soon_threadsafe(self._shed.set)

    async def receive(self, receive: Any) -> dict:
        """`receive()`, or `BodyRefused` (503) once shed."""
        if self._shed is None:
            self._loop, self._shed = asyncio.get_running_loop(), asyncio.Event()
        if self._reason is None:
            message = asyncio.ensure_future(receive())
            shed = asyncio.ensure_future(self._shed.wait())
            received = False
            try:
                await asyncio.wait((message, shed), return_when=asyncio.FIRST_COMPLETED)
                received = message.done()
            finally:  # this task cancelled too (uvicorn's deadline): neither is left pending
                shed.cancel()
                if not received:
                    message.cancel()
            if received:
                return message.result()
        raise BodyRefused(
            APIError(str(self._reason), status=503, type="server_error", code="unavailable")
        )


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


def big_body_route(max_list_items: int) -> type[APIRoute]:
    """The route class of the API (set as `app.router.route_class` before routes are
    added): bodies of `BIG_BODY_BYTES` or more go through one gate, are parsed and validated
    in a worker thread, and any list in them longer than `max_list_items` is refused."""
    gate = asyncio.Semaphore(1)

    class BigBodyRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()
            field = self.body_field
            model = field.field_info.annotation if field is not None else None
            if not (isinstance(model, type) and issubclass(model, BaseModel)):
                return handler

            async def gated(request: Request) -> Response:
                if not _is_big(request):
                    return await handler(request)
                async with gate:
                    try:
                        body = await request.body()
                    except ClientDisconnect:  # gone, or dropped at its read deadline
                        return Response(status_code=499)
                    if body:
                        # FastAPI takes the cached model from `json()` and accepts it as is.
                        request._json = await asyncio.to_thread(_parse, body, model, max_list_items)
                    del body
                return await handler(request)

            return gated

    return BigBodyRoute


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
