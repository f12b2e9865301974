"""`/pause_generation` and `/continue_generation` on a real `lockstep serve` under load: 64
seeded requests in flight, paused mid-way in each of SGLang's modes. `retract` and
`in_place` give, after `/continue_generation`, every token and logprob of an unpaused run bit
for bit (control: other seeds differ); `abort` answers every request at once with finish
reason abort and a prefix of the unpaused output; nothing hangs, a request sent while paused
waits for the continue, and the engine ends idle with its pools whole (`--debug-checks` runs
`check_integrity` after every step)."""

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

N = 64
TOKENS = 24
# Overlapped decode (off by default on the CPU): a pause then finds a step launched ahead,
# which it completes before it stops.
ARGS = ["--device", "cpu", "--kv-tokens", "8192", "--max-batch-tokens", "512", "--chunk-size",
        "64", "--max-running", "64", "--max-model-len", "256", "--debug-checks",
        "--overlap-decode"]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("rl_pause") / "qwen3"
    save_tiny("qwen3", folder)
    proc = ServerProcess(["--model", str(folder), *ARGS]).start()
    yield proc
    proc.stop()


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def _body(seed: int) -> dict[str, Any]:
    prompts = [[(7 * i + 13 * j) % 280 + 5 for j in range(10 + i % 7)] for i in range(N)]
    params = [{"max_new_tokens": TOKENS, "temperature": 1.0, "sampling_seed": seed + i,
               "ignore_eos": True} for i in range(N)]  # fmt: skip
    return {"input_ids": prompts, "sampling_params": params, "return_logprob": True}


def _bits(outputs: list[dict[str, Any]]) -> list[tuple[list[int], list[float]]]:
    return [
        (o["output_ids"], [e[0] for e in o["meta_info"]["output_token_logprobs"]]) for o in outputs
    ]


class _InFlight:
    """One batched `/generate` of N requests on a thread of its own."""

    def __init__(self, base_url: str, body: dict[str, Any]) -> None:
        self.result: Any = None
        self.thread = threading.Thread(target=self._run, args=(base_url, body), daemon=True)
        self.thread.start()

    def _run(self, base_url: str, body: dict[str, Any]) -> None:
        with httpx.Client(base_url=base_url, timeout=300) as client:
            response = client.post("/generate", json=body)
            self.result = (response.status_code, response.json())

    def join(self, timeout: float = 120) -> list[dict[str, Any]]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the request hung"
        status, outputs = self.result
        assert status == 200, outputs
        return outputs


def _wait_for_tokens(server: ServerProcess, before: int, at_least: int) -> dict[str, Any]:
    """Stats once the engine has generated `at_least` tokens since `before`."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        stats = server.engine_stats()
        if stats["generated_tokens_total"] - before >= at_least:
            return stats
        time.sleep(0.01)
    raise AssertionError("the engine generated nothing")


@pytest.fixture(scope="module")
def unpaused(server: ServerProcess) -> list[tuple[list[int], list[float]]]:
    with httpx.Client(base_url=server.base_url, timeout=300) as client:
        response = client.post("/generate", json=_body(1000))
    assert response.status_code == 200, response.text
    return _bits(response.json())


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_and_continue_give_the_unpaused_bits(
    server: ServerProcess, http: httpx.Client, unpaused: list, mode: str
) -> None:
    http.post("/flush_cache")
    before = server.engine_stats()["generated_tokens_total"]
    run = _InFlight(server.base_url, _body(1000))
    _wait_for_tokens(server, before, N)  # a first token each, about
    paused = http.post("/pause_generation", json={"mode": mode})
    assert paused.status_code == 200, paused.text
    assert paused.json()["num_paused_requests"] > 0
    stats = server.engine_stats()
    done = stats["generated_tokens_total"] - before
    assert 0 < done < N * TOKENS, "the pause did not fall mid-way"
    if mode == "retract":
        assert stats["num_running"] == 0 and stats["kv_in_use"] == 0, stats
        assert stats["num_waiting"] > 0, stats
    else:
        assert stats["num_running"] > 0 and stats["kv_in_use"] > 0, stats
    # Paused: no step runs, and a request sent now waits in the queue.
    late = _InFlight(server.base_url, {"input_ids": [5, 6, 7], "sampling_params":
                                       {"max_new_tokens": 2, "temperature": 0}})  # fmt: skip
    time.sleep(0.5)
    assert server.engine_stats()["generated_tokens_total"] - before == done
    assert late.thread.is_alive()
    # Healthy while paused, said at once (no one-token generation can run).
    health = http.get("/health_generate", timeout=5)
    assert health.status_code == 200 and health.json()["detail"] == "generation paused"
    assert http.post("/continue_generation", json={}).status_code == 200
    assert _bits(run.join()) == unpaused
    assert late.join()["meta_info"]["finish_reason"]["type"] == "length"
    server.wait_idle()


def test_other_seeds_differ(server: ServerProcess, unpaused: list) -> None:
    """The control: the bit comparison above sees a change of seeds."""
    with httpx.Client(base_url=server.base_url, timeout=300) as client:
        other = _bits(client.post("/generate", json=_body(2000)).json())
    assert other != unpaused
    assert sum(a[0] != b[0] for a, b in zip(other, unpaused, strict=True)) > N // 2


def test_pause_abort_ends_every_request_with_its_tokens_so_far(
    server: ServerProcess, http: httpx.Client, unpaused: list
) -> None:
    before = server.engine_stats()["generated_tokens_total"]
    run = _InFlight(server.base_url, _body(1000))
    _wait_for_tokens(server, before, N)
    paused = http.post("/pause_generation", json={"mode": "abort"})
    assert paused.status_code == 200, paused.text
    outputs = run.join(timeout=30)  # answered at once, not after a continue
    partial = 0
    for out, (ids, logprobs) in zip(outputs, unpaused, strict=True):
        meta, got = out["meta_info"], _bits([out])[0]
        n = len(out["output_ids"])
        assert got == (ids[:n], logprobs[:n]), "a partial output is a prefix of the full one"
        if n < TOKENS:
            partial += 1
            assert meta["finish_reason"]["type"] == "abort", meta
    assert partial > 0
    stats = server.wait_idle()
    assert stats["kv_in_use"] == 0
    # Still paused: a new request waits until the continue.
    late = _InFlight(server.base_url, {"input_ids": [5, 6, 7], "sampling_params":
                                       {"max_new_tokens": 2, "temperature": 0}})  # fmt: skip
    time.sleep(0.5)
    assert late.thread.is_alive()
    assert http.post("/continue_generation").status_code == 200
    assert late.join()["meta_info"]["finish_reason"]["type"] == "length"
    server.wait_idle()


def test_pause_refuses_an_unknown_mode(http: httpx.Client) -> None:
    response = http.post("/pause_generation", json={"mode": "later"})
    assert response.status_code == 400, response.text
    assert "mode" in response.text


def test_reset_prefix_cache_is_flush_cache(http: httpx.Client) -> None:
    http.post("/generate", json={"input_ids": [9] * 40, "sampling_params": {"max_new_tokens": 1}})
    response = http.post("/reset_prefix_cache")
    assert response.status_code == 200 and response.json()["flushed_tokens"] >= 40


def test_update_weight_version_renames_the_weights(http: httpx.Client) -> None:
    before = http.get("/model_info").json()["weight_version"]
    probe = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0},
             "return_logprob": True}  # fmt: skip
    first = http.post("/generate", json=probe).json()
    answer = http.post("/update_weight_version", json={"new_version": "renamed-1"})
    assert answer.status_code == 200 and answer.json()["weight_version"] == "renamed-1"
    again = http.post("/generate", json=probe).json()
    assert again["meta_info"]["weight_version"] == "renamed-1" != before
    assert again["output_ids"] == first["output_ids"]  # the same weights
    assert (
        again["meta_info"]["output_token_logprobs"] == first["meta_info"]["output_token_logprobs"]
    )
    assert http.post("/update_weight_version", json={}).status_code == 400
