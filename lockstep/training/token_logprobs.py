"""Each row's log-probability of its target token, from the final-normed rows: the [T, vocab]
float32 logits and log-probabilities never exist at once, in the forward or the backward.

Forward, a chunk of rows at a time: the decoder's own LM head (`Decoder.head_logits`: the
head linear, soft-capping) and the backend's log-softmax, then the target's entry; a backend
with `TargetLogSoftmaxOps` (the GPU's) gives the target's entry and the row's log-sum-exp by
the same arithmetic without writing the [rows, V] log-probabilities. Every op is row-local on
a deterministic backend, so a row's value has the bits of the whole-batch computation
(`LLM.score`'s). Each row's log-sum-exp is kept (float32 [T]), with the rows and the head.

Backward (`head_logprob_grads`), a chunk of vocabulary columns at a time, in closed form by
plain torch matmuls (it need not have the engine's bits, only the right values): the chunk's
logits recomputed for every row as the forward computed them (x @ W_c^T rounded to x's dtype,
soft-capped), then with g the incoming gradient of row r,

    dc[r, v] = g_r * (1[v == target_r] - exp(c[r, v] - lse_r))      (log-softmax at the target)
    dz = dc * (1 - (c / cap)^2)                                      (soft-capping, if any)
    dW_c = dz^T @ x      written once per column chunk: every row's sum in one matmul
    dx  += dz @ W_c      float32, accumulated by the matmul itself (beta = 1)

so the head's gradient is written once, not accumulated chunk after chunk of rows. Rows
whose incoming gradient is 0 (prompt tokens of an RL batch) are left out of the backward.
"""

from __future__ import annotations

from typing import Any

import torch

from lockstep.models.decoder import Decoder
from lockstep.ops.base import TargetLogSoftmaxOps
from lockstep.training import functions
from lockstep.training.differentiable_ops import DifferentiableOps

# Logit elements per chunk (2**26 float32: 256 MiB, about 440 rows of a 152k vocabulary).
CHUNK_ELEMENTS = 2**26
# The fewest vocabulary columns a backward chunk takes, however many rows there are (a
# narrower matmul only adds launches).
MIN_COLUMNS = 256


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        decoder: Decoder,
        rows: int,
        x: torch.Tensor,
        head: torch.Tensor,
        targets: torch.Tensor,
    ) -> torch.Tensor:
        out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        lse = torch.empty_like(out)
        ops = decoder.ops.base if isinstance(decoder.ops, DifferentiableOps) else decoder.ops
        for lo in range(0, x.shape[0], rows):
            hi = min(lo + rows, x.shape[0])
            logits = decoder.head_logits(x[lo:hi], head)
            if isinstance(ops, TargetLogSoftmaxOps):  # no [rows, V] log-probabilities written
                out[lo:hi], lse[lo:hi] = ops.target_log_softmax(logits, targets[lo:hi])
                continue
            picked = ops.log_softmax(logits).gather(1, targets[lo:hi, None])[:, 0]
            out[lo:hi] = picked
            lse[lo:hi] = logits.gather(1, targets[lo:hi, None])[:, 0] - picked
        ctx.save_for_backward(x, head, targets, lse)
        ctx.softcap = decoder.spec.final_logit_softcap
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, head, targets, lse = ctx.saved_tensors
        # Rows without a gradient (each sequence's last row, whose target is the next
        # sequence's first token; an RL batch's prompt tokens) add nothing: the backward
        # takes the others only (one host synchronization for their count).
        live = grad.nonzero()[:, 0]
        if live.numel() == x.shape[0]:
            grad_x, grad_head = head_logprob_grads(x, head, targets, lse, grad, ctx.softcap)
            return None, None, grad_x, grad_head, None
        some_x, grad_head = head_logprob_grads(x[live], head, targets[live], lse[live],
                                               grad[live], ctx.softcap)  # fmt: skip
        grad_x = torch.zeros_like(x)
        grad_x[live] = some_x
        return None, None, grad_x, grad_head, None


def head_logprob_grads(
    x: torch.Tensor,
    head: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    grad: torch.Tensor,
    softcap: float | None = None,
    columns: int | None = None,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [T, H] in x's dtype, dW [V, H] in the head's) of sum_r grad_r * logprob_r, where
    logprob_r = log_softmax(c_r)[targets_r], c = cap * tanh(z / cap) (z itself without
    `softcap`), z = x @ head^T rounded to x's dtype, and `lse` [T] each row's log-sum-exp of c
    (from the forward). The matmuls run in the wider of x's and the head's dtypes (bfloat16
    with float32 accumulation for a bfloat16 model on CUDA), the rest in float32 (float64
    stays); `columns` vocabulary columns at a time (default: `CHUNK_ELEMENTS` logits).
    `fused`: dlogits by one Triton kernel per chunk (lockstep/ops/triton/row_grads.py) instead
    of torch's element-wise kernels (default: on the devices of
    `functions.FUSED_ROW_GRAD_DEVICES`, CUDA)."""
    t, v = x.shape[0], head.shape[0]
    if columns is None:
        columns = max(MIN_COLUMNS, CHUNK_ELEMENTS // max(t, 1))
    if columns < 1:
        raise ValueError(f"columns={columns} is invalid: expected >= 1")
    mm = torch.promote_types(x.dtype, head.dtype)
    wide = torch.float64 if mm == torch.float64 else torch.float32
    xm, g, lse = x.to(mm), grad.to(wide), lse.to(wide)
    grad_x = torch.zeros(x.shape, dtype=wide, device=x.device)
    grad_head = torch.empty_like(head)
    if fused is None:
        fused = x.device.type in functions.FUSED_ROW_GRAD_DEVICES
    for lo in range(0, v, columns):
        hi = min(lo + columns, v)
        w = head[lo:hi].to(mm)
        # The forward's logits: the head linear's output in the activations' dtype.
        z = (xm @ w.T).to(x.dtype)
        if fused:
            from lockstep.ops.triton.row_grads import head_dlogits

            dz = head_dlogits(z, lse, g, targets, lo, softcap, mm)
        else:
            dz = _dlogits(z.to(wide), lse, g, targets, lo, softcap).to(mm)
        grad_head[lo:hi] = (dz.T @ xm).to(head.dtype)
        _add_product(grad_x, dz, w)
    return grad_x.to(x.dtype), grad_head


def _add_product(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total += a @ b inside the matmul (its beta = 1 epilogue), with no product tensor and
    no separate add: operands of total's dtype by `addmm_`; bfloat16 or float16 operands into
    a float32 total on CUDA by cuBLAS's float32-output GEMM (`out_dtype`), which also keeps
    each chunk's product unrounded. Elsewhere (mixed dtypes on the CPU) the product, then
    the add."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    elif total.device.type == "cuda" and total.dtype == torch.float32:
        torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
    else:
        total += a @ b


def _dlogits(
    c: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, targets: torch.Tensor, lo: int,
    softcap: float | None,
) -> torch.Tensor:  # fmt: skip
    """`row_grads.head_dlogits` in torch, in c's dtype (c: the chunk's logits before
    soft-capping, a fresh tensor: the in-place steps touch nothing else)."""
    hi = lo + c.shape[1]
    slope = None
    if softcap is not None:
        c = torch.tanh(c / softcap) * softcap
        slope = 1 - (c / softcap) ** 2
    dc = c.sub_(lse[:, None]).exp_().mul_(-g[:, None])
    # + g_r at each row's target column, where it falls in this chunk (a masked scatter: no
    # host synchronization).
    inside = (targets >= lo) & (targets < hi)
    column = (targets - lo).clamp(0, hi - lo - 1)[:, None]
    dc.scatter_add_(1, column, torch.where(inside, g, 0.0)[:, None])
    if slope is not None:
        dc.mul_(slope)
    return dc


def token_logprobs(
    decoder: Decoder, x: torch.Tensor, targets: torch.Tensor, rows: int | None = None
) -> torch.Tensor:
    """float32 [R]: row r's log-probability of token `targets[r]` from the final-normed rows
    x [R, hidden] (`Decoder.hidden_states`), by the decoder's head and log-softmax, `rows`
    rows at a time (default: `CHUNK_ELEMENTS` logits per chunk); the gradient reaches x and
    the decoder's LM head weight (module docstring)."""
    if rows is None:
        rows = max(1, CHUNK_ELEMENTS // decoder.spec.vocab_size)
    if rows < 1:
        raise ValueError(f"rows={rows} is invalid: expected >= 1")
    return _ChunkedTokenLogprobs.apply(decoder, rows, x, decoder.lm_head, targets)
