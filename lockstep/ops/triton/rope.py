"""Neox-style rotary embedding (rotate_half), exact per element: tables are float32, indexed by
absolute position, so a token's rotated q/k depend only on its position."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(
    x, y, positions, cos, sin, H, sxt, sxh, syt, syh, sc,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + t).to(tl.int64)
    hh = tl.arange(0, BLOCK_H)
    dd = tl.arange(0, HALF)
    mask = hh[:, None] < H
    c = tl.load(cos + pos * sc + dd)[None, :]
    s = tl.load(sin + pos * sc + dd)[None, :]
    base = x + t * sxt + hh[:, None] * sxh + dd[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    out = y + t * syt + hh[:, None] * syh + dd[None, :]
    tl.store(out, (x1 * c - x2 * s).to(y.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (x2 * c + x1 * s).to(y.dtype.element_ty), mask=mask)


def rope(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """x [T, H, D], positions [T], cos/sin [max_position, D/2] float32 -> x's dtype."""
    if x.dim() != 3 or x.stride(2) != 1:
        raise ValueError(f"rope wants x [T, H, D] with D contiguous; got {tuple(x.shape)}")
    half = x.shape[2] // 2
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != half:
        raise ValueError(f"rope tables {tuple(cos.shape)}/{tuple(sin.shape)} != [P, {half}]")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.stride(1) != 1:
        raise ValueError("rope tables must be contiguous float32")
    if half & (half - 1):
        raise ValueError(f"head_dim={x.shape[2]} must be twice a power of two")
    if positions.shape != (x.shape[0],):
        raise ValueError(f"positions {tuple(positions.shape)} != ({x.shape[0]},)")
    y = torch.empty_like(x)
    if x.shape[0]:
        _rope_kernel[(x.shape[0],)](
            x, y, positions, cos, sin, x.shape[1], x.stride(0), x.stride(1), y.stride(0),
            y.stride(1), cos.stride(0), HALF=half, BLOCK_H=triton.next_power_of_2(x.shape[1]),
            num_warps=4,
        )  # fmt: skip
    return y
