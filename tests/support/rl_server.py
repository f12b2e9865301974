"""What the two-process RL tests share (tests/server/test_server_rl_loop.py and
test_server_rl_routing.py): this process is the trainer, a `lockstep serve` process the
rollout engine. The server's arguments, the gloo group that carries weights between the two,
seeded GRPO rollouts over `/generate`, the toy reward's group-normalized advantages, the
rollout/training logprob comparison, and a weight push between a pause and a continue.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import torch

from lockstep.training.weight_sync import (
    join_weight_group,
    leave_weight_group,
    push_weights,
    tensor_update_request,
)

# A small CPU server that checks its cache after every step.
SERVER_ARGS = ["--device", "cpu", "--dtype", "float32", "--kv-tokens", "4096",
               "--max-batch-tokens", "256", "--chunk-size", "64", "--max-running", "32",
               "--max-model-len", "256", "--debug-checks"]  # fmt: skip


def weight_group(http: httpx.Client, name: str) -> Iterator[Any]:
    """A gloo group of two ranks, this process (0) and the server (1), for a module fixture
    to `yield from`: joined on both sides, destroyed on the server and left here after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, "group_name": name, "backend": "gloo"}  # fmt: skip
    answer: dict[str, Any] = {}
    # The server joins inside its request while this process joins here: both at once.
    thread = threading.Thread(
        target=lambda: answer.update(r=http.post("/init_weights_update_group", json=body))
    )
    thread.start()
    pg = join_weight_group("127.0.0.1", port, 0, 2, name, "gloo", timeout_s=60)
    thread.join(60)
    assert answer["r"].status_code == 200, answer["r"].text
    yield pg
    destroyed = http.post("/destroy_weights_update_group", json={"group_name": name})
    assert destroyed.status_code == 200, destroyed.text
    leave_weight_group(pg)


def rollouts(
    http: httpx.Client, prompts: list[list[int]], tokens: int, step: int, **fields: Any
) -> list[dict[str, Any]]:
    """One `/generate` call sampling `tokens` tokens (temperature 1, EOS ignored) for each
    prompt, seeded by the step and the prompt's index, with `return_logprob` and `fields`."""
    body = {
        "input_ids": prompts,
        "sampling_params": [{"max_new_tokens": tokens, "temperature": 1.0, "ignore_eos": True,
                             "sampling_seed": 1000 * step + j} for j in range(len(prompts))],
        "return_logprob": True,
        **fields,
    }  # fmt: skip
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def served_logprobs(outs: list[dict[str, Any]]) -> list[torch.Tensor]:
    """Each rollout's sampled tokens' logprobs as the server computed them."""
    return [torch.tensor([e[0] for e in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def grpo_advantages(outs: list[dict[str, Any]], groups: int, tokens: int) -> torch.Tensor:
    """The toy reward (the share of even token ids), normalized within each of `groups`
    consecutive groups of rollouts (GRPO)."""
    rewards = torch.tensor([sum(t % 2 == 0 for t in o["output_ids"]) / tokens for o in outs])
    grouped = rewards.view(groups, -1)
    std = grouped.std(dim=1, keepdim=True).clamp(min=1e-6)
    return ((grouped - grouped.mean(dim=1, keepdim=True)) / std).reshape(-1)


def assert_on_policy(rollout: torch.Tensor, train: torch.Tensor, step: int) -> torch.Tensor:
    """The k3 KL between the rollout's and the trainer's logprobs of the same tokens is
    exactly 0 and every importance ratio exactly 1; returns the ratios (with the trainer's
    gradient) for the loss."""
    d = (rollout - train.detach()).double()
    k3 = d.exp() - d - 1.0
    ratio = (train - rollout).exp()
    assert torch.equal(k3, torch.zeros_like(k3)), f"step {step}: k3 {k3}"
    assert torch.equal(ratio.detach(), torch.ones_like(ratio)), f"step {step}: {ratio}"
    return ratio


def push(
    http: httpx.Client, weights: Any, group: Any, transport: str, version: str, **fields: Any
) -> dict[str, Any]:
    """`weights` (a trainer or (name, tensor) pairs) to the server under `version`: over the
    gloo group ("distributed") or as safetensors bytes ("tensor", a colocated trainer). A
    refused update raises `RuntimeError` with the server's message."""
    if transport == "distributed":
        base_url = str(http.base_url).rstrip("/")
        return push_weights(base_url, weights, group, weight_version=version, timeout_s=60,
                            **fields)  # fmt: skip
    response = http.post("/update_weights_from_tensor",
                         json=tensor_update_request(weights, version))  # fmt: skip
    if response.status_code != 200:
        raise RuntimeError(response.json()["message"])
    return response.json()


def push_between_pause_and_continue(
    http: httpx.Client, weights: Any, group: Any, transport: str, version: str
) -> None:
    """Pause generation (`retract`), `push` the weights, check the served version, continue."""
    paused = http.post("/pause_generation", json={"mode": "retract"})
    assert paused.status_code == 200, paused.text
    assert push(http, weights, group, transport, version)["weight_version"] == version
    assert http.post("/continue_generation").status_code == 200
