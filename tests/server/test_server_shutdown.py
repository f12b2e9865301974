"""A shutdown that outlasts its grace period: `lockstep serve --shutdown-timeout 1` gets
SIGTERM while ten requests run (five plain, five streaming) that need far longer. Each plain
one is answered with a JSON 503 (`code: unavailable`), each stream ends with an error event
and `[DONE]`, the process exits with status 0 and logs no traceback. (test_server.py checks the
other side: a request that fits the grace period completes.) Requests whose bodies are still
arriving when the grace period ends get the same 503 and do not delay the exit."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
from test_server import ServerProcess

MODEL = "random:smollm2-135m"  # slow enough on a CPU that 400 tokens outlast the grace period
ARGS = ["--model", MODEL, "--device", "cpu", "--kv-tokens", "4096", "--max-model-len", "1024",
        "--shutdown-timeout", "1"]  # fmt: skip


def test_requests_past_the_grace_period_get_an_answer_and_the_exit_is_clean() -> None:
    server = ServerProcess(ARGS).start()
    body = {"model": server.model, "prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True}
    plain: list[httpx.Response] = []
    streams: list[tuple[int, list[str]]] = []

    def send_plain() -> None:
        plain.append(httpx.post(server.base_url + "/v1/completions", json=body, timeout=120))

    def send_stream() -> None:
        with httpx.stream("POST", server.base_url + "/v1/completions",
                          json={**body, "stream": True}, timeout=120) as resp:  # fmt: skip
            streams.append((resp.status_code, [line for line in resp.iter_lines() if line]))

    threads = [threading.Thread(target=f) for f in [send_plain, send_stream] * 5]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while server.engine_stats()["num_running"] < len(threads):
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.05)
    assert server.proc is not None
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(120)
    code = server.proc.wait(60)
    log = "".join(server.log)
    assert len(plain) == 5 and len(streams) == 5
    for resp in plain:
        assert resp.status_code == 503, resp.text
        error = resp.json()["error"]
        assert error["code"] == "unavailable" and "shutting down" in error["message"]
    for status, lines in streams:
        assert status == 200 and lines[-1] == "data: [DONE]", lines[-2:]
        event = json.loads(lines[-2][len("data: ") :])
        assert event["error"]["code"] == "unavailable", event
        assert any('"choices"' in line for line in lines[:-2])  # it did stream tokens first
    assert code == 0, log[-2000:]
    assert "Traceback" not in log and "timeout graceful shutdown exceeded" not in log, log[-3000:]


def test_bodies_still_arriving_at_shutdown_get_a_503_and_the_exit_keeps_its_deadline() -> None:
    """Requests whose bodies are still on their way when the grace period ends (a small
    body and a big one, read under request_bodies.py's gate) are answered with the JSON 503
    of the shed requests, not cancelled by uvicorn's deadline (a plain-text 500 and a
    CancelledError traceback), and the process exits before that deadline."""
    from lockstep.server.cli import SHED_MARGIN_S

    grace = 1.0
    server = ServerProcess(
        ["--model", "random:tiny", "--device", "cpu", "--kv-tokens", "512",
         "--max-model-len", "64", "--shutdown-timeout", str(grace)]
    ).start()  # fmt: skip
    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    socks = []
    for declared in (1000, 100_000):
        sock = socket.create_connection((host, int(port)), timeout=60)
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: %d\r\n\r\n{"prompt": ' % declared
        )
        socks.append(sock)
    time.sleep(0.5)  # both heads read, both bodies awaited
    assert server.proc is not None
    server.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    for sock in socks:
        with sock:
            response = b""
            while chunk := sock.recv(65536):
                response += chunk
        head, _, body = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), response[:500]
        error = json.loads(body)["error"]
        assert error["code"] == "unavailable" and "shutting down" in error["message"], error
    code = server.proc.wait(60)
    took = time.monotonic() - signalled
    log = "".join(server.log)
    assert code == 0, log[-2000:]
    assert took < grace + SHED_MARGIN_S, f"exited {took:.1f} s after SIGTERM"
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
