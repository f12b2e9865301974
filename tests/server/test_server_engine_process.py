"""The engine in a process of its own (lockstep/server/engine_process.py), on a real
`lockstep serve` of a tiny random model:

* 256 concurrent `/generate` requests (token ids in, logprobs out, greedy and seeded sampling)
  get exactly the tokens and logprobs the offline engine (`LLM`) gives the same prompts.
* The engine process killed (SIGKILL) while requests run: each gets a 503 (or, streaming, an
  error event) saying the engine process died, and the server exits with status 1 within
  seconds; no hang (every wait has a timeout).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from test_server import ServerProcess

MODEL = "random:tiny"
REQUESTS = 256
NEW_TOKENS = 8
ARGS = ["--model", MODEL, "--device", "cpu", "--kv-tokens", "16384", "--max-running", "64",
        "--max-waiting", "256", "--max-model-len", "256", "--debug-checks"]  # fmt: skip
# Long requests, so that they still run when the engine process is killed.
KILL_ARGS = ["--model", MODEL, "--device", "cpu", "--kv-tokens", "16384"]
TIMEOUT_S = 120  # a hang guard only
EXIT_WITHIN_S = 15.0


def _prompt(i: int) -> list[int]:
    return [(11 * i + 7 * j) % 250 + 3 for j in range(4 + i % 13)]


def _sampling(i: int) -> dict[str, Any]:
    """Even requests greedy, odd ones sampled at temperature 1 with a seed of their own."""
    if i % 2 == 0:
        return {"temperature": 0.0}
    return {"temperature": 1.0, "sampling_seed": 1000 + i}


def _offline(llm: Any, seed_shift: int = 0) -> list[tuple[list[int], list[float]]]:
    from lockstep import SamplingParams

    params = []
    for i in range(REQUESTS):
        s = _sampling(i)
        seed = s.get("sampling_seed")
        params.append(SamplingParams(
            max_tokens=NEW_TOKENS, temperature=s["temperature"], ignore_eos=True,
            seed=None if seed is None else seed + seed_shift,
        ))  # fmt: skip
    outs = llm.generate([_prompt(i) for i in range(REQUESTS)], params, use_tqdm=False)
    return [(o.token_ids, o.logprobs) for o in outs]


def _engine_pid(server: ServerProcess) -> int:
    """The server's engine process: its one multiprocessing spawn child."""
    assert server.proc is not None
    pid = server.proc.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    spawned = [c for c in map(int, children) if b"spawn_main" in _cmdline(c)]
    assert len(spawned) == 1, spawned
    return spawned[0]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return b""


def _generate(base_url: str, i: int) -> tuple[list[int], list[float]]:
    body = {"input_ids": _prompt(i), "return_logprob": True,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True,
                                **_sampling(i)}}  # fmt: skip
    resp = httpx.post(base_url + "/generate", json=body, timeout=TIMEOUT_S)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    entries = out["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in entries] == out["output_ids"]
    return out["output_ids"], [e[0] for e in entries]


def test_256_concurrent_generate_requests_give_the_offline_bits() -> None:
    server = ServerProcess(ARGS).start()
    try:
        with ThreadPoolExecutor(REQUESTS) as pool:
            served = list(pool.map(partial(_generate, server.base_url), range(REQUESTS)))
        server.wait_idle(TIMEOUT_S)
    finally:
        code = server.stop()
    assert code == 0, "".join(server.log[-40:])  # SIGTERM: drained, then a clean exit
    from lockstep import LLM

    llm = LLM(MODEL, device="cpu", kv_tokens=16384, max_running=64, max_model_len=256)
    offline = _offline(llm)
    mismatched = [i for i in range(REQUESTS) if served[i] != offline[i]]
    assert not mismatched, f"requests {mismatched[:10]} differ from the offline engine's bits"
    # Control: other seeds give other bits, so the comparison above can fail.
    reseeded = _offline(llm, seed_shift=1)
    assert all(reseeded[i] != served[i] for i in range(1, REQUESTS, 2))
    assert all(reseeded[i] == served[i] for i in range(0, REQUESTS, 2))  # greedy: no seed


def test_a_killed_engine_process_fails_requests_with_503_and_ends_the_server() -> None:
    server = ServerProcess(KILL_ARGS).start()
    assert server.proc is not None
    engine = _engine_pid(server)
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3000,
            "ignore_eos": True, "temperature": 0.0}}  # fmt: skip
    answers: list[httpx.Response | Exception] = []
    events: list[str] = []

    def post() -> None:
        try:
            answers.append(httpx.post(server.base_url + "/generate", json=body, timeout=60))
        except Exception as exc:  # a hang or a dropped connection: reported below
            answers.append(exc)

    def stream() -> None:
        with httpx.stream("POST", server.base_url + "/generate",
                          json={**body, "stream": True}, timeout=60) as resp:  # fmt: skip
            events.extend(line for line in resp.iter_lines() if line.startswith("data:"))

    threads = [threading.Thread(target=post) for _ in range(4)]
    threads.append(threading.Thread(target=stream))
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + TIMEOUT_S
    while not events:
        assert time.monotonic() < deadline, "the stream never started"
        time.sleep(0.02)
    # The control: the requests were running when the engine died, not already answered.
    assert not answers and "[DONE]" not in events[-1], (answers, events[-1:])
    os.kill(engine, signal.SIGKILL)
    killed = time.monotonic()
    code = server.proc.wait(EXIT_WITHIN_S + 30)
    took = time.monotonic() - killed
    for thread in threads:
        thread.join(30)
    log = "".join(server.log)
    assert code == 1, log[-3000:]
    assert took < EXIT_WITHIN_S, f"exited {took:.1f} s after the kill"
    died = f"the engine process (pid {engine}) died (signal SIGKILL)"
    assert died in log, log[-3000:]
    assert len(answers) == 4
    for resp in answers:
        assert isinstance(resp, httpx.Response), resp
        assert resp.status_code == 503, resp.text
        assert died in resp.json()["error"]["message"]
    assert events[-1] == "data: [DONE]"
    assert died in json.loads(events[-2][5:])["error"]["message"], events[-2:]
