"""Two `lockstep serve` replicas behind the routers people run in front of SGLang and vLLM
engines (sglang-router with `cache_aware`, vllm-router with `round_robin`), as a user starts
them: every route answers through the router with the bits one replica gives when asked
directly, and both replicas give the same bits.

What the routers do to requests (seen on these versions): sglang-router 0.3.2 adds `model`
(null), `log_metrics`, `no_logs`, `return_bytes`, `return_entropy`, `background` to
`/generate`, and `no_stop_trim`, `ignore_eos`, `skip_special_tokens`,
`return_hidden_states`, `continue_final_message`, `separate_reasoning`, `stream_reasoning`
to the OpenAI routes, each at its default; vllm-router 0.1.17 adds the same to the OpenAI
routes and rebuilds `/generate` bodies from a fixed set of fields, dropping `sampling_seed`
(the seed then travels as the `X-Sampling-Seed` header, which it forwards). Skipped with a
reason where a router cannot be imported.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_server import ServerProcess

pytest.importorskip("transformers")
from tests.support.tiny_hf import save_tiny  # noqa: E402

ARGS = ["--device", "cpu", "--kv-tokens", "4096", "--max-batch-tokens", "256",
        "--chunk-size", "64", "--max-running", "16", "--max-model-len", "512"]  # fmt: skip
ROUTERS = {
    "sglang-router": ("sglang_router", "cache_aware"),
    "vllm-router": ("vllm_router", "round_robin"),
}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    folder = tmp_path_factory.mktemp("routers") / "tiny-qwen3"
    save_tiny("qwen3", folder, seed=10)
    procs = [ServerProcess(["--model", str(folder), *ARGS]) for _ in range(2)]
    try:
        for proc in procs:
            proc.start()
        yield procs
    finally:
        for proc in procs:
            proc.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(module: str, policy: str, urls: list[str]) -> tuple[subprocess.Popen, str]:
    """A router on free ports (its own and its Prometheus exporter's: two routers at once
    would both take the default) in front of `urls`. Its log goes to a temporary file: a pipe
    nobody drains would fill with its per-request lines and stall it."""
    port, metrics = _free_port(), _free_port()
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", f"{module}.launch_router", "--host", "127.0.0.1",
         "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port",
         str(metrics), "--policy", policy, "--worker-urls", *urls],
        stdout=subprocess.DEVNULL, stderr=log, text=True,
    )  # fmt: skip
    proc.log = log  # type: ignore[attr-defined]
    return proc, f"http://127.0.0.1:{port}"


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module", params=list(ROUTERS))
def router(request: pytest.FixtureRequest, replicas: list[ServerProcess]) -> Iterator[str]:
    module, policy = ROUTERS[request.param]
    pytest.importorskip(module, reason=f"{request.param} is not installed")
    proc, url = _launch(module, policy, [r.base_url for r in replicas])
    deadline = time.monotonic() + 120
    try:
        while True:  # ready once a request goes through to a worker
            try:
                probe = httpx.post(url + "/generate", timeout=10, json={
                    "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})  # fmt: skip
                if probe.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.log.seek(0)  # type: ignore[attr-defined]
                pytest.fail(f"{request.param} did not start: {proc.log.read()[-2000:]}")  # type: ignore[attr-defined]
            time.sleep(0.3)
        yield url
    finally:
        _stop(proc)


def _post(base: str, path: str, body: dict[str, Any], **headers: str) -> Any:
    resp = httpx.post(base + path, json=body, headers=headers, timeout=120)
    assert resp.status_code == 200, (base, path, resp.text)
    return resp.json()


def _generate_bits(answer: dict[str, Any]) -> tuple[list[int], list[float]]:
    meta = answer["meta_info"]
    return answer["output_ids"], [lp for lp, _, _ in meta["output_token_logprobs"]]


SEED = {"X-Sampling-Seed": "3"}
GENERATE = [
    (
        {
            "input_ids": [5, 6, 7, 8, 9],
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0},
        },
        {},
    ),  # fmt: skip
    (
        {
            "text": "hello there",
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 3},
        },
        SEED,
    ),  # fmt: skip
    (
        {
            "input_ids": [[1, 2, 3], [4, 5]],
            "return_logprob": True,
            "sampling_params": {
                "max_new_tokens": 8,
                "temperature": 0.8,
                "top_p": 0.9,
                "sampling_seed": 3,
            },
        },
        SEED,
    ),  # fmt: skip
]


@pytest.mark.parametrize("case", range(len(GENERATE)))
def test_generate_through_the_router_gives_every_replicas_bits(
    router: str, replicas: list[ServerProcess], case: int
) -> None:
    body, headers = GENERATE[case]
    direct = [_post(r.base_url, "/generate", body) for r in replicas]
    assert _bits(direct[0]) == _bits(direct[1])
    for _ in range(3):  # round robin: each replica serves some of these
        assert _bits(_post(router, "/generate", body, **headers)) == _bits(direct[0])


def _bits(answer: Any) -> Any:
    if isinstance(answer, list):
        return [_generate_bits(a) for a in answer]
    return _generate_bits(answer)


def test_generate_streams_through_the_router(router: str, replicas: list[ServerProcess]) -> None:
    body = {"input_ids": [5, 6, 7], "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 4}}  # fmt: skip
    direct = _post(replicas[1].base_url, "/generate", {**body, "stream": False})
    with httpx.stream("POST", router + "/generate", json=body, timeout=120,
                      headers={"X-Sampling-Seed": "4"}) as resp:  # fmt: skip
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert _generate_bits(last) == _generate_bits(direct)


def test_openai_routes_through_the_router(router: str, replicas: list[ServerProcess]) -> None:
    model = replicas[0].model
    completion = {"model": model, "prompt": "The sky is", "max_tokens": 10, "temperature": 1.0,
                  "seed": 11, "logprobs": 2}  # fmt: skip
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10,
            "temperature": 1.0, "seed": 11, "logprobs": True, "top_logprobs": 2}  # fmt: skip
    for path, body, pick in (
        ("/v1/completions", completion, lambda a: (a["choices"][0]["text"],
                                                   a["choices"][0]["logprobs"])),
        ("/v1/chat/completions", chat, lambda a: (a["choices"][0]["message"]["content"],
                                                  a["choices"][0]["logprobs"])),
    ):  # fmt: skip
        want = pick(_post(replicas[0].base_url, path, body))
        assert pick(_post(replicas[1].base_url, path, body)) == want
        for _ in range(2):
            assert pick(_post(router, path, body)) == want, path


def test_the_openai_client_through_the_router(router: str, replicas: list[ServerProcess]) -> None:
    openai = pytest.importorskip("openai")
    texts = []
    for base in (router, replicas[0].base_url):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model=replicas[0].model, messages=[{"role": "user", "content": "Count"}],
            max_tokens=8, temperature=1.0, seed=5, stream=True,
        )  # fmt: skip
        texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    assert texts[0] == texts[1] and texts[0]


def test_router_endpoints_the_routers_call(replicas: list[ServerProcess]) -> None:
    """The discovery and load routes under SGLang's current and older names."""
    base = replicas[0].base_url
    for path in ("/server_info", "/get_server_info"):
        assert httpx.get(base + path, timeout=30).json()["max_total_num_tokens"] > 0
    for path in ("/model_info", "/get_model_info"):
        assert httpx.get(base + path, timeout=30).json()["is_generation"] is True
    (load,) = httpx.get(base + "/get_load", timeout=30).json()
    assert set(load) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}


def test_control_vllm_router_drops_the_body_seed(replicas: list[ServerProcess]) -> None:
    """Why the header exists: through vllm-router a seed given only in the body is lost, so
    two sampled calls differ (and each differs from a replica asked directly)."""
    pytest.importorskip("vllm_router", reason="vllm-router is not installed")
    body = {"input_ids": [5, 6, 7], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 3}}  # fmt: skip
    proc, url = _launch("vllm_router", "round_robin", [replicas[0].base_url])
    try:
        answers, deadline = [], time.monotonic() + 60
        while len(answers) < 2 and time.monotonic() < deadline:
            try:
                resp = httpx.post(url + "/generate", json=body, timeout=60)
            except httpx.TransportError:
                time.sleep(0.3)
                continue
            if resp.status_code == 200:
                answers.append(_generate_bits(resp.json()))
        assert len(answers) == 2
        assert answers[0] != answers[1]
        assert answers[0] != _generate_bits(_post(replicas[0].base_url, "/generate", body))
    finally:
        _stop(proc)


def test_seed_header_is_the_body_seed_and_refuses_what_it_cannot_be(
    replicas: list[ServerProcess],
) -> None:
    base = replicas[0].base_url
    body = {"input_ids": [5, 6, 7], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 1.0}}  # fmt: skip
    seeded = {**body, "sampling_params": {**body["sampling_params"], "sampling_seed": 9}}
    want = _generate_bits(_post(base, "/generate", seeded))
    assert _generate_bits(_post(base, "/generate", body, **{"X-Sampling-Seed": "9"})) == want
    assert _generate_bits(_post(base, "/generate", seeded, **{"X-Sampling-Seed": "9"})) == want
    for header, body_ in (("10", seeded), ("nine", body), ("-1", body), (str(2**63), body)):
        resp = httpx.post(base + "/generate", json=body_, headers={"X-Sampling-Seed": header},
                          timeout=60)  # fmt: skip
        assert resp.status_code == 400, (header, resp.text)
        assert resp.json()["error"]["param"] == "X-Sampling-Seed"
