"""SiLU- and GELU(tanh)-and-multiply for gated MLPs, exact per element (float32 math, one
rounding)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lockstep.ops.triton.launch import pdl_launch, wait_for_inputs


@triton.jit
def _act_mul_kernel(
    gu, y, inter, sg, sy, GELU: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    """silu(g) * u, or with GELU gelu_tanh(g) * u = g / (1 + exp(-2u')) * u, 2u' =
    g (c1 + c2 g^2) (`lockstep.ops.base.GeluOps`)."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(gu + row * sg + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu + row * sg + inter + offs, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        two_u = g * (1.5957691216057308 + 0.071354816272922 * (g * g))
        out = g / (1.0 + tl.exp(-two_u)) * u
    else:
        out = g / (1.0 + tl.exp(-g)) * u
    tl.store(y + row * sy + offs, out.to(y.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [M, 2I] (gate first) -> silu(gate) * up [M, I]."""
    return _act_mul(gate_up, gelu=False)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [M, 2I] (gate first) -> gelu_tanh(gate) * up [M, I]."""
    return _act_mul(gate_up, gelu=True)


def _act_mul(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(
            f"gated activations want [M, 2I] rows contiguous; got {tuple(gate_up.shape)}"
        )
    m, two_i = gate_up.shape
    inter = two_i // 2
    y = torch.empty((m, inter), dtype=gate_up.dtype, device=gate_up.device)
    if m:
        block = min(1024, triton.next_power_of_2(inter))
        _act_mul_kernel[(m, triton.cdiv(inter, block))](
            gate_up,
            y,
            inter,
            gate_up.stride(0),
            y.stride(0),
            GELU=gelu,
            BLOCK=block,
            num_warps=4,
            **pdl_launch(gate_up.device, m),
        )
    return y
