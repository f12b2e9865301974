"""The fused Triton backward of the attention's input preparation (`Ops.attention_input`): the
per-head q and k RMSNorms (Qwen3; none for models without them), RoPE on each head's first
`rot` dims and the cache's rounding of k and v, passed straight through. One kernel for the q
heads and one for the k heads read the saved fused q|k|v rows and the attention's dq or dk
once and write d q|k|v once, in place of the float32 torch twin (functions.PreparedAttention),
whose two dozen element-wise kernels each read and write float32 copies of q and k.

A gradient, not the engine's forward: the right values, not the engine's bits. For one head
row x [D], n = x * r * w with r = (mean(x^2) + eps)^-1/2, y = rope(n): the rotation's
transpose turns dy into dn (neox halves a = dims 0 .. rot/2, b = rot/2 .. rot; the rest
pass through), then RMSNorm's closed form:

    dn_a = dy_a * cos + dy_b * sin,   dn_b = dy_b * cos - dy_a * sin
    dx = r * (dn * w) - x * r^3 * sum(dn * w * x) / D
    dw = sum over rows and heads of dn * x * r        (per-program partial sums, then torch)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lockstep.ops.triton.launch import pdl_launch, wait_for_inputs

# Rows per program: each program adds its rows' dw into one partial row, so the partials are
# [rows / ROWS * heads, D] float32 (summed by torch afterwards).
ROWS = 16


@triton.jit
def _head_input_backward_kernel(
    x, dy, dx, w, dw_part, positions, cos, sin, n_rows, col0, head_dim, rot, sx, sdy_row,
    sdy_head, sdx, scos, eps,
    HAS_NORM: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    pid = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    cols = offs < head_dim
    half = rot // 2
    rotated = offs < rot
    first = offs < half
    # Each rotated dim's table column and partner dim (a <-> b), and the sign of the
    # partner's term in the rotation's transpose.
    table_col = tl.where(first, offs, offs - half)
    partner = tl.where(first, offs + half, offs - half)
    sign = tl.where(first, 1.0, -1.0)
    if HAS_NORM:
        wv = tl.load(w + offs, mask=cols, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    x_head = col0 + head * head_dim
    for i in range(ROWS):
        row = pid.to(tl.int64) * ROWS + i
        live = tl.full([BLOCK], 0, tl.int64) + row < n_rows
        mask = cols & live
        pos = tl.load(positions + row, mask=row < n_rows, other=0).to(tl.int64)
        c = tl.load(cos + pos * scos + table_col, mask=rotated & live, other=1.0)
        s = tl.load(sin + pos * scos + table_col, mask=rotated & live, other=0.0)
        g_row = dy + row * sdy_row + head * sdy_head
        g = tl.load(g_row + offs, mask=mask, other=0.0).to(tl.float32)
        g_partner = tl.load(g_row + partner, mask=rotated & live, other=0.0).to(tl.float32)
        dn = g * c + sign * g_partner * s
        if HAS_NORM:
            xv = tl.load(x + row * sx + x_head + offs, mask=mask, other=0.0).to(tl.float32)
            r = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=0) / head_dim + eps)
            gw = dn * wv
            d = r * gw - xv * (r * r * r) * (tl.sum(gw * xv, axis=0) / head_dim)
            acc += dn * xv * r
        else:
            d = dn
        tl.store(dx + row * sdx + x_head + offs, d.to(dx.dtype.element_ty), mask=mask)
    if HAS_NORM:
        part = (pid.to(tl.int64) * tl.num_programs(1) + head) * head_dim
        tl.store(dw_part + part + offs, acc, mask=cols)


def attention_input_backward(
    qkv: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(d qkv [T, (Hq + 2 Hkv) D] in qkv's dtype, d q_norm [D] and d k_norm [D] float32 or
    None) of q = rope(rms_norm_heads(qkv's q columns) * q_norm), k likewise, v = qkv's v
    columns, given dL/dq `dq` [T, Hq, D], `dk`, `dv` [T, Hkv, D] (module docstring). Norms are
    both given or both None; RoPE rotates each head's first 2 * cos.shape[1] dims at
    `positions` [T] (tables float32 [P, rot / 2])."""
    t, hq, d = dq.shape
    hkv = dk.shape[1]
    if qkv.shape != (t, (hq + 2 * hkv) * d) or dv.shape != dk.shape or dk.shape[::2] != (t, d):
        raise ValueError(f"qkv [T, (Hq + 2 Hkv) D] with dq [T, Hq, D], dk and dv [T, Hkv, D] "
                         f"wanted; got {tuple(qkv.shape)}, {tuple(dq.shape)}, "
                         f"{tuple(dk.shape)}, {tuple(dv.shape)}")  # fmt: skip
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm: both or neither")
    rot = 2 * cos.shape[1]
    if rot > d or sin.shape != cos.shape:
        raise ValueError(f"RoPE tables {tuple(cos.shape)}, {tuple(sin.shape)} for heads of {d}")
    qkv = qkv.contiguous()
    dx = torch.empty_like(qkv)
    dx[:, (hq + hkv) * d :] = dv.reshape(t, hkv * d)  # the cache's rounding: straight through
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    positions = positions.contiguous()
    programs = triton.cdiv(t, ROWS)
    has_norm = q_norm is not None
    grads: list[torch.Tensor | None] = []
    for col0, grad, norm in ((0, dq, q_norm), (hq * d, dk, k_norm)):
        heads = grad.shape[1]
        grad = grad if grad.stride(2) == 1 else grad.contiguous()
        dw_part = torch.zeros((max(programs, 1) * heads, d), dtype=torch.float32,
                              device=qkv.device)  # fmt: skip
        if t:
            _head_input_backward_kernel[(programs, heads)](
                qkv, grad, dx, norm if has_norm else dw_part, dw_part, positions, cos, sin, t,
                col0, d, rot, qkv.stride(0), grad.stride(0), grad.stride(1), dx.stride(0),
                cos.stride(0), eps,
                HAS_NORM=has_norm, ROWS=ROWS, BLOCK=triton.next_power_of_2(d),
                **pdl_launch(qkv.device, t),
            )  # fmt: skip
        grads.append(dw_part.sum(0) if has_norm else None)
    return dx, grads[0], grads[1]
