"""Row-wise log-softmax in float32: one row per program, fixed block, fixed order.

Pass 1 keeps per-lane running (max, sum) over the row's blocks in ascending order and reduces
the lanes at the end; pass 2 writes x - logsumexp. The order depends only on the row length."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _log_softmax_kernel(x, y, V, sx, sy, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        v = tl.load(x + row * sx + start + offs, mask=start + offs < V, other=float("-inf"))
        v = v.to(tl.float32)
        m_new = tl.maximum(m, v)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_use) + tl.exp(v - m_use)
        m = m_new
    m_row = tl.max(m, 0)
    lse = m_row + tl.log(tl.sum(s * tl.exp(m - m_row), 0))
    for start in range(0, V, BLOCK):
        mask = start + offs < V
        v = tl.load(x + row * sx + start + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y + row * sy + start + offs, v - lse, mask=mask)


def log_softmax(logits: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """logits [R, V] -> float32 log-probabilities [R, V]."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"log_softmax wants [R, V] rows contiguous; got {tuple(logits.shape)}")
    y = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    if logits.shape[0]:
        _log_softmax_kernel[(logits.shape[0],)](
            logits, y, logits.shape[1], logits.stride(0), y.stride(0), BLOCK=block, num_warps=8
        )
    return y
