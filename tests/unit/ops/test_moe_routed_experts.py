"""`Ops.moe(x, layer, routed_experts)` (lockstep/ops/moe.py, "Routed expert ids"): the buffer
receives each token's experts in rank order, the top_k of the router logits computed as the
op computes them (ties toward the lower id), and writing it changes no bit of the output.
Every CPU backend; the Triton op is checked on the GPU (tests/gpu/test_gpu_rl.py)."""

from __future__ import annotations

import pytest
import torch

from lockstep.ops import get_ops
from lockstep.ops.moe import DeepseekRouting, MoeLayer, prepare_expert_weights

E, H, INTER, K = 8, 48, 40, 2


def _layer(ops, seed: int, deepseek: DeepseekRouting | None = None) -> MoeLayer:
    g = torch.Generator().manual_seed(seed)
    prepare = ops.prepare_linear_weight
    router = prepare(torch.randn(E, H, generator=g) / H**0.5)
    gate_up = prepare_expert_weights(prepare, torch.randn(E, 2 * INTER, H, generator=g) / H**0.5)
    down = prepare_expert_weights(prepare, torch.randn(E, H, INTER, generator=g) / INTER**0.5)
    return MoeLayer(router, gate_up, down, K, True, deepseek=deepseek)


def _x(rows: int, seed: int = 7) -> torch.Tensor:
    return torch.randn(rows, H, generator=torch.Generator().manual_seed(seed))


def _top_k_of_logits(ops, mode: str, x: torch.Tensor, layer: MoeLayer) -> torch.Tensor:
    """The top_k of the router logits as the backend computes them: its own linear, then the
    contract's order (stable descending sort: ties toward the lower id); the reference
    (stock torch) backend ranks by torch.topk, as transformers does."""
    x = x.double() if mode == "float64" else x
    logits = ops.linear(x, layer.router).float()
    if mode == "reference":
        return torch.topk(logits.softmax(-1), K, dim=-1).indices
    return torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :K]


@pytest.mark.parametrize("mode", ["deterministic", "reference", "float64"])
def test_the_buffer_holds_the_top_k_of_the_router_logits_and_the_output_is_unchanged(
    mode: str,
) -> None:
    ops = get_ops("cpu", mode)
    layer = _layer(ops, 1)
    x = _x(37)
    plain = ops.moe(x, layer)
    ids = torch.full((37, K), -1, dtype=torch.int16)
    with_ids = ops.moe(x, layer, ids)
    assert torch.equal(with_ids, plain), "writing the routed experts changed the output"
    want = _top_k_of_logits(ops, mode, x, layer)
    assert torch.equal(ids.long(), want)
    # Control: the comparison sees routing; another router's top_k differs.
    other = _top_k_of_logits(ops, mode, x, _layer(ops, 2))
    assert not torch.equal(ids.long(), other)
    # And the output comparison sees the routing too: another router, other bits.
    assert not torch.equal(ops.moe(x, _layer(ops, 2)), plain)


def test_deepseek_routing_writes_the_experts_it_chose() -> None:
    """Sigmoid scores, a correction bias and expert groups (DeepSeek-V3): the buffer holds
    the backend's `route_deepseek` experts, the output unchanged; the control is the same
    layer without the bias, which chooses otherwise."""
    ops = get_ops("cpu", "deterministic")
    bias = torch.linspace(-0.3, 0.3, E)
    routing = DeepseekRouting("sigmoid", bias, 2, 1, "max", 2.5)
    layer = _layer(ops, 3, routing)
    x = _x(29, seed=4)
    ids = torch.empty((29, K), dtype=torch.int32)
    out = ops.moe(x, layer, ids)
    assert torch.equal(out, ops.moe(x, layer))
    logits = ops.linear(x, layer.router)
    assert torch.equal(ids.long(), ops.route_deepseek(logits, layer).experts)
    unbiased = _layer(ops, 3, DeepseekRouting("sigmoid", None, 2, 1, "max", 2.5))
    assert not torch.equal(ids.long(), ops.route_deepseek(logits, unbiased).experts)


def test_a_tokens_ids_do_not_depend_on_its_batch_mates() -> None:
    ops = get_ops("cpu", "deterministic")
    layer = _layer(ops, 5)
    x = _x(23, seed=9)
    together = torch.empty((23, K), dtype=torch.int16)
    ops.moe(x, layer, together)
    for i in range(23):
        alone = torch.empty((1, K), dtype=torch.int16)
        ops.moe(x[i : i + 1], layer, alone)
        assert torch.equal(alone[0], together[i])


def test_a_buffer_of_the_wrong_shape_is_refused() -> None:
    ops = get_ops("cpu", "deterministic")
    with pytest.raises(ValueError, match="expected \\(5, 2\\)"):
        ops.moe(_x(5), _layer(ops, 1), torch.empty((5, 3), dtype=torch.int16))
