"""Overload: N simultaneous completions against a small `lockstep serve` on the CPU.

    python scripts/overload_burst.py [--requests 300] [--max-running 4] [--max-waiting 4]

Starts the server (the embedded model), sends every request at once from N threads, and
reports the status codes, whether every 429 carries Retry-After, whether every accepted
completion equals the same request sent alone (text and token logprobs), /health latency
from a separate process while the burst runs (so the client threads' GIL is not timed), and
the engine's state afterwards (no request or KV slot left over). Loopback only; bounded in
requests and time. Prints a table, then one JSON document on the last line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

PROBE = """
import json, sys, time
from pathlib import Path
import httpx
url, out, stop = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
with httpx.Client(timeout=30) as client, out.open("w") as f:
    while not stop.exists():
        t = time.perf_counter()
        status = client.get(url).status_code
        f.write(json.dumps([time.perf_counter() - t, status]) + "\\n")
        f.flush()
        time.sleep(0.05)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--max-running", type=int, default=4)
    ap.add_argument("--max-waiting", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--port", type=int, default=8731)
    args = ap.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    serve = [
        sys.executable, "-m", "lockstep", "serve", "--device", "cpu", "--port", str(args.port),
        "--kv-tokens", "2048", "--max-batch-tokens", "256", "--chunk-size", "128",
        "--max-model-len", "512", "--max-running", str(args.max_running),
        "--max-waiting", str(args.max_waiting),
    ]  # fmt: skip
    server = subprocess.Popen(serve, stderr=subprocess.DEVNULL)
    tmp = Path(tempfile.mkdtemp())
    try:
        _wait_healthy(base, server)
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        bodies = [
            {"model": model, "prompt": f"Write a line about number {i}:", "temperature": 0,
             "max_tokens": args.max_tokens, "logprobs": 0}
            for i in range(args.requests)
        ]  # fmt: skip
        probe = subprocess.Popen(
            [sys.executable, "-c", PROBE, base + "/health", str(tmp / "lat"), str(tmp / "stop")]
        )
        time.sleep(1.0)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(bodies)) as pool:
            burst = list(pool.map(lambda b: _post(base, b), bodies))
        wall = time.perf_counter() - t0
        (tmp / "stop").touch()
        probe.wait(60)
        latencies = sorted(json.loads(line)[0] for line in (tmp / "lat").read_text().splitlines())
        statuses: dict[int, int] = {}
        for r in burst:
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        differing = 0
        for body, r in zip(bodies, burst, strict=True):
            if r.status_code == 200:
                alone, got = _post(base, body).json()["choices"][0], r.json()["choices"][0]
                differing += alone["text"] != got["text"] or (
                    alone["logprobs"]["token_logprobs"] != got["logprobs"]["token_logprobs"]
                )
        stats = httpx.get(base + "/v1/engine").json()["stats"]
    finally:
        server.terminate()
        server.wait(60)
    doc = {
        "command": "python scripts/overload_burst.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "statuses": statuses,
        "retry_after_on_every_429": all(
            r.headers.get("Retry-After") == "1" for r in burst if r.status_code == 429
        ),
        "accepted_differing_from_alone": differing,
        "burst_wall_s": round(wall, 2),
        "health_probes": len(latencies),
        "health_p99_s": round(latencies[int(0.99 * (len(latencies) - 1))], 4),
        "health_max_s": round(latencies[-1], 4),
        "after": {k: stats[k] for k in ("num_running", "num_waiting", "kv_in_use")},
    }
    for key in ("statuses", "retry_after_on_every_429", "accepted_differing_from_alone",
                "health_p99_s", "health_max_s", "after"):  # fmt: skip
        print(f"{key:32} {doc[key]}")
    print(json.dumps(doc))
    return 0


def _post(base: str, body: dict) -> httpx.Response:
    return httpx.post(base + "/v1/completions", json=body, timeout=600)


def _wait_healthy(base: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"lockstep serve exited with status {server.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit("lockstep serve did not answer /health within 300 s")


if __name__ == "__main__":
    sys.exit(main())
