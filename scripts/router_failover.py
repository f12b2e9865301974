"""Two `lockstep serve` replicas behind sglang-router under load, one replica killed and
restarted in the middle: no request hangs, every answer that comes back 200 has the bits a
replica gives when asked directly, the rest fail with a clear status, and both pools hold no
request's KV at the end.

    python scripts/router_failover.py --model PATH --requests 200

(`--model` as `lockstep serve` takes it; a tiny folder keeps the run short on a CPU.) It
starts the replicas on fixed ports (the restarted one comes back where the router knows it)
and the router, sends `--requests` concurrent mixed requests (`/generate` greedy and seeded,
completions, chat; a quarter streamed), kills replica 2 with SIGKILL once a fifth of them
have answered, restarts it, and checks. A table, then one JSON document on the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
REQUEST_TIMEOUT_S = 300  # "no request hangs": each must end within this


def _serve(model: str, port: int, extra: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-m", "lockstep", "serve", "--model", model, "--port", str(port),
         *extra],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _wait_healthy(url: str, server: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the replica at {url} exited with status {server.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not become healthy in {timeout} s")


def _requests(n: int, model: str, seed: int, tokens: int) -> list[tuple[str, dict[str, Any], dict]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 4
        stream = i % 8 >= 6
        if kind == 0:
            body = {"input_ids": [rng.randrange(3, 250) for _ in range(rng.randint(5, 60))],
                    "return_logprob": True,
                    "sampling_params": {"max_new_tokens": tokens, "temperature": 0}}  # fmt: skip
            out.append(("/generate", body | {"stream": stream}, {}))
        elif kind == 1:
            s = rng.randrange(1000)
            body = {"text": f"request {i} says", "return_logprob": True,
                    "sampling_params": {"max_new_tokens": tokens, "temperature": 1.0,
                                        "sampling_seed": s}}  # fmt: skip
            out.append(("/generate", body | {"stream": stream}, {"X-Sampling-Seed": str(s)}))
        elif kind == 2:
            out.append(("/v1/completions", {"model": model, "prompt": f"item {i}:",
                                            "max_tokens": tokens, "temperature": 1.0,
                                            "seed": i, "logprobs": 1}, {}))  # fmt: skip
        else:
            out.append(("/v1/chat/completions", {
                "model": model, "messages": [{"role": "user", "content": f"say {i}"}],
                "max_tokens": tokens, "temperature": 1.0, "seed": i, "logprobs": True}, {}))  # fmt: skip
    return out


def _bits(path: str, answer: Any) -> Any:
    if path == "/generate":
        meta = answer["meta_info"]
        return answer["output_ids"], [lp for lp, _, _ in meta["output_token_logprobs"]]
    choice = answer["choices"][0]
    text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
    return text, choice["logprobs"]


async def _send(client: httpx.AsyncClient, base: str, path: str, body: dict, headers: dict):
    """(status, answer or None, seconds); a streamed /generate's answer is its last event."""
    started = time.monotonic()
    try:
        if body.get("stream"):
            async with client.stream("POST", base + path, json=body, headers=headers) as resp:
                events = [line[6:] async for line in resp.aiter_lines()
                          if line.startswith("data: ")]  # fmt: skip
                if resp.status_code != 200 or len(events) < 2 or events[-1] != "[DONE]":
                    return resp.status_code if resp.status_code != 200 else -1, None, 0.0
                return 200, json.loads(events[-2]), time.monotonic() - started
        resp = await client.post(base + path, json=body, headers=headers)
        answer = resp.json() if resp.status_code == 200 else None
        return resp.status_code, answer, time.monotonic() - started
    except httpx.TimeoutException:
        return "timeout", None, time.monotonic() - started
    except httpx.HTTPError as exc:
        return type(exc).__name__, None, time.monotonic() - started


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    extra = ["--device", "cpu", "--kv-tokens", "8192", "--max-model-len", "512",
             "--max-running", "64"]  # fmt: skip
    ports = [args.port + 1, args.port + 2]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    replicas = [_serve(args.model, p, extra) for p in ports]
    for url, proc in zip(urls, replicas, strict=True):
        _wait_healthy(url, proc)
    served = httpx.get(urls[0] + "/v1/models").json()["data"][0]["id"]
    router = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
         "--port", str(args.port), "--policy", "cache_aware", "--prometheus-port",
         str(args.port + 3), "--worker-urls", *urls],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{args.port}"
    try:
        time.sleep(5)
        work = _requests(args.requests, served, seed=1, tokens=args.max_tokens)
        limits = httpx.Limits(max_connections=args.requests)
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
            tasks = [asyncio.create_task(_send(client, base, p, b, h)) for p, b, h in work]
            killed_at = restarted_at = None
            while sum(t.done() for t in tasks) < len(tasks) // 5:
                await asyncio.sleep(0.05)
            replicas[1].send_signal(signal.SIGKILL)
            killed_at = sum(t.done() for t in tasks)
            replicas[1].wait()
            replicas[1] = _serve(args.model, ports[1], extra)
            await asyncio.to_thread(_wait_healthy, urls[1], replicas[1])
            restarted_at = sum(t.done() for t in tasks)
            results = await asyncio.gather(*tasks)
            # The reference: each request asked directly of the replica that never died.
            direct = await asyncio.gather(*[
                _send(client, urls[0], p, {**b, "stream": False} if "stream" in b else b, h)
                for p, b, h in work])  # fmt: skip
            # And of the restarted one, for a sample: it rejoins with the same bits.
            sample = list(range(0, len(work), 10))
            again = await asyncio.gather(*[
                _send(client, urls[1], work[i][0], {**work[i][1], "stream": False}
                      if "stream" in work[i][1] else work[i][1], work[i][2]) for i in sample])  # fmt: skip
    finally:
        router.terminate()
    statuses: dict[str, int] = {}
    differ = []
    for i, ((path, _, _), (status, answer, _), (_, ref, _)) in enumerate(
        zip(work, results, direct, strict=True)
    ):
        statuses[str(status)] = statuses.get(str(status), 0) + 1
        if status == 200 and (ref is None or _bits(path, answer) != _bits(path, ref)):
            differ.append(i)
    rejoined_differ = [i for i, (s, a, _) in zip(sample, again, strict=True)
                       if s != 200 or _bits(work[i][0], a) != _bits(work[i][0], direct[i][1])]  # fmt: skip
    idle = []
    for url in urls:
        deadline = time.monotonic() + 60
        while True:
            stats = httpx.get(url + "/v1/engine", timeout=30).json()["stats"]
            if stats["num_running"] == stats["num_waiting"] == stats["kv_in_use"] == 0:
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        idle.append(stats["kv_in_use"] == 0 and stats["num_running"] == 0)
    for proc in replicas:
        proc.terminate()
    for proc in replicas:
        proc.wait(60)
    slowest = max(seconds for _, _, seconds in results)
    return {"requests": len(work), "statuses": statuses, "killed_after": killed_at,
            "restarted_after": restarted_at, "differ_from_direct": differ,
            "restarted_replica_differs": rejoined_differ, "slowest_s": round(slowest, 2),
            "pools_idle": idle}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=128, help="per request")
    parser.add_argument("--port", type=int, default=30100, help="the router's; replicas +1, +2")
    args = parser.parse_args()
    result = asyncio.run(_run(args))
    for key, value in result.items():
        print(f"{key:28} {value}")
    ok = (not result["differ_from_direct"] and not result["restarted_replica_differs"]
          and all(result["pools_idle"]) and "timeout" not in result["statuses"])  # fmt: skip
    print(json.dumps(result | {"passed": ok}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
