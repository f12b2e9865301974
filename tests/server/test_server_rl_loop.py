"""A real two-process RL loop on the CPU, as slime and AReaL drive SGLang: this process is the
trainer (`lockstep.training`), a `lockstep serve` process the rollout engine. Each of 5 GRPO
steps samples over HTTP `/generate` (seeded, `return_logprob`), recomputes the sampled
tokens' logprobs in the trainer (k3 KL exactly 0, every importance ratio exactly 1), takes an
optimizer step, then pauses generation (`retract`), broadcasts the new weights over a gloo
group (`/init_weights_update_group` once, `/update_weights_from_distributed` each step) and
continues; `weight_version` grows with each step. Controls: after the optimizer step and
before the broadcast, the trainer's logprobs differ from the served ones.

Bad input on the same group: a wrong shape or dtype is refused before any weight changes and
the server keeps serving the old weights bit for bit; an update sent while requests run
follows SGLang's `abort_all_requests`."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from test_server import ServerProcess

pytest.importorskip("transformers")
from lockstep.training import LockstepForCausalLM  # noqa: E402
from lockstep.training.weight_sync import named_weights  # noqa: E402
from tests.support.rl_server import (  # noqa: E402
    SERVER_ARGS,
    assert_on_policy,
    grpo_advantages,
    push,
    rollouts,
    served_logprobs,
    weight_group,
)
from tests.support.tiny_hf import save_tiny  # noqa: E402

PROMPTS = [[(11 * j + 3 * i) % 280 + 5 for j in range(6 + 3 * i)] for i in range(3)]
GROUP = 4  # samples per prompt
TOKENS = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rl_loop") / "qwen3"
    save_tiny("qwen3", path)
    return path


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(["--model", str(folder), *SERVER_ARGS]).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def trainer(folder: Path) -> LockstepForCausalLM:
    return LockstepForCausalLM.from_pretrained(str(folder), dtype=torch.float32)


@pytest.fixture(scope="module")
def group(http: httpx.Client) -> Iterator[Any]:
    """A gloo group of two ranks: this process (0) and the server (1)."""
    yield from weight_group(http, "rl-test")


def _rollouts(http: httpx.Client, step: int) -> list[dict[str, Any]]:
    return rollouts(http, [p for p in PROMPTS for _ in range(GROUP)], TOKENS, step)


def _trainer_logprobs(
    trainer: LockstepForCausalLM, outs: list[dict[str, Any]], grad: bool = False
) -> list[torch.Tensor]:
    prompts = [p for p in PROMPTS for _ in range(GROUP)]
    with torch.set_grad_enabled(grad):
        per = trainer([p + o["output_ids"] for p, o in zip(prompts, outs, strict=True)])
    return [lps[len(p) - 1 :] for p, lps in zip(prompts, per.per_sequence(), strict=True)]


@pytest.mark.parametrize("transport", ["distributed", "tensor"])
def test_grpo_over_http_with_weights_from_the_trainer(
    server: ServerProcess, http: httpx.Client, trainer: LockstepForCausalLM, group: Any,
    transport: str,
) -> None:  # fmt: skip
    """Weights through the trainer's gloo group, or as safetensors bytes
    (`/update_weights_from_tensor`, a colocated trainer)."""
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=3e-2)
    start = http.get("/model_info").json()["weight_version"]
    versions = []
    for step in range(1, 6):
        outs = _rollouts(http, step)
        versions.append(outs[0]["meta_info"]["weight_version"])
        assert {o["meta_info"]["weight_version"] for o in outs} == {versions[-1]}
        served = served_logprobs(outs)
        training = _trainer_logprobs(trainer, outs, grad=True)
        advantages = grpo_advantages(outs, len(PROMPTS), TOKENS)
        loss = torch.zeros(())
        for rollout, train, advantage in zip(served, training, advantages, strict=True):
            ratio = assert_on_policy(rollout, train, step)
            loss = loss - (ratio * advantage).sum() / (len(served) * TOKENS)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        # The control: the trained weights give other logprobs than the served ones.
        moved = _trainer_logprobs(trainer, outs)
        assert any(not torch.equal(a, b) for a, b in zip(moved, served, strict=True))
        paused = http.post("/pause_generation", json={"mode": "retract"})
        assert paused.status_code == 200, paused.text
        version = f"{transport}-{step}"
        assert push(http, trainer, group, transport, version)["weight_version"] == version
        assert http.post("/continue_generation").status_code == 200
    assert versions == [start] + [f"{transport}-{i}" for i in range(1, 5)]
    last = f"{transport}-5"
    assert _rollouts(http, 6)[0]["meta_info"]["weight_version"] == last
    # The OpenAI routes carry it too, in SGLang's `metadata`, in the body and each chunk.
    body = {"model": server.model, "prompt": PROMPTS[0], "max_tokens": 2}
    completion = http.post("/v1/completions", json=body).json()
    assert completion["metadata"] == {"weight_version": last}
    chat = {"model": server.model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, "stream": True}  # fmt: skip
    with http.stream("POST", "/v1/chat/completions", json=chat) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines()
                  if line.startswith("data: {")]  # fmt: skip
    assert chunks and all(c["metadata"] == {"weight_version": last} for c in chunks)
    server.wait_idle()


def _probe(http: httpx.Client) -> Any:
    body = {"input_ids": PROMPTS[2], "return_logprob": True, "sampling_params":
            {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 7, "ignore_eos": True}}  # fmt: skip
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    out = response.json()
    return out["output_ids"], out["meta_info"]["output_token_logprobs"]


@pytest.mark.parametrize("transport", ["distributed", "tensor"])
@pytest.mark.parametrize("fault", ["shape", "dtype"])
def test_a_bad_tensor_is_refused_and_the_old_weights_serve(
    http: httpx.Client, trainer: LockstepForCausalLM, group: Any, fault: str, transport: str
) -> None:
    before = _probe(http)
    version = http.get("/model_info").json()["weight_version"]
    state = dict(named_weights(trainer))
    changed = {name: t + 0.5 for name, t in state.items()}  # would change every output
    name = "model.norm.weight"
    if fault == "shape":
        changed[name] = torch.cat([changed[name], torch.ones(1)])
    else:
        changed[name] = changed[name].double()
    with pytest.raises(RuntimeError, match="shape" if fault == "shape" else "float64"):
        push(http, changed, group, transport, "bad")
    assert http.get("/model_info").json()["weight_version"] == version
    assert _probe(http) == before
    # (The group is still in step:) a good set goes through and changes the output (control).
    push(http, {n: t + 0.5 for n, t in state.items()}, group, transport, "shifted")
    assert _probe(http) != before
    push(http, state, group, transport, version)
    assert _probe(http) == before


def test_sglang_payloads_other_than_safetensors_are_refused(http: httpx.Client) -> None:
    for load_format in (None, "direct", "flattened_bucket"):
        body = {"serialized_named_tensors": ["gASVAAAAAAAAAAAu"], "load_format": load_format}
        response = http.post("/update_weights_from_tensor", json=body)
        assert response.status_code == 400, response.text
        assert "pickled" in response.json()["error"]["message"]
    body = {"serialized_named_tensors": ["bm90IHNhZmV0ZW5zb3Jz"], "load_format": "safetensors"}
    response = http.post("/update_weights_from_tensor", json=body)
    assert response.status_code == 400 and "safetensors" in response.json()["message"]


@pytest.mark.parametrize("abort_all", [True, False])
def test_an_update_while_requests_run_follows_abort_all_requests(
    server: ServerProcess, http: httpx.Client, trainer: LockstepForCausalLM, group: Any,
    abort_all: bool,
) -> None:  # fmt: skip
    version = http.get("/model_info").json()["weight_version"]
    body = {"input_ids": [PROMPTS[0]] * 8, "sampling_params": {"max_new_tokens": 200,
            "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True}}  # fmt: skip
    result: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: result.update(r=http.post("/generate", json=body)))
    before = server.engine_stats()["generated_tokens_total"]
    runner.start()
    while server.engine_stats()["generated_tokens_total"] - before < 8:
        time.sleep(0.01)
    push(http, trainer, group, "distributed", version, abort_all_requests=abort_all)
    runner.join(60)
    outs = result["r"].json()
    reasons = {o["meta_info"]["finish_reason"]["type"] for o in outs}
    # abort_all: they end at once with what they have; else they finish on the old weights.
    assert reasons == ({"abort"} if abort_all else {"length"})
    if abort_all:
        assert all(0 < len(o["output_ids"]) < 200 for o in outs)
    server.wait_idle()


def test_group_requests_refused_in_one_line(http: httpx.Client, group: Any) -> None:
    """On a CPU engine with the test's group joined: nccl, the same group again, a rank that
    is the trainer's, and a group never joined are each refused, naming the field."""
    base = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
    cases = [
        ({**base, "backend": "nccl", "group_name": "g2"}, "backend='nccl'"),
        ({**base, "backend": "gloo", "group_name": "rl-test"}, "already joined"),
        ({**base, "backend": "gloo", "group_name": "g2", "rank_offset": 2}, "rank_offset=2"),
    ]
    for body, said in cases:
        response = http.post("/init_weights_update_group", json=body)
        assert response.status_code == 400 and said in response.json()["message"], response.text
    for path, body in [
        ("/destroy_weights_update_group", {"group_name": "never"}),
        ("/update_weights_from_distributed",
         {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "never"}),
    ]:  # fmt: skip
        response = http.post(path, json=body)
        assert response.status_code == 400 and "'never'" in response.json()["message"]
    mismatched = {"names": ["x", "y"], "dtypes": ["float32"], "shapes": [[1], [2]]}
    response = http.post("/update_weights_from_distributed", json=mismatched)
    assert response.status_code == 400 and "one of each" in response.json()["error"]["message"]


def test_routed_experts_of_a_dense_model_are_refused(http: httpx.Client) -> None:
    """A dense model has no routing to return: a 400 that says so (the MoE loop with routing
    replay is tests/server/test_server_rl_routing.py)."""
    body = {"input_ids": PROMPTS[0], "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 2}}  # fmt: skip
    response = http.post("/generate", json=body)
    assert response.status_code == 400, response.text
    assert "not a mixture-of-experts model" in response.text
    body["return_routed_experts"] = False
    assert http.post("/generate", json=body).status_code == 200
