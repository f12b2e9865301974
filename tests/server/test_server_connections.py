"""Connection hygiene of a real `lockstep serve` (a tiny random model: only HTTP is tested):
a request whose head or body arrives too slowly (slowloris) has its connection closed within
`--request-read-timeout`, an idle connection within `--keep-alive-timeout`, a header block
of more than 16 KiB or 100 fields is a 431, a request framed two ways or in an unknown HTTP
version is refused and its connection closed, and beyond `--max-connections` a request gets a
429 with Retry-After. Controls: the same requests sent in time are served, and the server is
healthy after each case. Every error status sent, those answered below the routes included,
is counted in /metrics.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from test_server import ServerProcess

READ_TIMEOUT_S = 1.5
KEEP_ALIVE_S = 1.0
MAX_CONNECTIONS = 6
ARGS = [
    "--model", "random:tiny", "--device", "cpu", "--kv-tokens", "512", "--max-model-len", "64",
    "--request-read-timeout", str(READ_TIMEOUT_S), "--keep-alive-timeout", str(KEEP_ALIVE_S),
    "--max-connections", str(MAX_CONNECTIONS),
]  # fmt: skip
SLACK_S = 1.0  # timer and scheduling slack on a loaded 2-core machine


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(ARGS).start()
    yield proc
    proc.stop()


def _connect(server: ServerProcess) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    return sock


def _seconds_until_closed(sock: socket.socket, drip: bytes = b"", every_s: float = 0.1) -> float:
    """Sends `drip` a byte at a time every `every_s` (nothing if empty) until the server
    closes the connection; returns the seconds that took (a hang guard at 30 s)."""
    started = time.monotonic()
    sock.settimeout(every_s)
    sent = 0
    while time.monotonic() - started < 30:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - started
        except TimeoutError:
            pass
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - started
        if drip:
            try:
                sock.send(drip[sent % len(drip) : sent % len(drip) + 1])
            except (ConnectionResetError, BrokenPipeError):
                return time.monotonic() - started
            sent += 1
    raise AssertionError("the server kept the connection open for 30 s")


def _healthy(server: ServerProcess) -> None:
    assert httpx.get(server.base_url + "/health", timeout=30).json() == {"status": "ok"}


def test_slow_request_heads_and_bodies_are_dropped_in_time(server: ServerProcess) -> None:
    body = json.dumps({"model": server.model, "prompt": "hi", "max_tokens": 1}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    # Slowloris: a header byte every 0.1 s, for ever.
    with _connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        took = _seconds_until_closed(sock, drip=b"X-Slow: aaaaaaaaaaaaaaaa\r\n")
    assert READ_TIMEOUT_S - 0.2 <= took < READ_TIMEOUT_S + SLACK_S, took
    # A whole head, then a body that stops half way.
    with _connect(server) as sock:
        sock.sendall(head + body[:5])
        took = _seconds_until_closed(sock)
    assert took < READ_TIMEOUT_S + SLACK_S, took
    # The same with a big body (read under the one-slot gate of request_bodies.py).
    big_head = head.replace(f"Content-Length: {len(body)}".encode(), b"Content-Length: 100000")
    with _connect(server) as sock:
        sock.sendall(big_head + b" " * 1000)
        took = _seconds_until_closed(sock)
    assert took < READ_TIMEOUT_S + SLACK_S, took
    # A connection that never sends a byte is idle: closed after the keep-alive timeout.
    with _connect(server) as sock:
        took = _seconds_until_closed(sock)
    assert KEEP_ALIVE_S - 0.2 <= took < KEEP_ALIVE_S + SLACK_S, took
    # Control: the same request dripped in pieces that arrive within the deadline is served,
    # and the kept-alive connection serves a second request, its deadline counted afresh.
    with _connect(server) as sock:
        for start in range(0, len(head), 40):
            sock.sendall(head[start : start + 40])
            time.sleep(0.05)
        sock.sendall(body)
        first = _read_response(sock)
        time.sleep(READ_TIMEOUT_S * 0.6)
        sock.sendall(head)
        time.sleep(READ_TIMEOUT_S * 0.6)
        sock.sendall(body)
        second = _read_response(sock)
    assert first.startswith(b"HTTP/1.1 200") and second.startswith(b"HTTP/1.1 200"), second
    _healthy(server)
    assert "Traceback" not in "".join(server.log), "".join(server.log)[-3000:]


def _read_response(sock: socket.socket) -> bytes:
    """One response with a content-length body."""
    sock.settimeout(60)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(rest) < length:
        rest += sock.recv(65536)
    return head


def _exchange(server: ServerProcess, raw: bytes) -> tuple[bytes, bool]:
    """Sends `raw` at once; returns what came back until the server closed the connection
    (a kept-alive one after KEEP_ALIVE_S) and whether it did within 10 s."""
    with _connect(server) as sock:
        sock.sendall(raw)
        sock.settimeout(10)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except TimeoutError:
            return data, False
        except ConnectionResetError:
            pass  # closed with unread bytes of ours in its buffer: a reset, still a close
        return data, True


def _error_of(response: bytes) -> dict:
    head, _, body = response.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), response[:500]
    return json.loads(body)["error"]


def test_ambiguous_framing_and_unknown_versions_are_refused_and_the_connection_closed(
    server: ServerProcess,
) -> None:
    """RFC 9112 6.1: a request with both Content-Length and Transfer-Encoding may be request
    smuggling; it is a 400 and the connection is closed, so a request pipelined behind it
    (here a GET /health) is never read. HTTP/9.9 is a 505. The same requests framed one way
    and spoken in HTTP/1.1 or 1.0 are served (the control)."""
    smuggled = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    framings = [
        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
        b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
    ]
    for framing in framings:
        head = b"POST /flush_cache HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n"
        response, closed = _exchange(server, head + b"0\r\n\r\n" + smuggled)
        assert response.startswith(b"HTTP/1.1 400"), response[:500]
        assert response.count(b"HTTP/1.1 ") == 1 and closed, response
        error = _error_of(response)
        assert "Content-Length" in error["message"] and error["code"] == "invalid_http"
    response, closed = _exchange(server, b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n")
    assert response.startswith(b"HTTP/1.1 505") and closed, response[:500]
    assert "HTTP/9.9" in _error_of(response)["message"]
    # Controls: one framing each, then the pipelined request, on one kept-alive connection
    # (closed after KEEP_ALIVE_S: that a refused one was closed shows in its lost GET).
    chunked = (
        b"POST /flush_cache HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    )
    length = b"POST /flush_cache HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
    response, closed = _exchange(server, chunked + length + smuggled)
    assert response.count(b"HTTP/1.1 200 OK") == 3, response
    response, closed = _exchange(server, b"GET /health HTTP/1.0\r\n\r\n")
    assert response.startswith(b"HTTP/1.1 200") and closed, response[:500]  # 1.0: then closed
    _healthy(server)


def test_header_blocks_are_bounded_in_size_and_count(server: ServerProcess) -> None:
    """A head over 16 KiB or of more than 100 header fields is a 431 and the connection is
    closed, whether it arrives whole in one read or is still unfinished (h11's own bound)."""
    start = b"GET /health HTTP/1.1\r\nHost: x\r\n"
    big = b"X-Big: " + b"a" * (20 << 10) + b"\r\n"
    many = b"".join(b"X-%d: a\r\n" % i for i in range(150))  # 1.3 KiB
    for head in [start + big + b"\r\n", start + many + b"\r\n", start + big]:
        response, closed = _exchange(server, head)
        assert response.startswith(b"HTTP/1.1 431") and closed, response[:500]
        assert _error_of(response)["code"] == "invalid_http"
    # Control: 99 fields (Host and 98 more) of 8 KiB in all are served.
    fine = start + b"".join(b"X-%d: %s\r\n" % (i, b"a" * 70) for i in range(98)) + b"\r\n"
    response, _ = _exchange(server, fine)
    assert response.startswith(b"HTTP/1.1 200"), response[:500]
    _healthy(server)


def test_beyond_max_connections_a_request_gets_429(server: ServerProcess) -> None:
    held = [_connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in held:  # keep each one busy sending a head (held up to the read deadline)
            sock.sendall(b"GET /health HTTP/1.1\r\n")
        time.sleep(0.2)
        refused = httpx.get(server.base_url + "/health", timeout=30)
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["connection"] == "close"
        error = refused.json()["error"]
        assert error["code"] == "server_overloaded" and "--max-connections" in error["message"]
    finally:
        for sock in held:
            sock.close()
    # The held connections gone, requests are served again, and the refusal was counted.
    deadline = time.monotonic() + 30
    while httpx.get(server.base_url + "/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "connections never freed"
        time.sleep(0.05)
    metrics = httpx.get(server.base_url + "/metrics", timeout=30).text
    assert 'lockstep_http_errors_total{status="429"}' in metrics


def _error_counts(server: ServerProcess) -> Counter[str]:
    """`lockstep_http_errors_total` by status, from /metrics."""
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    found = re.findall(r'^lockstep_http_errors_total\{status="(\d+)"\} ([\d.]+)$', text, re.M)
    return Counter({status: int(float(value)) for status, value in found})


def test_every_error_status_sent_is_counted(server: ServerProcess) -> None:
    """lockstep_http_errors_total counts each 4xx and 5xx the server sends, whoever answers
    it: the routes (a 400 for a bad body, a 404, a 405), a middleware below them (a 413 for a
    declared body over 32 MiB, answered before it is read) and the connection itself (a head
    h11 cannot parse, framed two ways, too big, or in HTTP/9.9). Each answer is checked as
    sent, and the counts grow by exactly these."""
    before = _error_counts(server)
    completions = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sent = [
        (b"GARBAGE\r\n\r\n", "400"),
        (b"POST /flush_cache HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
         b"Transfer-Encoding: chunked\r\n\r\n", "400"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (20 << 10) + b"\r\n\r\n", "431"),
        (b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n", "505"),
        (completions + b"Content-Length: 40000000\r\n\r\n", "413"),
        (completions + b"Content-Length: 5\r\n\r\n{nope", "400"),
        (b"GET /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", "404"),
        (b"DELETE /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", "405"),
    ]  # fmt: skip
    for raw, status in sent:
        response, _ = _exchange(server, raw)
        assert response.startswith(b"HTTP/1.1 " + status.encode()), (raw[:60], response[:300])
    counted = _error_counts(server)
    counted.subtract(before)
    assert +counted == Counter(status for _, status in sent), (counted, before)
