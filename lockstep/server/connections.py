"""Connection hygiene: how long a client may take to send a request, and how many
connections the server holds open. uvicorn's h11 protocol, with two additions:

- **Read deadline.** A request's headers and body must arrive whole within `read_timeout_s`
  of its first byte, or the connection is closed (the route, if it was reading the body,
  sees the client gone). A connection that sends nothing at all is closed after uvicorn's
  keep-alive timeout, as it is between requests. So a slowloris client sending a byte a
  second holds a connection for `read_timeout_s` at most. While the server itself is not
  reading (flow control pauses a body that waits for the big-body gate), the deadline waits.
- **Connection limit.** Beyond `max_connections` open connections, a new connection's request
  is answered at once with a 429 (`server_overloaded`, `Retry-After`), without reading its
  body, and the connection is closed: the server's file descriptors and buffers stay bounded.

Header size is h11's bound (`DEFAULT_MAX_INCOMPLETE_EVENT_SIZE`: a head still unfinished past
16 KiB is a 400 from uvicorn); body size is `request_bodies.BodySizeLimit`'s.
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


def guarded_protocol(
    read_timeout_s: float, max_connections: int, on_refused: Callable[[], None]
) -> type:
    """An `asyncio.Protocol` class for `uvicorn.Config(http=...)`. `on_refused` runs for each
    request refused for the connection limit (the 429 counter of /metrics)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    refusal = _refusal_app(max_connections, on_refused)

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._read_deadline: asyncio.TimerHandle | None = None
            self._reading_after: object = self.cycle  # the cycle before the one being read
            if len(self.connections) > max_connections:
                self.app = refusal
            # Idle until its first byte: closed after the keep-alive timeout, as between
            # requests (uvicorn arms that timer only after a response).
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

        def data_received(self, data: bytes) -> None:
            if self._read_deadline is None and (self.cycle is None or self.cycle.response_complete):
                # The first bytes of a request: its whole head and body are due in time.
                self._reading_after = self.cycle
                self._read_deadline = self.loop.call_later(read_timeout_s, self._read_timeout)
            super().data_received(data)
            cycle = self.cycle
            if cycle is not None and cycle is not self._reading_after and not cycle.more_body:
                self._stop_read_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_read_deadline()
            super().connection_lost(exc)

        def _stop_read_deadline(self) -> None:
            if self._read_deadline is not None:
                self._read_deadline.cancel()
                self._read_deadline = None

        def _read_timeout(self) -> None:
            self._read_deadline = None
            if self.transport.is_closing():
                return
            if self.flow is not None and self.flow.read_paused:
                # The server, not the client, is the one not reading: wait on.
                self._read_deadline = self.loop.call_later(read_timeout_s, self._read_timeout)
                return
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            logger.info(
                "closed the connection of %s: its request did not arrive whole within %g s"
                " (--request-read-timeout)",
                client,
                read_timeout_s,
            )
            self.transport.close()

    return GuardedH11Protocol


def _refusal_app(max_connections: int, on_refused: Callable[[], None]) -> Any:
    """The ASGI app that answers every request of a connection over the limit."""
    body = json.dumps(
        {
            "error": {
                "message": f"The server holds its maximum of {max_connections} connections"
                " (--max-connections): retry later",
                "type": "rate_limit_error",
                "param": None,
                "code": "server_overloaded",
            }
        }
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"),
        (b"connection", b"close"),
    ]

    async def refuse(scope: dict, receive: Any, send: Any) -> None:
        on_refused()
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
