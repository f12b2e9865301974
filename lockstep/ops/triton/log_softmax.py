"""Row-wise log-softmax in float32, in two wide passes whose order depends only on V.

A row is cut into chunks of CHUNK logits at fixed offsets. Pass 1 (one program per row x
chunk) reduces its chunk to (max, sum of exp(x - max)). Pass 2 (the same grid) folds the row's
chunk partials into logsumexp with one fixed-shape reduction, every program of the row the
same way, and writes its chunk's x - logsumexp. Nothing depends on the number of rows or a
row's index. Two wide passes, not one program walking a whole row: at V = 151,936 that one is
latency-bound, and every decode step would wait for it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lockstep.ops.triton.launch import pdl_launch, wait_for_inputs

CHUNK = 4096


@triton.jit
def _chunk_partials(x, part_m, part_s, V, sx, C, CHUNK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    v = tl.load(x + row * sx + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    m = tl.max(v, 0)
    # A chunk of only -inf (masked logits) has m = -inf: exp(v - 0) keeps its sum 0, not NaN.
    m_use = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.exp(v - m_use), 0)
    tl.store(part_m + row * C + chunk, m)
    tl.store(part_s + row * C + chunk, s)


@triton.jit
def _row_logsumexp(part_m, part_s, row, C, C_POW2: tl.constexpr):
    """A row's logsumexp from its C chunk partials: the one fold every output program runs
    (in `_chunk_output` and `_target_output` alike, so both give the same bits)."""
    cs = tl.arange(0, C_POW2)
    m = tl.load(part_m + row * C + cs, mask=cs < C, other=float("-inf"))
    s = tl.load(part_s + row * C + cs, mask=cs < C, other=0.0)
    m_row = tl.max(m, 0)
    return m_row + tl.log(tl.sum(s * tl.exp(m - m_row), 0))


@triton.jit
def _chunk_output(x, y, part_m, part_s, V, sx, sy, C, CHUNK: tl.constexpr,
                  C_POW2: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    lse = _row_logsumexp(part_m, part_s, row, C, C_POW2)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < V
    v = tl.load(x + row * sx + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y + row * sy + offs, v - lse, mask=mask)


@triton.jit
def _target_output(x, targets, y, lse_out, part_m, part_s, sx, C, C_POW2: tl.constexpr,
                   PDL: tl.constexpr):  # fmt: skip
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    lse = _row_logsumexp(part_m, part_s, row, C, C_POW2)
    v = tl.load(x + row * sx + tl.load(targets + row)).to(tl.float32)
    tl.store(y + row, v - lse)
    tl.store(lse_out + row, lse)


def _partials(logits: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 1: each row's per-chunk (max, sum of exp) [R, C] float32."""
    r, v = logits.shape
    c = triton.cdiv(v, chunk)
    part_m = torch.empty((r, c), dtype=torch.float32, device=logits.device)
    part_s = torch.empty_like(part_m)
    _chunk_partials[(r, c)](
        logits,
        part_m,
        part_s,
        v,
        logits.stride(0),
        c,
        CHUNK=chunk,
        num_warps=8,
        **pdl_launch(logits.device, r),
    )
    return part_m, part_s


def _check_rows(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"log_softmax wants [R, V] rows contiguous; got {tuple(logits.shape)}")


def log_softmax(logits: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """logits [R, V] -> float32 log-probabilities [R, V]. `chunk` is part of the numerics
    (tests only)."""
    _check_rows(logits)
    r, v = logits.shape
    y = torch.empty((r, v), dtype=torch.float32, device=logits.device)
    if r and v:
        part_m, part_s = _partials(logits, chunk)
        c = part_m.shape[1]
        _chunk_output[(r, c)](
            logits, y, part_m, part_s, v, logits.stride(0), y.stride(0), c, CHUNK=chunk,
            C_POW2=max(16, triton.next_power_of_2(c)), num_warps=8, **pdl_launch(logits.device, r),
        )  # fmt: skip
    return y


def target_log_softmax(
    logits: torch.Tensor, targets: torch.Tensor, chunk: int = CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_softmax(logits)[r, targets[r]] [R] float32, bit for bit, and each row's
    logsumexp [R] float32) without writing the [R, V] log-probabilities: the same partials
    and the same fold (`_row_logsumexp`), one program per row for its target alone."""
    _check_rows(logits)
    r, v = logits.shape
    if targets.shape != (r,):
        raise ValueError(f"targets [R] wanted for logits {tuple(logits.shape)}; got "
                         f"{tuple(targets.shape)}")  # fmt: skip
    y = torch.empty(r, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(y)
    if r and v:
        part_m, part_s = _partials(logits, chunk)
        c = part_m.shape[1]
        _target_output[(r,)](
            logits, targets.contiguous(), y, lse, part_m, part_s, logits.stride(0), c,
            C_POW2=max(16, triton.next_power_of_2(c)), num_warps=8, **pdl_launch(logits.device, r),
        )  # fmt: skip
    return y, lse
