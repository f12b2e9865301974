"""Routing replay in a real two-process RL loop on the CPU, as slime drives SGLang: this
process is the trainer (`lockstep.training`), a `lockstep serve --enable-return-routed-experts`
process the rollout engine, both on a tiny Qwen3-MoE folder written by transformers (4 layers,
layer 2 dense). Each of 5 GRPO steps samples over HTTP `/generate` with `return_logprob` and
`return_routed_experts`, decodes `meta_info.routed_experts` (base64 int32
[prompt + output - 1, num_hidden_layers, top_k]) and checks it equals the experts the trainer's
own forward routes every position to, and that every importance ratio is exactly 1; then an
optimizer step, a pause (`retract`), the new weights over a gloo group
(`/update_weights_from_distributed`) or as tensors (`/update_weights_from_tensor`) and
`continue_generation`; the k3 KL is exactly 0 and `weight_version` follows each update.

Control: after each optimizer step, before the broadcast, the trainer's routing is compared
with the served one again; over the 5 steps it must differ somewhere (the comparison sees the
weights' routing, so the equality above is not vacuous)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from test_server import ServerProcess

pytest.importorskip("transformers")
from lockstep.server.routed_experts_field import decode  # noqa: E402
from lockstep.training import LockstepForCausalLM  # noqa: E402
from tests.support.rl_server import (  # noqa: E402
    SERVER_ARGS,
    assert_on_policy,
    grpo_advantages,
    push_between_pause_and_continue,
    rollouts,
    served_logprobs,
    weight_group,
)
from tests.support.tiny_hf import save_tiny  # noqa: E402

ARGS = [*SERVER_ARGS, "--enable-return-routed-experts"]
PROMPTS = [[(13 * j + 5 * i) % 250 + 5 for j in range(5 + 4 * i)] for i in range(3)]
GROUP = 4  # samples per prompt
TOKENS = 8
LAYERS, TOP_K = 4, 2


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rl_routing") / "qwen3_moe"
    save_tiny("qwen3_moe", path)
    return path


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(["--model", str(folder), *ARGS]).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def group(http: httpx.Client) -> Iterator[Any]:
    """A gloo group of two ranks: this process (0) and the server (1)."""
    yield from weight_group(http, "routing")


def _rollouts(http: httpx.Client, step: int) -> list[dict[str, Any]]:
    prompts = [p for p in PROMPTS for _ in range(GROUP)]
    return rollouts(http, prompts, TOKENS, step, return_routed_experts=True)


def _served_routing(outs: list[dict[str, Any]]) -> list[np.ndarray]:
    return [decode(o["meta_info"]["routed_experts"], LAYERS, TOP_K) for o in outs]


def _trainer_forward(trainer: LockstepForCausalLM, outs: list[dict[str, Any]], grad: bool) -> Any:
    prompts = [p for p in PROMPTS for _ in range(GROUP)]
    sequences = [p + o["output_ids"] for p, o in zip(prompts, outs, strict=True)]
    with torch.set_grad_enabled(grad):
        return trainer(sequences, return_routed_experts=True)


def _same_routing(trainer_out: Any, served: list[np.ndarray]) -> list[bool]:
    mine = trainer_out.routed_experts_per_sequence()
    return [np.array_equal(m.numpy(), s) for m, s in zip(mine, served, strict=True)]


@pytest.mark.parametrize("transport", ["distributed", "tensor"])
def test_grpo_routing_replay_equals_the_trainers_routing_at_every_step(
    server: ServerProcess, http: httpx.Client, group: Any, folder: Path, transport: str
) -> None:
    """Weights through the trainer's gloo group, or as safetensors bytes
    (`/update_weights_from_tensor`, a colocated trainer); each run starts by sending its fresh
    trainer's weights, so the server serves them whatever ran before."""
    trainer = LockstepForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    push_between_pause_and_continue(http, trainer, group, transport, f"{transport}-0")
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=5e-2)
    prompts = [p for p in PROMPTS for _ in range(GROUP)]
    moved = []
    for step in range(1, 6):
        outs = _rollouts(http, step)
        assert {o["meta_info"]["weight_version"] for o in outs} == {f"{transport}-{step - 1}"}
        served = _served_routing(outs)
        for p, routed in zip(prompts, served, strict=True):
            assert routed.shape == (len(p) + TOKENS - 1, LAYERS, TOP_K)
            assert not routed[:, 2].any(), "the dense layer's rows must be zero"
        out = _trainer_forward(trainer, outs, grad=True)
        assert all(_same_routing(out, served)), f"step {step}: routing differs from the trainer's"
        per = out.per_sequence()
        advantages = grpo_advantages(outs, len(PROMPTS), TOKENS)
        loss = torch.zeros(())
        for p, rollout, lps, advantage in zip(prompts, served_logprobs(outs), per, advantages,
                                              strict=True):  # fmt: skip
            ratio = assert_on_policy(rollout, lps[len(p) - 1 :], step)
            loss = loss - (ratio * advantage).sum() / (len(outs) * TOKENS)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        moved.append(not all(_same_routing(_trainer_forward(trainer, outs, False), served)))
        push_between_pause_and_continue(http, trainer, group, transport, f"{transport}-{step}")
    assert any(moved), "no optimizer step changed any routing: the comparison is blind"
    server.wait_idle()


def test_the_field_per_prompt_and_for_scoring(http: httpx.Client) -> None:
    """One value per prompt (a prompt that does not ask gets no field), and a scoring call
    (max_new_tokens 0) returns the prompt's rows only: len(prompt) - 1 of them."""
    body = {"input_ids": PROMPTS[:2], "return_routed_experts": [True, False],
            "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}}  # fmt: skip
    first, second = http.post("/generate", json=body).json()
    assert decode(first["meta_info"]["routed_experts"], LAYERS, TOP_K).shape == (
        len(PROMPTS[0]) + 2, LAYERS, TOP_K,
    )  # fmt: skip
    assert "routed_experts" not in second["meta_info"]
    scoring = {"input_ids": PROMPTS[1], "return_routed_experts": True,
               "sampling_params": {"max_new_tokens": 0}}  # fmt: skip
    out = http.post("/generate", json=scoring).json()
    routed = decode(out["meta_info"]["routed_experts"], LAYERS, TOP_K)
    assert routed.shape == (len(PROMPTS[1]) - 1, LAYERS, TOP_K) and out["output_ids"] == []
