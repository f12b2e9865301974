"""`/release_memory_occupation` and `/resume_memory_occupation` (and vLLM's `/sleep`,
`/wake_up`, `/is_sleeping`) on a real `lockstep serve` on the CPU: after a release and a
resume of either tag or both, a fixed seeded request gives the bits it gave before (control:
another seed differs); a request that arrives while memory is released waits and completes
after the resume; a release while requests run, a weight update while the weights are
released and an unknown tag are refused with a 400 naming why. The memory itself is measured
on CUDA (tests/gpu/test_gpu_rl.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_server import ServerProcess

pytest.importorskip("transformers")
from tests.support.tiny_hf import save_tiny  # noqa: E402

ARGS = ["--device", "cpu", "--kv-tokens", "2048", "--max-batch-tokens", "256", "--chunk-size",
        "64", "--max-running", "16", "--max-model-len", "512", "--debug-checks"]  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("rl_memory") / "qwen3"
    save_tiny("qwen3", path)
    return path


@pytest.fixture(scope="module")
def server(folder: Any) -> Iterator[ServerProcess]:
    proc = ServerProcess(["--model", str(folder), *ARGS]).start()
    yield proc
    proc.stop()


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def _probe(http: httpx.Client, seed: int = 5) -> tuple[list[int], list[float]]:
    body = {"input_ids": [(9 * j) % 280 + 5 for j in range(30)], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": seed,
                                "ignore_eos": True}}  # fmt: skip
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    out = response.json()
    return out["output_ids"], [e[0] for e in out["meta_info"]["output_token_logprobs"]]


@pytest.mark.parametrize("tags", [["kv_cache"], ["weights"], None])
def test_release_and_resume_give_the_same_bits(
    server: ServerProcess, http: httpx.Client, tags: list[str] | None
) -> None:
    before = _probe(http)
    assert _probe(http, seed=6) != before  # the control: the probe sees a change
    released = http.post("/release_memory_occupation", json={"tags": tags})
    assert released.status_code == 200, released.text
    assert released.json()["released_tags"] == sorted(tags or ["kv_cache", "weights"])
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    if tags is None:
        assert server.engine_stats()["kv_cached"] == 0  # the prefix cache went with the pool
    # A request sent now waits, then completes after the resume.
    result: dict[str, Any] = {}
    late = threading.Thread(target=lambda: result.update(bits=_probe(http)), daemon=True)
    late.start()
    time.sleep(0.5)
    assert late.is_alive()
    resumed = http.post("/resume_memory_occupation", json={"tags": tags})
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["released_tags"] == []
    late.join(60)
    assert result["bits"] == before
    assert _probe(http) == before
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    server.wait_idle()


def test_vllm_sleep_and_wake_up(server: ServerProcess, http: httpx.Client) -> None:
    before = _probe(http)
    assert http.post("/sleep", params={"level": 1}).status_code == 200
    assert http.post("/wake_up", params={"tags": "weights"}).json()["released_tags"] == ["kv_cache"]
    assert http.post("/wake_up").status_code == 200
    assert _probe(http) == before
    assert http.post("/sleep", params={"level": 3}).status_code == 400


def test_refusals(server: ServerProcess, http: httpx.Client, folder: Any) -> None:
    bad = http.post("/release_memory_occupation", json={"tags": ["activations"]})
    assert bad.status_code == 400, bad.text
    # Weights released: an update would write into freed storage.
    assert http.post("/release_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    update = http.post("/update_weights_from_disk", json={"model_path": str(folder)})
    assert update.status_code == 400 and "resume" in update.json()["message"], update.text
    assert http.post("/resume_memory_occupation", json={}).status_code == 200
    # A request running: its KV would go.
    body = {"input_ids": [7] * 20, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    result: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: result.update(r=http.post("/generate", json=body)))
    before = server.engine_stats()["generated_tokens_total"]
    runner.start()
    while server.engine_stats()["generated_tokens_total"] - before < 2:
        time.sleep(0.01)
    refused = http.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
    assert refused.status_code == 400 and "pause" in refused.json()["message"], refused.text
    runner.join(120)
    assert result["r"].status_code == 200
    server.wait_idle()
