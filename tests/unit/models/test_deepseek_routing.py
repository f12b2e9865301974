"""DeepSeek routing (`lockstep.ops.moe`, steps 2'-3'): the deterministic CPU routing agrees
with transformers' router formulas (sigmoid with a correction bias inside the best groups by
their top-2 sums; softmax with groups by their max), breaks ties toward the lower expert and
the lower group, and gives a token the same experts and weight bits beside any batch-mates."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lockstep.ops.cpu_deterministic import CpuDeterministicOps
from lockstep.ops.moe import DeepseekRouting, MoeLayer, stock_route_deepseek

E = 16
V3 = DeepseekRouting("sigmoid", None, 4, 2, "top2_sum", 2.5)
V2_GROUPED = DeepseekRouting("softmax", None, 4, 2, "max", 1.5)


@pytest.fixture(scope="module")
def det() -> CpuDeterministicOps:
    return CpuDeterministicOps()


def _layer(routing: DeepseekRouting, top_k: int = 3, renormalize: bool = True) -> MoeLayer:
    empty = torch.zeros(E, 1, 16)
    return MoeLayer(torch.zeros(E, 16), empty, empty, top_k, renormalize, deepseek=routing)


@pytest.mark.parametrize("routing", [V3, V2_GROUPED])
def test_agrees_with_transformers_router(det, routing: DeepseekRouting) -> None:
    torch.manual_seed(0)
    bias = 0.1 * torch.randn(E) if routing.scoring == "sigmoid" else None
    routing = dataclasses.replace(routing, correction_bias=bias)
    renormalize = routing.scoring == "sigmoid"
    layer = _layer(routing, renormalize=renormalize)
    logits = torch.randn(200, E)
    ids, weights = det.route_deepseek(logits, layer)
    want_ids, want_weights = stock_route_deepseek(logits, 3, renormalize, routing)
    order = want_ids.argsort(dim=1)
    assert torch.equal(ids.sort(dim=1).values, want_ids.gather(1, order))
    got = weights.gather(1, ids.argsort(dim=1))
    assert (got - want_weights.gather(1, order)).abs().max() < 1e-6
    if bias is None:  # rank order is the scores' order (with a bias: the biased scores')
        assert (weights[:, :-1] >= weights[:, 1:]).all()


def test_ties_go_to_the_lower_expert_and_group(det) -> None:
    """Equal logits everywhere: groups 0 and 1 are kept, experts 0, 1, 2 chosen."""
    ids, weights = det.route_deepseek(torch.zeros(2, E), _layer(V3))
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    assert torch.allclose(weights, torch.full((2, 3), 2.5 / 3))


def test_a_token_keeps_its_bits_beside_any_batch_mates(det) -> None:
    torch.manual_seed(1)
    logits = torch.randn(300, E) * 3
    layer = _layer(V3)
    ids, weights = det.route_deepseek(logits, layer)
    for row in (0, 1, 17, 299):
        alone = det.route_deepseek(logits[row : row + 1].clone(), layer)
        assert torch.equal(alone.experts[0], ids[row])
        assert torch.equal(alone.weights[0], weights[row])
