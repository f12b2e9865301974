"""Big bodies against a real `lockstep serve`: twenty bodies of 16 MB sent at once (long text
prompts, long chats, long lists of token ids) are all refused quickly, the server's RSS grows
by less than 500 MB while they arrive and returns near its baseline afterwards, and `/health`
answers throughout (probed from another process; a 16 MB list of token ids holds the GIL
while `json.loads` builds it, so the bound there is seconds, not milliseconds). Big bodies
are read within a byte budget and parsed off the event loop one at a time
(`lockstep/server/request_bodies.py`); a list longer than any request can hold is refused
before it is validated. A big body that stalls holds up no other, and its connection is
closed at its idle timeout.

RSS is read from /proc (Linux, where the suite runs) every 20 ms from a thread of this
process while the bodies are sent.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from test_server import SERVE_ARGS, ServerProcess, health_probe, p99

MB = 1 << 20
BODY_BYTES = 16 * MB
RSS_GROWTH_LIMIT = 500 * MB
RSS_SETTLED_LIMIT = 100 * MB  # "near its baseline"
TIMEOUT_S = 120  # a hang guard only


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def _bodies(model: str) -> list[tuple[str, bytes, str]]:
    """(path, a body of about 16 MB, the field its refusal must name)."""
    text = "word " * (BODY_BYTES // 5)
    rng = random.Random(0)
    ids = [rng.randrange(1000, 49000) for _ in range(BODY_BYTES // 7)]  # "12345, "
    kinds = [
        ("/v1/completions", {"model": model, "prompt": text, "max_tokens": 2}, "prompt"),
        (
            "/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": text}]},
            "messages",
        ),  # fmt: skip
        ("/v1/completions", {"model": model, "prompt": ids, "max_tokens": 2}, "prompt"),
        ("/v1/score", {"model": model, "prompt": [1] * (BODY_BYTES // 3)}, "prompt"),
        ("/generate", {"input_ids": ids}, "input_ids"),
    ]
    encoded = [(path, json.dumps(body).encode(), param) for path, body, param in kinds]
    return [encoded[i % len(encoded)] for i in range(20)]


def test_twenty_16mb_bodies_at_once_are_refused_and_memory_comes_back(tmp_path: Path) -> None:
    server = ServerProcess(SERVE_ARGS).start()
    try:
        assert server.proc is not None
        pid, base = server.proc.pid, server.base_url
        bodies = _bodies(server.model)
        assert all(len(body) >= 15 * MB for _, body, _ in bodies)
        # Warm every path once (a refused big body, a completion) before the baseline.
        path, body, _ = bodies[2]
        assert httpx.post(base + path, content=body, timeout=TIMEOUT_S).status_code == 400
        ok = {"model": server.model, "prompt": "Hello", "max_tokens": 2}
        assert httpx.post(base + "/v1/completions", json=ok, timeout=TIMEOUT_S).status_code == 200
        time.sleep(1.0)
        baseline = _rss(pid)

        peak = baseline
        done = threading.Event()

        def watch() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, _rss(pid))
                time.sleep(0.02)

        def send(item: tuple[str, bytes, str]) -> tuple[httpx.Response, float]:
            path, body, _ = item
            started = time.monotonic()
            headers = {"content-type": "application/json"}
            response = httpx.post(base + path, content=body, headers=headers, timeout=TIMEOUT_S)
            return response, time.monotonic() - started

        watcher = threading.Thread(target=watch)
        watcher.start()
        started = time.monotonic()
        try:
            with health_probe(base, tmp_path) as probes, ThreadPoolExecutor(len(bodies)) as pool:
                results = list(pool.map(send, bodies))
        finally:
            done.set()
            watcher.join(TIMEOUT_S)
        wall = time.monotonic() - started
        health = [seconds for seconds, _ in probes]

        for (path, _, param), (response, _) in zip(bodies, results, strict=True):
            assert response.status_code == 400, (path, response.text[:300])
            error = response.json()["error"]
            assert error["code"] == "context_length_exceeded", (path, error)
            assert error["param"] == param, (path, error)
        slowest = max(seconds for _, seconds in results)
        growth = peak - baseline
        # Settled: the refused bodies' memory is back (allow the allocator a moment).
        deadline = time.monotonic() + 10
        while _rss(pid) - baseline > RSS_SETTLED_LIMIT and time.monotonic() < deadline:
            time.sleep(0.2)
        settled = _rss(pid) - baseline
        figures = (
            f"wall {wall:.1f} s, slowest refusal {slowest:.1f} s, RSS baseline"
            f" {baseline / MB:.0f} MB, peak +{growth / MB:.0f} MB, settled +{settled / MB:.0f}"
            f" MB, /health p99 {p99(health):.2f} s, max {max(health):.2f} s over"
            f" {len(health)} probes"
        )
        print(figures)
        assert wall < 90, figures
        assert growth < RSS_GROWTH_LIMIT, figures
        assert settled < RSS_SETTLED_LIMIT, figures
        assert all(status == 200 for _, status in probes), probes
        # Never blocked for long: a 16 MB list of ids holds the GIL while it is parsed.
        assert max(health) < 5.0, figures
        assert server.wait_idle()["kv_in_use"] == 0
    finally:
        server.stop()


IDLE_S = 4.0  # --request-idle-timeout: longer than the 2 s the others get
ANSWERED_WITHIN_S = 2.0
SLACK_S = 1.5  # timer and scheduling slack on a loaded 2-core machine


def test_a_stalled_big_body_blocks_no_other_and_is_closed_at_its_idle_timeout() -> None:
    """One connection sends the head of a 1 MB completion body and 10 bytes of it, then
    nothing. A 100 KB completion and a small chunked one sent after it are each answered
    within 2 s: a byte budget for the bodies in flight, not one slot, so the stalled body (10
    bytes of it in memory) holds up no other. The stalled connection is closed once it has
    sent nothing for --request-idle-timeout, long before --request-read-timeout (60 s, the
    default), and the server logs why. (With one slot, both waited for the stalled
    connection's read deadline: 59 s.)"""
    server = ServerProcess(
        ["--model", "random:tiny", "--device", "cpu", "--kv-tokens", "512",
         "--max-model-len", "64", "--request-idle-timeout", str(IDLE_S)]
    ).start()  # fmt: skip
    try:
        host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
        stalled = socket.create_connection((host, int(port)), timeout=60)
        stalled.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000000\r\n\r\n{"prompt":'
        )
        last_byte = time.monotonic()
        time.sleep(0.5)  # its head read, its body being read
        small = json.dumps({"model": server.model, "prompt": "hi", "max_tokens": 2}).encode()
        padded = small + b" " * (100_000 - len(small))  # JSON allows the whitespace
        kinds = {"100 KB": padded, "chunked": iter([small])}  # an iterator: sent chunked
        answers: dict[str, tuple[httpx.Response, float]] = {}

        def send(kind: str) -> None:
            started = time.monotonic()
            response = httpx.post(
                server.base_url + "/v1/completions",
                content=kinds[kind],
                headers={"content-type": "application/json"},
                timeout=TIMEOUT_S,
            )
            answers[kind] = response, time.monotonic() - started

        threads = [threading.Thread(target=send, args=(kind,)) for kind in kinds]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT_S)
        assert set(answers) == set(kinds), answers
        for kind, (response, seconds) in answers.items():
            assert response.status_code == 200, (kind, response.text[:300])
            assert seconds < ANSWERED_WITHIN_S, f"the {kind} request took {seconds:.1f} s"
        with stalled:
            stalled.settimeout(60)
            try:
                assert stalled.recv(65536) == b""  # closed, nothing answered
            except ConnectionResetError:
                pass
            closed_after = time.monotonic() - last_byte
        print(
            ", ".join(
                f"{kind} answered in {seconds:.2f} s" for kind, (_, seconds) in answers.items()
            )
            + f"; the stalled connection closed {closed_after:.2f} s after its last byte"
        )
        assert IDLE_S - 0.2 <= closed_after < IDLE_S + SLACK_S, closed_after
        assert "(--request-idle-timeout)" in "".join(server.log)
        assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
    finally:
        server.stop()
