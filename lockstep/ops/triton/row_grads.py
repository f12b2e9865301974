"""Fused Triton backwards of the row ops the training module runs most on CUDA: RMSNorm with
its residual add, SiLU-and-multiply, and the LM head's log-softmax at the targets. One kernel
each, reading the saved rows and the
incoming gradient once and writing the input gradient once, in place of the float32 torch
twins (lockstep/training/functions.py), whose dozen element-wise kernels each read and write
float32 copies of every row.

These are gradients, not the engine's forward: they need the right values, not the engine's
bits, and nothing here is batch invariant. Closed forms (float32 math, one rounding to the
input's dtype), for y = x * r * w with r = (mean(x^2) + eps)^-1/2 over a row of H, and
y = silu(g) * u with s = sigmoid(g):

    dx = r * (dy * w) - x * r^3 * sum(dy * w * x) / H   (+ the residual stream's gradient)
    dw = sum over rows of dy * x * r                      (per-program partial sums, then torch)
    dg = dy * u * s * (1 + g * (1 - s)),    du = dy * g * s
    dz = g_r * (1[v == target_r] - exp(c - lse_r)) * (1 - (c / cap)^2),  c = cap * tanh(z / cap)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lockstep.ops.triton.launch import pdl_launch, wait_for_inputs

# Rows per program of the RMSNorm backward: each program adds its rows' dw into one partial
# row, so the partials are [rows / ROWS, H] float32 (summed by torch afterwards).
ROWS = 16
# Columns per program of the SiLU-mul and head backwards.
SILU_BLOCK = 1024


@triton.jit
def _rms_norm_backward_kernel(
    x, w, dy, ds, dx, dw_part, n_rows, hidden, sx, sdy, sds, sdx, eps,
    HAS_DS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    cols = offs < hidden
    wv = tl.load(w + offs, mask=cols, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ROWS):
        row = pid.to(tl.int64) * ROWS + i
        mask = cols & (tl.full([BLOCK], 0, tl.int64) + row < n_rows)
        xv = tl.load(x + row * sx + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(dy + row * sdy + offs, mask=mask, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=0) / hidden + eps)
        gw = g * wv
        d = r * gw - xv * (r * r * r) * (tl.sum(gw * xv, axis=0) / hidden)
        if HAS_DS:
            d += tl.load(ds + row * sds + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx + row * sdx + offs, d.to(dx.dtype.element_ty), mask=mask)
        acc += g * xv * r
    tl.store(dw_part + pid.to(tl.int64) * hidden + offs, acc, mask=cols)


def rms_norm_backward(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    grad_out: torch.Tensor,
    grad_stream: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [M, H] in x's dtype, dw [H] float32) of y = rms_norm(x) * weight given dL/dy
    `grad_out` [M, H]; `grad_stream` [M, H]: the gradient x also receives directly (the
    residual stream an add-RMSNorm returns beside y), added to dx. x is the normed input
    itself (for an add-RMSNorm, the sum it returned)."""
    if x.dim() != 2 or weight.shape != (x.shape[1],) or grad_out.shape != x.shape:
        raise ValueError(f"rows x [M, H], a weight [H] and grad_out [M, H] wanted; got "
                         f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(grad_out.shape)}")  # fmt: skip
    m, hidden = x.shape
    x, grad_out = x.contiguous(), grad_out.contiguous()
    grad_stream = None if grad_stream is None else grad_stream.contiguous()
    dx = torch.empty_like(x)
    programs = triton.cdiv(m, ROWS)
    dw_part = torch.empty((max(programs, 1), hidden), dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(hidden)
        stream = grad_out if grad_stream is None else grad_stream
        _rms_norm_backward_kernel[(programs,)](
            x, weight.contiguous(), grad_out, stream, dx, dw_part, m, hidden, x.stride(0),
            grad_out.stride(0), stream.stride(0), dx.stride(0), eps,
            HAS_DS=grad_stream is not None, ROWS=ROWS, BLOCK=block,
            num_warps=8 if block >= 4096 else 4, **pdl_launch(x.device, m),
        )  # fmt: skip
    else:
        dw_part.zero_()
    return dx, dw_part.sum(0)


@triton.jit
def _silu_mul_backward_kernel(
    gu, dy, dgu, inter, sgu, sdy, sdgu, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(gu + row * sgu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu + row * sgu + inter + offs, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(dy + row * sdy + offs, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    tl.store(dgu + row * sdgu + offs, (d * u * s * (1.0 + g * (1.0 - s))).to(dgu.dtype.element_ty),
             mask=mask)  # fmt: skip
    tl.store(dgu + row * sdgu + inter + offs, (d * g * s).to(dgu.dtype.element_ty), mask=mask)


def silu_mul_backward(gate_up: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """d gate_up [M, 2I] (gate columns first, gate_up's dtype) of y = silu(gate) * up given
    dL/dy `grad_out` [M, I]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up [M, 2I] wanted; got {tuple(gate_up.shape)}")
    gate_up = gate_up.contiguous()
    m, two_i = gate_up.shape
    inter = two_i // 2
    grad_out = grad_out.contiguous()
    if grad_out.shape != (m, inter):
        raise ValueError(f"grad_out {tuple(grad_out.shape)} for gate_up {tuple(gate_up.shape)}")
    out = torch.empty_like(gate_up)
    if m:
        block = min(SILU_BLOCK, triton.next_power_of_2(inter))
        _silu_mul_backward_kernel[(m, triton.cdiv(inter, block))](
            gate_up, grad_out, out, inter, gate_up.stride(0), grad_out.stride(0), out.stride(0),
            BLOCK=block, **pdl_launch(gate_up.device, m),
        )  # fmt: skip
    return out


@triton.jit
def _head_dlogits_kernel(
    z, lse, g, targets, dz, cols, lo, sz, sdz, cap,
    HAS_CAP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    c = tl.load(z + row * sz + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_CAP:  # cap * tanh(c / cap), as the engine's soft-capping writes it
        c = (1.0 - 2.0 / (tl.exp(c * (2.0 / cap)) + 1.0)) * cap
    target = tl.load(targets + row) - lo
    d = tl.where(offs == target, 1.0, 0.0) - tl.exp(c - tl.load(lse + row))
    d = d * tl.load(g + row)
    if HAS_CAP:
        d = d * (1.0 - (c / cap) * (c / cap))
    tl.store(dz + row * sdz + offs, d.to(dz.dtype.element_ty), mask=mask)


def head_dlogits(
    z: torch.Tensor,
    lse: torch.Tensor,
    grad: torch.Tensor,
    targets: torch.Tensor,
    lo: int,
    softcap: float | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """dL/dz [R, C] in `out_dtype` for vocabulary columns lo .. lo + C of the head's output z
    [R, C] (before soft-capping), where L = sum_r grad_r * log_softmax(cap(z_r))[targets_r]
    over the whole vocabulary and `lse` [R] float32 is each row's log-sum-exp of the capped
    logits (lockstep/training/token_logprobs.py, `head_logprob_grads`, the same in torch)."""
    if z.dim() != 2 or lse.shape != (z.shape[0],) or grad.shape != lse.shape:
        raise ValueError(f"z [R, C], lse [R] and grad [R] wanted; got {tuple(z.shape)}, "
                         f"{tuple(lse.shape)}, {tuple(grad.shape)}")  # fmt: skip
    z = z.contiguous()
    rows, cols = z.shape
    out = torch.empty((rows, cols), dtype=out_dtype, device=z.device)
    if rows and cols:
        block = min(SILU_BLOCK, triton.next_power_of_2(cols))
        _head_dlogits_kernel[(rows, triton.cdiv(cols, block))](
            z, lse.float().contiguous(), grad.float().contiguous(), targets.contiguous(), out,
            cols, lo, z.stride(0), out.stride(0), 1.0 if softcap is None else float(softcap),
            HAS_CAP=softcap is not None, BLOCK=block, **pdl_launch(z.device, rows),
        )  # fmt: skip
    return out
