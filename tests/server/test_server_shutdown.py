"""A shutdown that outlasts its grace period: `lockstep serve --shutdown-timeout 1` gets
SIGTERM while ten requests run (five plain, five streaming) that need far longer. Each plain
one is answered with a JSON 503 (`code: unavailable`), each stream ends with an error event
and `[DONE]`, the process exits with status 0 and logs no traceback. (test_server.py checks the
other side: a request that fits the grace period completes.)"""

from __future__ import annotations

import json
import signal
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
