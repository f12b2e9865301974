"""Admission control: at most max_running + max_waiting sequences are in flight; a request
beyond that is refused at once with a 429 and Retry-After, every accepted request completes,
/health answers while the server is full, and the capacity comes back when requests end.

The first test holds the server full deterministically: an engine whose steps produce nothing
until the test opens a gate (test_server.py's trivial engine, which always emits "a"). The
second drives a real `lockstep serve` with a burst and checks what must hold whatever the
machine's speed: every answer is a 200 or a 429, every 200 carries the bits the same request
gets alone, and the KV pool is free afterwards.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from test_server import ServerProcess, _FaultyEngine, health_probe, p99

TIMEOUT_S = 120  # a hang guard only
MAX_RUNNING, MAX_WAITING = 2, 3


class _GatedEngine(_FaultyEngine):
    """Steps produce nothing until `gate` is set, so admitted requests stay in flight."""

    def __init__(self) -> None:
        super().__init__()
        from lockstep.config import EngineConfig

        self.config = EngineConfig(device="cpu", max_model_len=64, max_running=MAX_RUNNING)
        self.gate = threading.Event()

    def step(self) -> list:
        if not self.gate.is_set():
            time.sleep(0.005)
            return []
        return super().step()


@pytest.fixture
def gated() -> Iterator[tuple[str, _GatedEngine]]:
    import uvicorn

    from lockstep.server.api import build_app
    from lockstep.server.connections import guarded_protocol

    engine = _GatedEngine()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = build_app(engine, max_waiting=MAX_WAITING)
    # `lockstep serve`'s protocol, where error statuses are counted (connections.py).
    protocol = guarded_protocol(60.0, 20.0, 2048, app.state.metrics.count_error)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=protocol))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", engine
    engine.gate.set()
    server.should_exit = True
    thread.join(10)


def _wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, "hang guard: the condition never held"
        time.sleep(0.01)


def test_requests_beyond_capacity_get_429_and_the_admitted_complete(
    gated: tuple[str, _GatedEngine],
) -> None:
    base, engine = gated
    capacity = MAX_RUNNING + MAX_WAITING
    body = {"model": "faulty", "prompt": "hi", "max_tokens": 4}
    post = lambda b: httpx.post(base + "/v1/completions", json=b, timeout=TIMEOUT_S)  # noqa: E731
    with ThreadPoolExecutor(capacity) as pool:
        held = [pool.submit(post, body) for _ in range(capacity)]
        _wait_until(lambda: len(engine.requests) == capacity)
        refused = [post(body) for _ in range(3)]
        refused.append(post({**body, "stream": True}))
        health = httpx.get(base + "/health", timeout=TIMEOUT_S)
        assert len(engine.requests) == capacity  # nothing refused reached the engine
        engine.gate.set()
        admitted = [f.result() for f in held]
    for response in refused:
        assert response.status_code == 429, response.text
        assert response.headers["Retry-After"] == "1"
        error = response.json()["error"]
        assert error["code"] == "server_overloaded" and error["type"] == "rate_limit_error"
    assert health.status_code == 200
    for response in admitted:
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == "aaaa"
    # The capacity came back: a full request's worth is admitted again, and one that could
    # never be admitted is a 400, not a 429 to retry forever.
    again = post({**body, "n": capacity})
    assert again.status_code == 200, again.text
    assert [c["text"] for c in again.json()["choices"]] == ["aaaa"] * capacity
    too_many = post({**body, "n": capacity + 1})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    metrics = httpx.get(base + "/metrics", timeout=TIMEOUT_S).text
    assert 'lockstep_http_errors_total{status="429"} 4.0' in metrics


def test_a_burst_against_a_real_server_loses_nothing() -> None:
    args = [
        "--device", "cpu", "--kv-tokens", "2048", "--max-batch-tokens", "64",
        "--chunk-size", "64", "--max-running", "2", "--max-waiting", "2",
        "--max-model-len", "256", "--debug-checks",
    ]  # fmt: skip
    server = ServerProcess(args).start()
    try:
        url = server.base_url + "/v1/completions"
        bodies = [
            {"model": server.model, "prompt": f"Count from {i}:", "max_tokens": 6,
             "temperature": 0, "logprobs": 0}
            for i in range(24)
        ]  # fmt: skip
        with ThreadPoolExecutor(len(bodies)) as pool:
            burst = list(pool.map(lambda b: httpx.post(url, json=b, timeout=TIMEOUT_S), bodies))
        assert {r.status_code for r in burst} <= {200, 429}, [r.text for r in burst]
        for body, response in zip(bodies, burst, strict=True):
            if response.status_code == 429:
                assert response.headers["Retry-After"] == "1"
                continue
            alone = httpx.post(url, json=body, timeout=TIMEOUT_S)
            got, want = response.json()["choices"][0], alone.json()["choices"][0]
            assert got["text"] == want["text"]
            assert got["logprobs"]["token_logprobs"] == want["logprobs"]["token_logprobs"]
        server.wait_idle()
    finally:
        server.stop()


BURST = 300


def _burst_bodies(model: str) -> list[tuple[str, dict]]:
    """(path, body): plain and streamed completions, chats, all greedy with logprobs."""
    bodies: list[tuple[str, dict]] = []
    for i in range(BURST):
        common = {"model": model, "max_tokens": 4, "temperature": 0}
        if i % 3 == 0:
            body = {**common, "messages": [{"role": "user", "content": f"Say {i}."}],
                    "logprobs": True}  # fmt: skip
            bodies.append(("/v1/chat/completions", body))
        else:
            body = {**common, "prompt": f"Number {i} is", "logprobs": 0, "stream": i % 3 == 2}
            bodies.append(("/v1/completions", body))
    return bodies


def _bits(path: str, body: dict, response: httpx.Response) -> tuple[str, list[float]]:
    """(text, token logprobs) of a 200, streamed or not."""
    if body.get("stream"):
        lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]", lines[-2:]
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert all("error" not in c for c in chunks), chunks
        choices = [c["choices"][0] for c in chunks if c["choices"]]
        text = "".join(c["text"] for c in choices)
        return text, [x for c in choices if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
    choice = response.json()["choices"][0]
    if path == "/v1/chat/completions":
        return choice["message"]["content"], [t["logprob"] for t in choice["logprobs"]["content"]]
    return choice["text"], choice["logprobs"]["token_logprobs"]


@pytest.mark.slow
def test_300_simultaneous_requests_against_a_small_pool(tmp_path: Path) -> None:
    """300 requests at once (chat, completions, streams) against a small pool: no 5xx, the
    excess gets 429 with Retry-After, every accepted request carries the bits it gets alone,
    /health answers throughout (p99 under 5 s: a bound that a /health queued behind the burst,
    tens of seconds, breaks and a busy CI machine does not), and no KV slot is left in use."""
    args = [
        "--device", "cpu", "--kv-tokens", "1024", "--max-batch-tokens", "128",
        "--chunk-size", "64", "--max-running", "4", "--max-waiting", "4",
        "--max-model-len", "256",
    ]  # fmt: skip
    server = ServerProcess(args).start()
    try:
        base = server.base_url
        bodies = _burst_bodies(server.model)
        post = lambda item: httpx.post(base + item[0], json=item[1], timeout=TIMEOUT_S)  # noqa: E731
        with health_probe(base, tmp_path) as probes, ThreadPoolExecutor(BURST) as pool:
            burst = list(pool.map(post, bodies))
        statuses = Counter(r.status_code for r in burst)
        assert set(statuses) == {200, 429}, statuses  # refusals happen, and nothing else
        for response in burst:
            if response.status_code == 429:
                assert response.headers["Retry-After"] == "1"
                assert response.json()["error"]["code"] == "server_overloaded"
        differing = 0
        for (path, body), response in zip(bodies, burst, strict=True):
            if response.status_code == 200:
                alone = httpx.post(base + path, json=body, timeout=TIMEOUT_S)
                differing += _bits(path, body, response) != _bits(path, body, alone)
        latency = p99([seconds for seconds, _ in probes])
        print(f"statuses {dict(statuses)}, differing {differing}, /health p99 {latency:.3f} s"
              f" max {max(s for s, _ in probes):.3f} s over {len(probes)} probes")  # fmt: skip
        assert differing == 0
        assert all(status == 200 for _, status in probes) and len(probes) >= 10, probes
        assert latency < 5.0, [round(seconds, 2) for seconds, _ in probes]  # in order
        stats = server.wait_idle()
        assert stats["kv_free"] + stats["kv_cached"] == stats["kv_total"]
    finally:
        server.stop()
