"""The fused Triton backwards of RMSNorm (with its residual stream) and SiLU-mul
(lockstep/ops/triton/row_grads.py), under Triton's interpreter on CPU tensors (tests/conftest.py
sets it where there is no CUDA): each equals torch autograd of the plain formula in float64 to
float32 rounding, and a bfloat16 input gets a bfloat16 gradient within bfloat16's rounding;
the training module with them (forced on the CPU) gives the float32 twins' gradients. Controls:
a wrong weight or another row's gradient, swapped gate and up, one token changed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lockstep.ops.triton.row_grads import ROWS, rms_norm_backward, silu_mul_backward
from lockstep.training import functions
from tests.support.grad_checks import graph_names, relative

M, H = 2 * ROWS + 5, 48  # rows past a program's ROWS, a hidden size not a power of 2
EPS = 1e-6


def _rms_autograd(x, w, dy, ds):  # type: ignore[no-untyped-def]
    xl, wl = x.double().requires_grad_(), w.double().requires_grad_()
    y = xl * torch.rsqrt(xl.pow(2).mean(-1, keepdim=True) + EPS) * wl
    outs, grads = ([y, xl], [dy.double(), ds.double()]) if ds is not None else ([y], [dy.double()])
    return torch.autograd.grad(outs, [xl, wl], grads)


@pytest.mark.parametrize("stream", [False, True], ids=["rms_norm", "add_rms_norm"])
def test_rms_norm_backward_is_autograd(stream: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(M, H, generator=gen), torch.randn(H, generator=gen)
    dy, ds = torch.randn(M, H, generator=gen), torch.randn(M, H, generator=gen)
    ds = ds if stream else None
    ex, ew = _rms_autograd(x, w, dy, ds)
    dx, dw = rms_norm_backward(x, w, EPS, dy, ds)
    assert dx.dtype == dw.dtype == torch.float32
    assert relative(dx, ex) < 1e-6 and relative(dw, ew) < 1e-6
    xb, dyb = x.bfloat16(), dy.bfloat16()
    dsb = None if ds is None else ds.bfloat16()
    dxb, dwb = rms_norm_backward(xb, w, EPS, dyb, dsb)
    ebx, ebw = _rms_autograd(xb, w, dyb, dsb)
    assert dxb.dtype == torch.bfloat16 and dwb.dtype == torch.float32
    assert relative(dxb, ebx) < 1e-2 and relative(dwb, ebw) < 1e-6
    # The controls: another weight moves dx (dw does not depend on it), another row's
    # gradient moves both.
    assert relative(rms_norm_backward(x, w.flip(0), EPS, dy, ds)[0], ex) > 1e-2
    other = rms_norm_backward(x, w, EPS, dy.roll(1, 0), ds)
    assert relative(other[0], ex) > 1e-2 and relative(other[1], ew) > 1e-2


def test_silu_mul_backward_is_autograd() -> None:
    gen = torch.Generator().manual_seed(1)
    gate_up, dy = torch.randn(M, 2 * H, generator=gen) * 3, torch.randn(M, H, generator=gen)
    leaf = gate_up.double().requires_grad_()
    gate, up = leaf.chunk(2, -1)
    (expected,) = torch.autograd.grad(F.silu(gate) * up, [leaf], [dy.double()])
    got = silu_mul_backward(gate_up, dy)
    assert got.dtype == torch.float32 and relative(got, expected) < 1e-6
    got_bf16 = silu_mul_backward(gate_up.bfloat16(), dy.bfloat16())
    assert got_bf16.dtype == torch.bfloat16 and relative(got_bf16, expected) < 1e-2
    # The control: up and gate swapped.
    swapped = silu_mul_backward(torch.cat(gate_up.chunk(2, -1)[::-1], -1), dy)
    assert relative(swapped, expected) > 1e-2


def test_the_module_with_fused_row_grads_gives_the_twins_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lockstep.training import LockstepForCausalLM

    model = LockstepForCausalLM.from_pretrained("random:tiny-qwen3")
    sequences = [[5, 9, 30, 7, 11, 2, 8], [1, 2, 3], [40, 17, 3, 3]]

    def grads(seqs: list[list[int]]) -> tuple[dict[str, torch.Tensor], set[str]]:
        model.zero_grad()
        out = model(seqs)
        (-out.logprobs.sum()).backward()
        named = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return named, graph_names(out.logprobs)

    twins, twin_nodes = grads(sequences)
    monkeypatch.setattr(functions, "FUSED_ROW_GRAD_DEVICES", ("cuda", "cpu"))
    fused, fused_nodes = grads(sequences)
    # The fused Functions ran (and the twins did not), on every norm and the MLP.
    for name in ("_FusedAddRmsNormBackward", "_FusedRmsNormBackward", "_FusedSiluMulBackward"):
        assert name in fused_nodes and name not in twin_nodes
    assert set(fused) == set(twins)
    worst = max(relative(fused[n], twins[n]) for n in twins)
    assert worst < 1e-5
    # The control: one token changed moves some gradient past the bound.
    changed, _ = grads([[5, 9, 31, 7, 11, 2, 8], [1, 2, 3], [40, 17, 3, 3]])
    assert max(relative(changed[n], twins[n]) for n in twins) > 1e-5
