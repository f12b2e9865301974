"""RMSNorm and fused residual-add + RMSNorm: one row per program, the whole row in one block,
so the sum of squares is reduced in one order fixed by the hidden size alone."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lockstep.ops.triton.launch import pdl_launch, wait_for_inputs


@triton.jit
def _rms_norm_kernel(
    x, res, w, y, res_out, H, sx, sr, sy, so, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    h = tl.load(x + row * sx + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h = h + tl.load(res + row * sr + offs, mask=mask, other=0.0).to(tl.float32)
        # The residual stream is kept in the activation dtype; the norm reads the rounded value
        # so that it is the same whether or not the add was fused.
        h_q = h.to(res_out.dtype.element_ty)
        tl.store(res_out + row * so + offs, h_q, mask=mask)
        h = h_q.to(tl.float32)
    var = tl.sum(h * h, 0) / H
    rstd = 1.0 / tl.sqrt(var + eps)
    out = h * rstd * tl.load(w + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y + row * sy + offs, out.to(y.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm wants x [M, H], weight [H]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")  # fmt: skip
    if x.stride(1) != 1:
        raise ValueError("rms_norm wants rows contiguous")


def _warps(block: int) -> int:
    return 8 if block >= 4096 else 4


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check(x, weight)
    y = torch.empty_like(x)
    if x.shape[0]:
        block = triton.next_power_of_2(x.shape[1])
        _rms_norm_kernel[(x.shape[0],)](
            x, x, weight, y, y, x.shape[1], x.stride(0), 0, y.stride(0), 0, float(eps),
            HAS_RES=False, BLOCK=block, num_warps=_warps(block), **pdl_launch(x.device, x.shape[0]),
        )  # fmt: skip
    return y


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    _check(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")  # fmt: skip
    y = torch.empty_like(x)
    res_out = torch.empty_like(x)
    if x.shape[0]:
        block = triton.next_power_of_2(x.shape[1])
        _rms_norm_kernel[(x.shape[0],)](
            x, residual, weight, y, res_out, x.shape[1], x.stride(0), residual.stride(0),
            y.stride(0), res_out.stride(0), float(eps), HAS_RES=True, BLOCK=block,
            num_warps=_warps(block), **pdl_launch(x.device, x.shape[0]),
        )  # fmt: skip
    return y, res_out
