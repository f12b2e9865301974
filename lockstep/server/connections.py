"""Connection hygiene: how long a client may take to send a request, and how many
connections the server holds open. uvicorn's h11 protocol, with these additions:

- **Read deadline.** A request's headers and body must arrive whole within `read_timeout_s`
  of its first byte, or the connection is closed (the route, if it was reading the body,
  sees the client gone). A connection that sends nothing at all is closed after uvicorn's
  keep-alive timeout, as it is between requests. So a slowloris client sending a byte a
  second holds a connection for `read_timeout_s` at most. While the server itself is not
  reading (flow control pauses a body that waits for room in the body budget,
  `request_bodies.py`), the deadline waits.
- **Idle timeout.** A request that has begun to arrive, head or body, may go `idle_timeout_s`
  without a byte (nginx's `client_body_timeout`: the time between two reads, per
  connection), or the connection is closed. So a client that stops half way through a body
  holds its connection, and the bytes it sent, that long and no longer. As above, the time
  the server is not reading (paused, or not yet asked for a body the client holds back until
  `100 Continue`) does not count.
- **Connection limit.** Beyond `max_connections` open connections, a new connection's request
  is answered at once with a 429 (`server_overloaded`, `Retry-After`), without reading its
  body, and the connection is closed: the server's file descriptors and buffers stay bounded.

- **Strict request heads.** A head of more than `MAX_HEAD_BYTES` or `MAX_HEADER_FIELDS`
  fields is a 431, whether it arrives whole in one read or is still unfinished (h11 bounds
  only the latter). A request with both `Content-Length` and `Transfer-Encoding` is a 400
  (RFC 9112 6.1: the two framings may be read differently by a proxy in front, which is how
  requests are smuggled), an HTTP version other than 1.0 and 1.1 a 505. Each of these, and
  every request h11 cannot parse, is answered with OpenAI's error body (`code: invalid_http`)
  and the connection is closed: nothing after the refused head is read.

- **Error statuses counted.** Every response with a status of 400 or more is counted
  (`on_error(status)`, `lockstep_http_errors_total`) as its status line is written, whoever
  answered it: a route, a middleware (401, 413, 429), uvicorn (its 500), or this protocol
  (a malformed head, the connection limit's 429).

- **Lingering close.** A connection closed while its client is still sending a body (a 413
  or another refusal answered before the body was read, which says `Connection: close`) is
  first half-closed: the answer and a FIN go out, what the client still sends is read and
  dropped for up to `LINGER_S`, then the socket closes. Closed at once, the unread bytes
  would make the kernel reset the connection, and a client still sending could lose the
  answer to that reset.

Body size is `request_bodies.BodySizeLimit`'s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# File descriptors the process needs besides its connections (model files, pipes, ...).
_SPARE_FDS = 128
# Bounds of a request head: h11's bound on an unfinished head, and Apache's default field
# count (LimitRequestFields). Lockstep's own requests need a handful of fields.
MAX_HEAD_BYTES = 16 * 1024
MAX_HEADER_FIELDS = 100
# Seconds a refused client still sending its body gets to stop and read the answer.
LINGER_S = 5.0


def guarded_protocol(
    read_timeout_s: float,
    idle_timeout_s: float,
    max_connections: int,
    on_error: Callable[[int], None],
) -> type:
    """An `asyncio.Protocol` class for `uvicorn.Config(http=...)`. `on_error(status)` runs
    for each response of status 400 or more written (`ServerMetrics.count_error`)."""
    import h11
    from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

    refusal = _refusal_app(max_connections)
    strict_connection = _strict_connection_class(on_error)

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            self._socket_transport = transport
            self._lingering = False
            super().connection_made(_LingeringTransport(transport, self))
            self.conn = strict_connection(h11.SERVER, MAX_HEAD_BYTES)
            self._read_deadline: asyncio.TimerHandle | None = None
            self._idle_deadline: asyncio.TimerHandle | None = None
            self._last_read = 0.0  # loop time of the last bytes received
            self._reading_after: object = self.cycle  # the cycle before the one being read
            if len(self.connections) > max_connections:
                self.app = refusal
            # Idle until its first byte: closed after the keep-alive timeout, as between
            # requests (uvicorn arms that timer only after a response).
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

        def data_received(self, data: bytes) -> None:
            if self._lingering:
                return  # the rest of a refused body: dropped unparsed
            if self._read_deadline is None and (self.cycle is None or self.cycle.response_complete):
                # The first bytes of a request: its whole head and body are due in time.
                self._reading_after = self.cycle
                self._read_deadline = self.loop.call_later(read_timeout_s, self._read_timeout)
                self._idle_deadline = self.loop.call_later(idle_timeout_s, self._idle_timeout)
            self._last_read = self.loop.time()
            super().data_received(data)
            cycle = self.cycle
            if cycle is not None and cycle is not self._reading_after and not cycle.more_body:
                self._stop_read_deadline()

        def eof_received(self) -> bool | None:
            if self._lingering:
                self._socket_transport.close()  # the client has stopped sending
            return super().eof_received()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_read_deadline()
            super().connection_lost(exc)

        def linger(self) -> bool:
            """Half-closes a connection whose client is still sending its body, and closes
            it `LINGER_S` later (`_LingeringTransport.close`); False where there is nothing
            to linger for (the client is not sending, or the transport cannot half-close)."""
            transport = self._socket_transport
            if (
                self._lingering
                or self.conn.their_state is not h11.SEND_BODY
                or transport.is_closing()
                or not transport.can_write_eof()
            ):
                return False
            self._lingering = True
            self._stop_read_deadline()
            transport.write_eof()
            transport.resume_reading()
            self.loop.call_later(LINGER_S, transport.close)
            return True

        def send_400_response(self, msg: str) -> None:
            """uvicorn calls this for every head h11 (or `_StrictConnection`) refuses: the
            refusal's own status and reason, in OpenAI's error body, then the close."""
            error = getattr(self.conn, "refused", None)
            status = getattr(error, "error_status_hint", 400)
            reason = str(error) if error is not None else msg
            body = _error_body(f"Invalid HTTP request: {reason}", "invalid_request_error")
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ]
            response = h11.Response(
                status_code=status, headers=headers, reason=STATUS_PHRASES.get(status, b"")
            )
            try:
                for event in (response, h11.Data(data=body), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:
                pass  # a response had already begun: nothing more can be said on it
            self.transport.close()

        def _stop_read_deadline(self) -> None:
            """Stops the read deadline and the idle timeout: the request has arrived."""
            if self._read_deadline is not None:
                self._read_deadline.cancel()
                self._read_deadline = None
            if self._idle_deadline is not None:
                self._idle_deadline.cancel()
                self._idle_deadline = None

        def _server_not_reading(self) -> bool:
            """Whether the server, not the client, is why no byte arrives: reading paused
            by flow control, or a client told to wait for `100 Continue` not told yet."""
            cycle = self.cycle
            return (self.flow is not None and self.flow.read_paused) or (
                cycle is not None
                and cycle is not self._reading_after
                and cycle.waiting_for_100_continue
            )

        def _idle_timeout(self) -> None:
            self._idle_deadline = None
            if self.transport.is_closing():
                return
            now = self.loop.time()
            if self._server_not_reading():
                self._last_read = now  # the client's time starts when reading resumes
            idle = now - self._last_read
            if idle < idle_timeout_s:
                self._idle_deadline = self.loop.call_later(
                    idle_timeout_s - idle, self._idle_timeout
                )
                return
            self._close_slow_client(
                f"no byte of its request arrived for {idle_timeout_s:g} s (--request-idle-timeout)"
            )

        def _read_timeout(self) -> None:
            self._read_deadline = None
            if self.transport.is_closing():
                return
            if self._server_not_reading():
                # The server, not the client, is the one not reading: wait on.
                self._read_deadline = self.loop.call_later(read_timeout_s, self._read_timeout)
                return
            self._close_slow_client(
                f"its request did not arrive whole within {read_timeout_s:g} s"
                " (--request-read-timeout)"
            )

        def _close_slow_client(self, why: str) -> None:
            self._stop_read_deadline()
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            logger.info("closed the connection of %s: %s", client, why)
            self._socket_transport.close()  # no answer to wait for: no lingering

    return GuardedH11Protocol


class _LingeringTransport:
    """The connection's transport as uvicorn sees it: `close()` lingers while the client is
    still sending its body (`GuardedH11Protocol.linger`), and the connection then counts as
    closing; everything else is the socket transport's."""

    def __init__(self, transport: Any, protocol: Any) -> None:
        self._transport = transport
        self._protocol = protocol

    def close(self) -> None:
        if not self._protocol.linger():
            self._transport.close()

    def is_closing(self) -> bool:
        return self._protocol._lingering or self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _strict_connection_class(on_error: Callable[[int], None]) -> type:
    """h11's server connection, refusing (as h11 refuses a malformed head: by raising
    `RemoteProtocolError` from `next_event`, which uvicorn answers through
    `send_400_response`) the heads h11 accepts but this server does not; the error is kept in
    `refused` for the answer. Every response, whoever made it, is written through its `send`:
    there each error status is counted (`on_error`)."""
    import h11

    class _StrictConnection(h11.Connection):
        refused: h11.RemoteProtocolError | None = None

        def send(self, event: Any) -> bytes | None:
            data = super().send(event)
            if type(event) is h11.Response and event.status_code >= 400:
                on_error(event.status_code)
            return data

        def next_event(self) -> Any:
            try:
                event = super().next_event()
                if isinstance(event, h11.Request):
                    _check_head(event)
            except h11.RemoteProtocolError as exc:
                self.refused = exc
                raise
            return event

    return _StrictConnection


def _check_head(request: Any) -> None:
    """Raises h11's `RemoteProtocolError`, with the status to answer, for a head this server
    refuses though h11 parsed it."""
    import h11

    if request.http_version not in (b"1.0", b"1.1"):
        version = request.http_version.decode("ascii", "replace")
        raise h11.RemoteProtocolError(
            f"HTTP/{version} is not supported: send HTTP/1.1", error_status_hint=505
        )
    headers = request.headers
    if len(headers) > MAX_HEADER_FIELDS:
        raise h11.RemoteProtocolError(
            f"{len(headers)} header fields, more than the {MAX_HEADER_FIELDS} allowed",
            error_status_hint=431,
        )
    size = sum(len(name) + len(value) + 4 for name, value in headers)  # "name: value\r\n"
    if size > MAX_HEAD_BYTES:
        raise h11.RemoteProtocolError(
            f"{size} bytes of header fields, more than the {MAX_HEAD_BYTES} allowed",
            error_status_hint=431,
        )
    names = {name for name, _ in headers}  # h11 gives them lower-cased
    if b"content-length" in names and b"transfer-encoding" in names:
        raise h11.RemoteProtocolError(
            "both Content-Length and Transfer-Encoding: the body's length is ambiguous"
            " (RFC 9112 6.1)",
            error_status_hint=400,
        )


def _error_body(message: str, error_type: str, code: str = "invalid_http") -> bytes:
    error = {"message": message, "type": error_type, "param": None, "code": code}
    return json.dumps({"error": error}).encode()


def _refusal_app(max_connections: int) -> Any:
    """The ASGI app that answers every request of a connection over the limit."""
    body = _error_body(
        f"The server holds its maximum of {max_connections} connections"
        " (--max-connections): retry later",
        "rate_limit_error",
        "server_overloaded",
    )
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"),
        (b"connection", b"close"),
    ]

    async def refuse(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 429, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return refuse


def raise_fd_limit(max_connections: int) -> None:
    """Raise the soft limit on open files to what `max_connections` needs, within the hard
    limit; warn where the hard limit is lower (connections beyond it fail to be accepted)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = max_connections + _SPARE_FDS
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < needed:
            logger.warning(
                "--max-connections %d needs %d open files; the limit is %d",
                max_connections,
                needed,
                target,
            )
