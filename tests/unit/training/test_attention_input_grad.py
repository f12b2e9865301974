"""The fused backward of the attention's input preparation (lockstep/ops/triton/
attention_input_grad.py), under Triton's interpreter on CPU tensors (tests/conftest.py sets it
where there is no CUDA): d q|k|v and the head norms' weight gradients equal float64 autograd
of the plain formula (per-head RMSNorm, neox RoPE on the first `rot` dims, v as it is) to
float32 rounding, with and without head norms and with partial rotary dims; bfloat16 rows get
a bfloat16 gradient within bfloat16's rounding. Controls: the rotation's sign flipped (sin
negated), another row's positions, the q heads' gradients swapped in pairs."""

from __future__ import annotations

import pytest
import torch

from lockstep.ops.triton.attention_input_grad import ROWS, attention_input_backward
from tests.support.grad_checks import graph_names, relative

T, HQ, HKV, D = 2 * ROWS + 3, 4, 2, 16  # rows past a program's ROWS, grouped heads
EPS = 1e-6


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox RoPE of x [T, H, D] on its first 2 * cos.shape[-1] dims (cos, sin [T, rot / 2])."""
    rot = 2 * cos.shape[-1]
    a, b = x[..., : rot // 2], x[..., rot // 2 : rot]
    c, s = cos[:, None], sin[:, None]
    return torch.cat([a * c - b * s, b * c + a * s, x[..., rot:]], dim=-1)


def _autograd(qkv, qn, kn, positions, cos, sin, dq, dk, dv):  # type: ignore[no-untyped-def]
    leaves = [qkv.double().requires_grad_()]
    if qn is not None:
        leaves += [qn.double().requires_grad_(), kn.double().requires_grad_()]
    x = leaves[0]
    q, k, v = x.split([HQ * D, HKV * D, HKV * D], dim=1)
    q, k = q.reshape(T, HQ, D), k.reshape(T, HKV, D)
    if qn is not None:
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + EPS) * leaves[1]
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + EPS) * leaves[2]
    c, s = cos.double()[positions], sin.double()[positions]
    outs = [_rope(q, c, s), _rope(k, c, s), v.reshape(T, HKV, D)]
    return torch.autograd.grad(outs, leaves, [dq.double(), dk.double(), dv.double()])


def _inputs(seed: int, rot: int, norms: bool):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (HQ + 2 * HKV) * D, generator=gen) * 2
    qn = torch.rand(D, generator=gen) + 0.5 if norms else None
    kn = torch.rand(D, generator=gen) + 0.5 if norms else None
    positions = torch.randint(0, 64, (T,), generator=gen)
    angles = torch.rand(64, rot // 2, generator=gen) * 6.28
    dq = torch.randn(T, HQ, D, generator=gen)
    dk, dv = torch.randn(T, HKV, D, generator=gen), torch.randn(T, HKV, D, generator=gen)
    return qkv, qn, kn, positions, angles.cos(), angles.sin(), dq, dk, dv


@pytest.mark.parametrize(("rot", "norms"), [(D, True), (D, False), (D // 4, True)],
                         ids=["full_rotary_norms", "no_norms", "partial_rotary"])  # fmt: skip
def test_attention_input_backward_is_autograd(rot: int, norms: bool) -> None:
    qkv, qn, kn, positions, cos, sin, dq, dk, dv = _inputs(0, rot, norms)
    expected = _autograd(qkv, qn, kn, positions, cos, sin, dq, dk, dv)
    dx, dqn, dkn = attention_input_backward(qkv, dq, dk, dv, qn, kn, EPS, positions, cos, sin)
    assert dx.dtype == torch.float32 and relative(dx, expected[0]) < 1e-6
    if norms:
        assert dqn is not None and dkn is not None
        assert relative(dqn, expected[1]) < 1e-6 and relative(dkn, expected[2]) < 1e-6
    else:
        assert dqn is None and dkn is None
    bf = [t.bfloat16() for t in (qkv, dq, dk, dv)]
    dxb, dqnb, _ = attention_input_backward(bf[0], *bf[1:], qn, kn, EPS, positions, cos, sin)
    expected_bf = _autograd(bf[0], qn, kn, positions, cos, sin, *bf[1:])
    assert dxb.dtype == torch.bfloat16 and relative(dxb, expected_bf[0]) < 1e-2
    if norms:
        assert dqnb is not None and relative(dqnb, expected_bf[1]) < 1e-5
    # The controls: the rotation turned the other way, another row's positions, the q heads'
    # gradients swapped in pairs: each moves d q|k|v past the bound.
    for wrong in (
        attention_input_backward(qkv, dq, dk, dv, qn, kn, EPS, positions, cos, -sin)[0],
        attention_input_backward(qkv, dq, dk, dv, qn, kn, EPS, positions.roll(1), cos, sin)[0],
        attention_input_backward(
            qkv, dq[:, [1, 0, 3, 2]], dk, dv, qn, kn, EPS, positions, cos, sin
        )[0],  # fmt: skip
    ):
        assert relative(wrong, expected[0]) > 1e-2


# Qwen3: q/k head norms, full rotary; Qwen3.5: partial rotary, gated attention, beside Gated
# DeltaNet layers.
@pytest.mark.parametrize("source", ["random:tiny-qwen3", "random:tiny-qwen3.5"])
def test_the_module_with_the_fused_backward_gives_the_twins_gradients(
    source: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lockstep.training import LockstepForCausalLM, functions

    model = LockstepForCausalLM.from_pretrained(source)
    sequences = [[5, 9, 30, 7, 11, 2, 8], [1, 2, 3], [40, 17, 3, 3]]

    def grads(seqs: list[list[int]]) -> tuple[dict[str, torch.Tensor], set[str], torch.Tensor]:
        model.zero_grad()
        out = model(seqs)
        (-out.logprobs.sum()).backward()
        named = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return named, graph_names(out.logprobs), out.logprobs

    twins, twin_nodes, twin_logprobs = grads(sequences)
    monkeypatch.setattr(functions, "FUSED_ROW_GRAD_DEVICES", ("cuda", "cpu"))
    fused, fused_nodes, fused_logprobs = grads(sequences)
    assert torch.equal(fused_logprobs, twin_logprobs)  # the forward is the kernels' either way
    assert "ClosedFormBackwardBackward" in fused_nodes
    assert "ClosedFormBackwardBackward" not in twin_nodes
    assert set(fused) == set(twins)
    assert max(relative(fused[n], twins[n]) for n in twins) < 1e-5
    # The control: one token changed moves some gradient past the bound.
    changed, _, _ = grads([[5, 9, 31, 7, 11, 2, 8], [1, 2, 3], [40, 17, 3, 3]])
    assert max(relative(changed[n], twins[n]) for n in twins) > 1e-5
