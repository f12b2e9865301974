"""SGLang's native API on a real `lockstep serve`, driven over HTTP the way RL frameworks drive
their rollout engine: batches of token ids with logprobs, seeded sampling, the on-policy check
(sampled logprobs equal the scored ones bit for bit), the prefix cache, streaming, abort, and
weight updates from disk without a restart.

The server loads a tiny random Qwen3 folder written here (weights A); a second folder of the
same shape (weights B) and one of another shape exercise `/update_weights_from_disk`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_server import ServerProcess

pytest.importorskip("transformers")
from tests.support.tiny_hf import save_tiny  # noqa: E402

ARGS = ["--device", "cpu", "--kv-tokens", "4096", "--max-batch-tokens", "256",
        "--chunk-size", "64", "--max-running", "16", "--max-model-len", "512",
        "--debug-checks"]  # fmt: skip
VOCAB = 300  # tiny_hf's byte tokenizer


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("native")
    paths = {"a": root / "a", "b": root / "b", "other": root / "other"}
    save_tiny("qwen3", paths["a"], seed=10)
    save_tiny("qwen3", paths["b"], seed=11)
    save_tiny("llama", paths["other"], seed=12)  # another architecture
    return paths


@pytest.fixture(scope="module")
def server(folders: dict[str, Path]) -> Iterator[ServerProcess]:
    proc = ServerProcess(["--model", str(folders["a"]), *ARGS]).start()
    yield proc
    proc.stop()


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=300) as client:
        yield client


def _generate(http: httpx.Client, body: dict[str, Any]) -> Any:
    resp = http.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _prompts(n: int, length: int = 20) -> list[list[int]]:
    return [[(7 * i + 13 * j) % (VOCAB - 10) + 5 for j in range(length + i)] for i in range(n)]


def _values(entries: list[list[Any]]) -> list[float | None]:
    return [e[0] for e in entries]


def test_rl_batch_seeded_and_on_policy(http: httpx.Client) -> None:
    """A batch of token-id prompts sampled at temperature 1 with seeds: a repeat gives the
    same tokens and logprobs, and scoring prompt + output gives the sampled logprobs bit for
    bit. Control: the same comparison one position off fails."""
    prompts = _prompts(4)
    body = {
        "input_ids": prompts,
        "sampling_params": [
            {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 100 + i, "ignore_eos": True}
            for i in range(4)
        ],
        "return_logprob": True,
    }
    first = _generate(http, body)
    again = _generate(http, body)
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in again]
    assert [o["meta_info"]["output_token_logprobs"] for o in first] == [
        o["meta_info"]["output_token_logprobs"] for o in again
    ]
    for prompt, out in zip(prompts, first, strict=True):
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 12}
        assert meta["completion_tokens"] == len(out["output_ids"]) == 12
        assert meta["input_token_logprobs"] == []  # logprob_start_len defaults to -1
        assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
        scored = _generate(http, {
            "input_ids": prompt + out["output_ids"],
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": len(prompt) - 1,
        })  # fmt: skip
        entries = scored["meta_info"]["input_token_logprobs"]
        assert scored["output_ids"] == [] and scored["meta_info"]["completion_tokens"] == 0
        # The rollout cached its prompt's KV and its tokens' logprobs: scoring reuses them.
        assert scored["meta_info"]["cached_tokens"] >= len(prompt)
        assert entries[0][0] is None  # SGLang's shape: the first position has no logprob
        assert [e[1] for e in entries[1:]] == out["output_ids"]
        sampled = _values(meta["output_token_logprobs"])
        assert _values(entries[1:]) == sampled
        assert _values(entries[1:])[1:] != sampled[:-1]  # control: misaligned, it must differ
    other_seed = _generate(http, {**body, "sampling_params": [
        {**p, "sampling_seed": p["sampling_seed"] + 50} for p in body["sampling_params"]]})  # fmt: skip
    assert [o["output_ids"] for o in other_seed] != [o["output_ids"] for o in first]


def test_text_prompt_top_logprobs_and_n(http: httpx.Client) -> None:
    out = _generate(http, {
        "text": "hello world",
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
        "return_text_in_logprobs": True,
    })  # fmt: skip
    meta = out["meta_info"]
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert meta["input_top_logprobs"][0] is None
    assert all(len(alts) == 3 for alts in meta["input_top_logprobs"][1:])
    for entry, alts in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        assert isinstance(entry[2], str)  # return_text_in_logprobs
        assert alts[0][0] == entry[0] and alts[0][1] == entry[1]  # greedy: the top one
    fan = _generate(http, {
        "input_ids": _prompts(1)[0],
        "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "n": 3, "sampling_seed": 9},
        "rid": "fan",
    })  # fmt: skip
    assert [o["meta_info"]["id"] for o in fan] == ["fan_0", "fan_1", "fan_2"]
    alone = _generate(http, {
        "input_ids": _prompts(1)[0],
        "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": 10},
    })  # fmt: skip
    assert fan[1]["output_ids"] == alone["output_ids"]  # sample i uses sampling_seed + i


def test_cache_hit_then_flush_gives_the_same_bits(http: httpx.Client) -> None:
    body = {
        "input_ids": _prompts(1, 80)[0],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        "return_logprob": True,
    }
    assert http.post("/flush_cache").status_code == 200
    cold = _generate(http, body)
    warm = _generate(http, body)
    assert cold["meta_info"]["cached_tokens"] == 0
    assert warm["meta_info"]["cached_tokens"] > 0
    assert http.get("/flush_cache").status_code == 200  # SGLang takes GET too
    again = _generate(http, body)
    assert again["meta_info"]["cached_tokens"] == 0
    for out in (warm, again):
        assert out["output_ids"] == cold["output_ids"]
        assert (
            out["meta_info"]["output_token_logprobs"] == cold["meta_info"]["output_token_logprobs"]
        )


def test_streaming_repeats_the_output_so_far(http: httpx.Client) -> None:
    body = {
        "input_ids": _prompts(2),
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    whole = _generate(http, body)
    events: list[Any] = []
    with http.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    import json

    last: dict[int, Any] = {}
    for raw in events[:-1]:
        event = json.loads(raw)
        index = event.pop("index")
        if index in last:  # each event extends the previous one of its prompt
            previous = last[index]["output_ids"]
            assert event["output_ids"][: len(previous)] == previous
        last[index] = event
    for index, out in enumerate(whole):
        assert last[index]["output_ids"] == out["output_ids"]
        assert last[index]["text"] == out["text"]
        final, expected = last[index]["meta_info"], out["meta_info"]
        assert final["output_token_logprobs"] == expected["output_token_logprobs"]
        assert final["finish_reason"] == expected["finish_reason"]


def _in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def run() -> None:
        result["value"] = fn()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def _wait_running(server: ServerProcess, count: int) -> None:
    deadline = time.monotonic() + 120
    while server.engine_stats()["num_running"] < count:
        assert time.monotonic() < deadline, "requests never started"
        time.sleep(0.05)


def test_abort_request_returns_the_partial_output(
    server: ServerProcess, http: httpx.Client
) -> None:
    """An aborted request answers with what it generated so far (SGLang's partial rollouts):
    for each of its samples, a prefix, bit for bit, of what it would have generated."""
    prompt = _prompts(1, 30)[0]
    sampling = {"max_new_tokens": 450, "temperature": 0, "ignore_eos": True}
    full = _generate(http, {"input_ids": prompt, "sampling_params": {**sampling, "max_new_tokens": 60},
                            "return_logprob": True})  # fmt: skip
    # Eight samples keep the engine busy long enough for the abort to arrive mid-way.
    body = {"input_ids": prompt, "sampling_params": {**sampling, "n": 8}, "rid": "abort-me",
            "return_logprob": True}  # fmt: skip
    thread, result = _in_thread(lambda: http.post("/generate", json=body))
    _wait_running(server, 8)
    assert http.post("/abort_request", json={"rid": "abort-me"}).status_code == 200
    thread.join(120)
    outs = result["value"].json()
    assert [o["meta_info"]["id"] for o in outs] == [f"abort-me_{j}" for j in range(8)]
    for out in outs:
        meta = out["meta_info"]
        assert meta["finish_reason"]["type"] == "abort", meta["finish_reason"]
        n = meta["completion_tokens"]
        assert n < 450 and len(out["output_ids"]) == n
        k = min(n, 60)
        assert out["output_ids"][:k] == full["output_ids"][:k]
        assert meta["output_token_logprobs"][:k] == full["meta_info"]["output_token_logprobs"][:k]
    # abort_all finishes every request in flight, whichever route it came through.
    thread, result = _in_thread(lambda: http.post("/generate", json={**body, "rid": "x"}))
    _wait_running(server, 8)
    assert http.post("/abort_request", json={"abort_all": True}).status_code == 200
    thread.join(120)
    assert {o["meta_info"]["finish_reason"]["type"] for o in result["value"].json()} == {"abort"}
    server.wait_idle()


def test_info_and_health_routes(http: httpx.Client, server: ServerProcess) -> None:
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True and info["model_type"] == "qwen3"
    server_info = http.get("/get_server_info").json()
    assert server_info["max_total_num_tokens"] == 4096
    assert server_info["max_running_requests"] == 16
    assert http.get("/health_generate").status_code == 200


def test_weight_update_changes_outputs_then_restores_them(
    http: httpx.Client, folders: dict[str, Path], server: ServerProcess
) -> None:
    """A -> B -> A from disk: the outputs change, then return to A's bits exactly; a checkpoint
    of another shape is refused and the server keeps serving A."""
    body = {
        "input_ids": _prompts(3),
        "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }

    def run() -> list[Any]:
        outs = _generate(http, body)
        return [(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in outs]

    def update(path: Path, **extra: Any) -> httpx.Response:
        return http.post("/update_weights_from_disk", json={"model_path": str(path), **extra})

    on_a = run()
    version = http.get("/get_model_info").json()["weight_version"]
    resp = update(folders["b"], weight_version="b-1")
    assert resp.status_code == 200 and resp.json()["success"] is True, resp.text
    assert http.get("/get_model_info").json()["weight_version"] == "b-1" != version
    on_b = run()
    assert on_b != on_a
    resp = update(folders["a"])
    assert resp.json()["success"] is True
    assert run() == on_a
    bad = update(folders["other"])
    assert bad.status_code == 400 and bad.json()["success"] is False
    assert "architecture" in bad.json()["message"]
    missing = update(folders["a"] / "nope")
    assert missing.status_code == 400 and missing.json()["success"] is False
    # Whether a path exists on the server, or what it holds, is not for a client to learn.
    not_a_model = update(Path("/etc/passwd"))
    assert not_a_model.json()["message"] == missing.json()["message"]
    assert "passwd" not in not_a_model.text and "nope" not in missing.text
    assert run() == on_a
    server.wait_idle()


def test_weight_update_waits_for_requests_in_flight(
    http: httpx.Client, folders: dict[str, Path], server: ServerProcess
) -> None:
    """A request running when the update arrives finishes on the old weights; one sent
    during the update waits and runs on the new ones."""
    prompt = _prompts(1, 25)[0]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 80, "temperature": 0,
                                                     "ignore_eos": True}}  # fmt: skip
    on_a = _generate(http, body)["output_ids"]
    thread, result = _in_thread(lambda: http.post("/generate", json=body))
    _wait_running(server, 1)
    resp = http.post("/update_weights_from_disk", json={"model_path": str(folders["b"])})
    assert resp.json()["success"] is True
    thread.join(120)
    assert result["value"].json()["output_ids"] == on_a  # finished on A
    assert _generate(http, body)["output_ids"] != on_a  # B now
    assert http.post("/update_weights_from_disk", json={"model_path": str(folders["a"])}).json()[
        "success"
    ]
    assert _generate(http, body)["output_ids"] == on_a


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/generate", {"text": "x", "input_ids": [1]}, "input_ids"),
        ("/generate", {"sampling_params": {}}, "text"),
        ("/generate", {"input_ids": [VOCAB + 5]}, "input_ids"),
        ("/generate", {"input_ids": [1], "sampling_params": {"regex": "a("}}, "sampling_params.regex"),
        ("/generate", {"input_ids": [1], "sampling_params": {"logit_bias": {str(VOCAB): 0.5}}},
         "sampling_params.logit_bias"),
        ("/generate", {"input_ids": [1], "bootstrap_room": 7}, "bootstrap_room"),
        ("/generate", {"input_ids": [1], "sampling_params": {"temprature": 1}},
         "sampling_params.temprature"),
        ("/generate", {"input_ids": [1], "image_data": "x.png"}, "image_data"),
        ("/generate", {"input_ids": [1], "no_such_field": 1}, None),
        ("/generate", {"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
        ("/generate", {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2},
         "logprob_start_len"),
        ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 600}},
         "sampling_params.max_new_tokens"),
        ("/generate", {"input_ids": [1], "return_logprob": True, "top_logprobs_num": 21},
         "top_logprobs_num"),
        ("/generate", {"input_ids": [[1], [2]], "rid": ["same", "same"]}, "rid"),
        ("/generate", {"input_ids": [1], "sampling_params": {"temperature": "1"}}, None),
        ("/update_weights_from_disk", {"model_path": "x", "flush_cache": False}, "flush_cache"),
        ("/update_weights_from_disk", {"model_path": "x", "load_format": "pt"}, "load_format"),
        ("/update_weights_from_disk", {}, None),
        ("/abort_request", {"rid": 5}, None),
    ],
)  # fmt: skip
def test_bad_input_is_a_4xx_naming_the_field(
    http: httpx.Client, path: str, body: dict[str, Any], param: str | None
) -> None:
    resp = http.post(path, json=body)
    assert 400 <= resp.status_code < 500, resp.text
    error = resp.json()["error"]
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_kv_pool_wholly_free_afterwards(server: ServerProcess) -> None:
    stats = server.wait_idle()
    assert stats["kv_in_use"] == 0
