"""The chunked gated delta rule on tensor cores: the formulas of lockstep/ops/chunked_delta.py
(the torch reference; its docstring says why a row's bits do not depend on the schedule) with
tl.dot, every sequence of a step in two launches, each sequence continuing the state and the
open chunk's rows (keys, values, log gates, betas as they arrived) of its slot of a state pool.

A step's rows are cut into chunk tasks (`PooledRows`: each piece of a sequence that falls in
one absolute chunk). Every task works on its chunk's whole tile of C rows:

    tile rows   0 .. r0-1: the slot's open rows | r0 .. r0+n-1: the step's | the rest: zero

so a one-row decode step is a task with n = 1 and r0 = its position % C, the same code and
tile shapes as a prefill's. Three kernels:

  (a) `_gdn_chunk_wy_kernel`, one program per (task, value head), all tasks in parallel: the
      cumulative log decays gamma, A, T = (I + A)^-1 (forward substitution, row i from rows
      < i), w = T (beta e^gamma k), u = T (beta v) and P = causal(q k^T e^(gamma_i -
      gamma_j)) into a workspace of K tasks.
  (b, c) `_gdn_chunk_state_kernel`, one program per (value head, BV value columns,
      sequence), the sequence's tasks in order: corrected values vn = u - w S from the
      chunk-start state S, (c) the task's rows' outputs, and (b) `_next_block` where the
      task closes its chunk (one formula, a whole tile). Output
      and state update share the program so that chunk-start states never go through memory:
      the workspace is bounded by the step's rows (the step budget), not by prompt length.
  `_gdn_open_rows_kernel` last: the rows of a chunk the step leaves open join the slot's
      open rows. Not earlier: a step that crosses a boundary reads the slot's rows of its
      first chunk while its last chunk's rows would overwrite them.

The [C, Dk] and [C, Dv] tiles enter the dots in blocks of KB columns (`KB`), accumulated block
after block in ascending order, and the chunk-start state is carried as up to four [KB, BV]
blocks: no operand holds a whole 128-column row in registers (a tile's dot over all of Dk
spilled thousands of bytes a thread, which set the kernels' speed). The S-free product (the
decayed causal q.k matrix P) is made in (a), beside A, so (b, c) keep few tiles live.

What a decode row costs: a whole tile's work (the substitution's C - 1 steps, the [C, Dk] x
[Dk, Dv] products), about C times the per-row recurrence's (gated_delta.py). On an H100 at
Qwen3.5-9B's heads this kernel's decode call is ~6x the recurrent one's, its prefill ~4x
faster (docs/results.md, "Hybrid"): the option stays off by default.

Every sum has one shape whatever the step holds; row counts, positions and slots are read from
memory, never specialized on; multiply-add contraction is off: one compiled kernel for a
decode step and a prefill. The GPU's bits differ from the torch reference's (other reduction
orders): the contract is per device type.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lockstep.ops.base import PooledRows
from lockstep.ops.triton.launch import interpreting, pdl_launch, wait_for_inputs

# Value columns per program of the state kernel (a power of two; Dv is padded to it).
BLOCK_V = 16
# Columns per block of a tile's dots (a power of two >= 16, the dots' least K): Dk and Dv
# are cut into blocks of at most KB, and the state into at most MAX_BLOCKS of them.
KB = 32
MAX_BLOCKS = 4
# Warps and pipeline stages of each kernel: constants, since a dot's and a reduction's bits
# follow the layout.
WY_WARPS = 4
STATE_WARPS = 4
STATE_STAGES = 3
# tl.dot operand precision: three TF32 products per float32 one, near float32 accuracy on
# tensor cores (plain "tf32" rounds operands to 10 mantissa bits).
DOT_PRECISION = "tf32x3"


@triton.jit
def _tile(step, buf, rows, r0, n, step_row, buf_row, cols, cmask):
    # The chunk tile [C, cols]: rows < r0 from the slot's open rows, r0 .. r0+n-1 from the
    # step (`step` points at the task's first row), the rest zero.
    from_buf = rows < r0
    from_step = (rows >= r0) & (rows < r0 + n)
    a = tl.load(buf + rows[:, None] * buf_row + cols[None, :],
                mask=from_buf[:, None] & cmask[None, :], other=0.0)  # fmt: skip
    b = tl.load(step + (rows - r0)[:, None] * step_row + cols[None, :],
                mask=from_step[:, None] & cmask[None, :], other=0.0)  # fmt: skip
    return tl.where(from_buf[:, None], a, b)


@triton.jit
def _tile_scalars(step, buf, rows, r0, n, step_row, buf_row):
    from_buf = rows < r0
    from_step = (rows >= r0) & (rows < r0 + n)
    a = tl.load(buf + rows * buf_row, mask=from_buf, other=0.0)
    b = tl.load(step + (rows - r0) * step_row, mask=from_step, other=0.0)
    return tl.where(from_buf, a, b)


@triton.jit
def _gdn_chunk_wy_kernel(
    q, k, v, g, beta, open_k, open_v, open_g, open_beta, ws_w, ws_u, ws_gamma, ws_p,
    task_seq, task_pos, task_row, task_n, slots, k_slot, v_slot, g_slot, b_slot,
    HK, HV, DK, DV, C: tl.constexpr, KB: tl.constexpr, NKB: tl.constexpr, VB: tl.constexpr,
    NVB: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    task = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(task_seq + task)
    pos = tl.load(task_pos + task)
    row = tl.load(task_row + task).to(tl.int64)
    n = tl.load(task_n + task)
    slot = tl.load(slots + seq).to(tl.int64)
    r0 = pos % C
    group = HV // HK
    kh = h // group
    rows = tl.arange(0, C)
    mine = (rows >= r0) & (rows < r0 + n)
    open_k += slot * k_slot + kh * DK
    open_v += slot * v_slot + h * DV
    open_g += slot * g_slot + h
    open_beta += slot * b_slot + h
    k += row * HK * DK + kh * DK
    q += row * HK * DK + kh * DK
    v += row * HV * DV + h * DV
    gt = _tile_scalars(g + row * HV + h, open_g, rows, r0, n, HV, HV)
    bt = _tile_scalars(beta + row * HV + h, open_beta, rows, r0, n, HV, HV)
    # An inclusive scan: gamma_i's additions take only rows <= i, in an order fixed by i.
    gamma = tl.cumsum(gt, axis=0)
    lower = rows[None, :] < rows[:, None]
    causal = rows[None, :] <= rows[:, None]
    decay = tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], float("-inf")))
    # k k^T and q k^T over Dk in blocks of KB columns, ascending.
    kk = tl.zeros((C, C), tl.float32)
    qk = tl.zeros((C, C), tl.float32)
    for b in tl.static_range(NKB):
        dk = b * KB + tl.arange(0, KB)
        mk = dk < DK
        kt = _tile(k, open_k, rows, r0, n, HK * DK, HK * DK, dk, mk)
        qt = tl.load(q + (rows - r0)[:, None] * HK * DK + dk[None, :],
                     mask=mine[:, None] & mk[None, :], other=0.0)  # fmt: skip
        kk = tl.dot(kt, tl.trans(kt), kk, input_precision=PREC)
        qk = tl.dot(qt, tl.trans(kt), qk, input_precision=PREC)
    a = tl.where(lower, (bt[:, None] * kk) * decay, 0.0)
    # T = (I + A)^-1 by forward substitution: row i = e_i - sum_j A[i, j] T[j], taken when
    # rows >= i still hold the identity (A[i, j] = 0 there), so row i reads rows < i only.
    t = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for i in range(1, C):
        ai = tl.sum(tl.where(rows[:, None] == i, a, 0.0), axis=0)
        ti = tl.sum(ai[:, None] * t, axis=0)
        t = tl.where(rows[:, None] == i, t - ti[None, :], t)
    t = tl.where(causal, t, 0.0)  # exact zeros above the diagonal
    ws = task * HV + h
    tl.store(ws_gamma + ws * C + rows, gamma)
    p = tl.where(causal, qk * decay, 0.0)
    tl.store(ws_p + (ws * C + rows[:, None]) * C + rows[None, :], p)
    eg = bt * tl.exp(gamma)
    # The key blocks are loaded again (L1/L2 hits) rather than kept live through T's loop.
    for b in tl.static_range(NKB):
        dk = b * KB + tl.arange(0, KB)
        mk = dk < DK
        kt = _tile(k, open_k, rows, r0, n, HK * DK, HK * DK, dk, mk)
        w = tl.dot(t, eg[:, None] * kt, input_precision=PREC)
        tl.store(ws_w + (ws * C + rows[:, None]) * DK + dk[None, :], w, mask=mk[None, :])
    for b in tl.static_range(NVB):
        dv = b * VB + tl.arange(0, VB)
        mv = dv < DV
        vt = _tile(v, open_v, rows, r0, n, HV * DV, HV * DV, dv, mv)
        u = tl.dot(t, bt[:, None] * vt, input_precision=PREC)
        tl.store(ws_u + (ws * C + rows[:, None]) * DV + dv[None, :], u, mask=mv[None, :])


@triton.jit
def _gdn_open_rows_kernel(
    k, v, g, beta, open_k, open_v, open_g, open_beta, task_pos, task_row, task_n, task_cu,
    slots, k_slot, v_slot, g_slot, b_slot, HK, HV, DK, DV, C: tl.constexpr, BK: tl.constexpr,
    BVF: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # After both kernels (which read the slot's rows of a sequence's first chunk, while its
    # last chunk would be written here): the rows of a chunk the step leaves open join the
    # slot's open rows, as they arrived.
    wait_for_inputs(PDL)
    seq = tl.program_id(0)
    h = tl.program_id(1)
    task = tl.load(task_cu + seq + 1) - 1
    pos = tl.load(task_pos + task)
    row = tl.load(task_row + task).to(tl.int64)
    n = tl.load(task_n + task)
    r0 = pos % C
    if (task >= tl.load(task_cu + seq)) & (r0 + n < C):
        slot = tl.load(slots + seq).to(tl.int64)
        group = HV // HK
        kh = h // group
        rows = tl.arange(0, C)
        dk = tl.arange(0, BK)
        dv = tl.arange(0, BVF)
        new = (rows >= r0) & (rows < r0 + n)
        src = row + rows - r0
        mv = new[:, None] & (dv < DV)[None, :]
        vt = tl.load(v + src[:, None] * HV * DV + h * DV + dv[None, :], mask=mv, other=0.0)
        tl.store(open_v + slot * v_slot + rows[:, None] * HV * DV + h * DV + dv[None, :], vt,
                 mask=mv)  # fmt: skip
        gt = tl.load(g + src * HV + h, mask=new, other=0.0)
        tl.store(open_g + slot * g_slot + rows * HV + h, gt, mask=new)
        bt = tl.load(beta + src * HV + h, mask=new, other=0.0)
        tl.store(open_beta + slot * b_slot + rows * HV + h, bt, mask=new)
        if h % group == 0:  # one program per key head writes its keys
            mk = new[:, None] & (dk < DK)[None, :]
            kt = tl.load(k + src[:, None] * HK * DK + kh * DK + dk[None, :], mask=mk, other=0.0)
            tl.store(open_k + slot * k_slot + rows[:, None] * HK * DK + kh * DK + dk[None, :],
                     kt, mask=mk)  # fmt: skip


@triton.jit
def _rows(ptr, rows, row_stride, cols, mask):
    # A [C, cols] tile of a workspace or of the step's rows.
    return tl.load(ptr + rows[:, None] * row_stride + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _state_block(ptr, b: tl.constexpr, KB: tl.constexpr, DK, DV, dv, mv):
    # Rows b*KB .. b*KB+KB-1 of a [Dk, Dv] state, value columns dv.
    dk = b * KB + tl.arange(0, KB)
    return tl.load(ptr + dk[:, None] * DV + dv[None, :], mask=(dk < DK)[:, None] & mv[None, :],
                   other=0.0)  # fmt: skip


@triton.jit
def _store_state_block(ptr, s, b: tl.constexpr, KB: tl.constexpr, DK, DV, dv, mv):
    dk = b * KB + tl.arange(0, KB)
    tl.store(ptr + dk[:, None] * DV + dv[None, :], s, mask=(dk < DK)[:, None] & mv[None, :])


@triton.jit
def _times_state(x, rows, stride, DK, s0, s1, s2, s3, KB: tl.constexpr, NKB: tl.constexpr,
                 PREC: tl.constexpr, mask_rows):  # fmt: skip
    # x S for a [C, Dk] tile x at x + rows * stride (rows outside mask_rows zero) and the
    # state's blocks: one dot a block, accumulated in ascending order.
    dk = tl.arange(0, KB)
    acc = tl.dot(_rows(x, rows, stride, dk, mask_rows[:, None] & (dk < DK)[None, :]), s0,
                 input_precision=PREC)  # fmt: skip
    if NKB > 1:
        dk = KB + tl.arange(0, KB)
        acc = tl.dot(_rows(x, rows, stride, dk, mask_rows[:, None] & (dk < DK)[None, :]), s1,
                     acc, input_precision=PREC)  # fmt: skip
    if NKB > 2:
        dk = 2 * KB + tl.arange(0, KB)
        acc = tl.dot(_rows(x, rows, stride, dk, mask_rows[:, None] & (dk < DK)[None, :]), s2,
                     acc, input_precision=PREC)  # fmt: skip
        dk = 3 * KB + tl.arange(0, KB)
        acc = tl.dot(_rows(x, rows, stride, dk, mask_rows[:, None] & (dk < DK)[None, :]), s3,
                     acc, input_precision=PREC)  # fmt: skip
    return acc


@triton.jit
def _next_block(s, b: tl.constexpr, KB: tl.constexpr, k, open_k, rows, r0, n, HK, DK, scale,
                decay_to_end, vn, PREC: tl.constexpr):  # fmt: skip
    # (b) S' = e^gamma_(C-1) S + sum_j e^(gamma_(C-1) - gamma_j) k_j vn_j^T, a whole tile, for
    # the state's rows b*KB .. b*KB+KB-1.
    dk = b * KB + tl.arange(0, KB)
    kt = _tile(k, open_k, rows, r0, n, HK * DK, HK * DK, dk, dk < DK)
    kw = kt * decay_to_end[:, None]
    return scale * s + tl.dot(tl.trans(kw), vn, input_precision=PREC)


@triton.jit
def _gdn_chunk_state_kernel(
    q, k, open_k, ws_w, ws_u, ws_gamma, ws_p, state, out, bounds,
    task_pos, task_row, task_n, task_cu, starts, ends, slots, bound_at, bound_index,
    s_slot, k_slot, HK, HV, DK, DV, C: tl.constexpr, KB: tl.constexpr, NKB: tl.constexpr,
    BV: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    h = tl.program_id(0)
    tile = tl.program_id(1)
    seq = tl.program_id(2)
    slot = tl.load(slots + seq).to(tl.int64)
    start = tl.load(starts + seq)
    end = tl.load(ends + seq)
    first_boundary = (start // C + 1) * C
    bound_index += tl.load(bound_at + seq)
    kh = h // (HV // HK)
    rows = tl.arange(0, C)
    dv = tile * BV + tl.arange(0, BV)
    mv = dv < DV
    open_k += slot * k_slot + kh * DK
    s_ptr = state + slot * s_slot + h * DK * DV
    # The chunk-start state in blocks of KB key rows (unused blocks stay zero, never read).
    s0 = _state_block(s_ptr, 0, KB, DK, DV, dv, mv)
    s1 = tl.zeros((KB, BV), tl.float32)
    s2 = tl.zeros((KB, BV), tl.float32)
    s3 = tl.zeros((KB, BV), tl.float32)
    if NKB > 1:
        s1 = _state_block(s_ptr, 1, KB, DK, DV, dv, mv)
    if NKB > 2:
        s2 = _state_block(s_ptr, 2, KB, DK, DV, dv, mv)
        s3 = _state_block(s_ptr, 3, KB, DK, DV, dv, mv)
    for task in range(tl.load(task_cu + seq), tl.load(task_cu + seq + 1)):
        pos = tl.load(task_pos + task)
        row = tl.load(task_row + task).to(tl.int64)
        n = tl.load(task_n + task)
        r0 = pos % C
        mine = (rows >= r0) & (rows < r0 + n)
        ws = task * HV + h
        gamma = tl.load(ws_gamma + ws * C + rows)
        u = _rows(ws_u + ws * C * DV, rows, DV, dv, mv[None, :])
        # vn = u - w S, the corrected values (rows past the tile's last are zero in w and u)
        vn = u - _times_state(ws_w + ws * C * DK, rows, DK, DK, s0, s1, s2, s3, KB, NKB,
                              PREC, rows >= 0)  # fmt: skip
        # (c) out_i = e^gamma_i q_i S + sum_{j<=i} P[i, j] vn_j, + 0.0 so that an exactly
        # zero sum is +0 in every schedule (the reference's docstring).
        qs = _times_state(q + (row - r0) * HK * DK + kh * DK, rows, HK * DK, DK, s0, s1,
                          s2, s3, KB, NKB, PREC, mine)  # fmt: skip
        p = tl.load(ws_p + (ws * C + rows[:, None]) * C + rows[None, :])
        o = (tl.exp(gamma)[:, None] * qs + tl.dot(p, vn, input_precision=PREC)) + 0.0
        tl.store(out + (row + rows - r0)[:, None] * HV * DV + h * DV + dv[None, :], o,
                 mask=mine[:, None] & mv[None, :])  # fmt: skip
        if r0 + n == C:
            last = tl.sum(tl.where(rows == C - 1, gamma, 0.0), axis=0)
            scale = tl.exp(last)
            to_end = tl.exp(last - gamma)
            kt = k + row * HK * DK + kh * DK
            s0 = _next_block(s0, 0, KB, kt, open_k, rows, r0, n, HK, DK, scale, to_end, vn, PREC)
            if NKB > 1:
                s1 = _next_block(s1, 1, KB, kt, open_k, rows, r0, n, HK, DK, scale, to_end, vn,
                                 PREC)  # fmt: skip
            if NKB > 2:
                s2 = _next_block(s2, 2, KB, kt, open_k, rows, r0, n, HK, DK, scale, to_end, vn,
                                 PREC)  # fmt: skip
                s3 = _next_block(s3, 3, KB, kt, open_k, rows, r0, n, HK, DK, scale, to_end, vn,
                                 PREC)  # fmt: skip
            p_end = pos - r0 + C
            if p_end < end:  # a boundary at the last row is the state the call ends in
                b = tl.load(bound_index + (p_end - first_boundary) // C).to(tl.int64)
                if b >= 0:  # a captured one
                    b_ptr = bounds + (b * HV + h) * DK * DV
                    _store_state_block(b_ptr, s0, 0, KB, DK, DV, dv, mv)
                    if NKB > 1:
                        _store_state_block(b_ptr, s1, 1, KB, DK, DV, dv, mv)
                    if NKB > 2:
                        _store_state_block(b_ptr, s2, 2, KB, DK, DV, dv, mv)
                        _store_state_block(b_ptr, s3, 3, KB, DK, DV, dv, mv)
    if end // C != start // C:  # a chunk closed: S moved
        _store_state_block(s_ptr, s0, 0, KB, DK, DV, dv, mv)
        if NKB > 1:
            _store_state_block(s_ptr, s1, 1, KB, DK, DV, dv, mv)
        if NKB > 2:
            _store_state_block(s_ptr, s2, 2, KB, DK, DV, dv, mv)
            _store_state_block(s_ptr, s3, 3, KB, DK, DV, dv, mv)


def chunked_delta_rule_pooled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    open_k: torch.Tensor,
    open_v: torch.Tensor,
    open_g: torch.Tensor,
    open_beta: torch.Tensor,
    seqs: PooledRows,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked rule over a step's sequences: q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T,
    Hv] (float32, contiguous, sequences back to back as `seqs.cu` says), each continuing the
    state [S, Hv, Dk, Dv] and open rows (open_k [S, C, Hk, Dk], open_v [S, C, Hv, Dv], open_g,
    open_beta [S, C, Hv]: the chunk's earlier rows as they arrived) of its slot in place (a
    pool's layer: slot strides may exceed one slot). Returns out [T, Hv, Dv] and the captured
    boundary states [N, Hv, Dk, Dv] (`seqs.boundaries` order). A decode step is a call with
    one row per sequence: the same kernels, its chunk's earlier rows read from the slot."""
    tensors = (q, k, v, g, beta)
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
        raise ValueError("chunked_delta_rule wants contiguous float32 tensors")
    t_rows, hk, dk = q.shape
    hv, dv, chunk = v.shape[1], v.shape[2], open_k.shape[1]
    if (hv % hk or state.shape[1:] != (hv, dk, dv) or chunk & (chunk - 1) or chunk < 16
            or dk > KB * MAX_BLOCKS or seqs.task_cu is None):  # fmt: skip
        raise ValueError(f"chunked_delta_rule: q [n, Hk, Dk] {tuple(q.shape)} (Dk <= "
                         f"{KB * MAX_BLOCKS}), v {tuple(v.shape)}, state "
                         f"{tuple(state.shape)}, chunk {chunk} (a power of two >= 16), "
                         "PooledRows with chunk tasks")  # fmt: skip
    for pool in (state, open_k, open_v, open_g, open_beta):
        if not pool[0].is_contiguous() or pool.dtype != torch.float32:
            raise ValueError("chunked_delta_rule: each slot of the state pool contiguous float32")
    dev = q.device
    out = torch.empty((t_rows, hv, dv), dtype=torch.float32, device=dev)
    bounds = torch.empty((seqs.bound_count, hv, dk, dv), dtype=torch.float32, device=dev)
    tasks, b = seqs.task_count, seqs.starts.numel()
    if not (t_rows and tasks):
        return out, bounds
    ws_w = torch.empty((tasks, hv, chunk, dk), dtype=torch.float32, device=dev)
    ws_u = torch.empty((tasks, hv, chunk, dv), dtype=torch.float32, device=dev)
    ws_gamma = torch.empty((tasks, hv, chunk), dtype=torch.float32, device=dev)
    ws_p = torch.empty((tasks, hv, chunk, chunk), dtype=torch.float32, device=dev)
    opts = _opts(dev)
    bk, bvf = max(16, triton.next_power_of_2(dk)), max(16, triton.next_power_of_2(dv))
    kb, vb = min(KB, bk), min(KB, bvf)
    _gdn_chunk_wy_kernel[(tasks, hv)](
        q, k, v, g, beta, open_k, open_v, open_g, open_beta, ws_w, ws_u, ws_gamma, ws_p,
        seqs.task_seq, seqs.task_pos, seqs.task_row, seqs.task_n, seqs.slots,
        open_k.stride(0), open_v.stride(0), open_g.stride(0), open_beta.stride(0),
        hk, hv, dk, dv, C=chunk, KB=kb, NKB=bk // kb, VB=vb, NVB=bvf // vb,
        PREC=DOT_PRECISION, num_warps=WY_WARPS, **opts,
    )  # fmt: skip
    bv = min(BLOCK_V, bvf)
    _gdn_chunk_state_kernel[(hv, triton.cdiv(dv, bv), b)](
        q, k, open_k, ws_w, ws_u, ws_gamma, ws_p, state, out, bounds,
        seqs.task_pos, seqs.task_row, seqs.task_n, seqs.task_cu, seqs.starts, seqs.ends,
        seqs.slots, seqs.bound_at, seqs.bound_index, state.stride(0), open_k.stride(0),
        hk, hv, dk, dv, C=chunk, KB=kb, NKB=bk // kb, BV=bv, PREC=DOT_PRECISION,
        num_warps=STATE_WARPS, num_stages=STATE_STAGES, **opts,
    )  # fmt: skip
    _gdn_open_rows_kernel[(b, hv)](
        k, v, g, beta, open_k, open_v, open_g, open_beta, seqs.task_pos, seqs.task_row,
        seqs.task_n, seqs.task_cu, seqs.slots, open_k.stride(0), open_v.stride(0),
        open_g.stride(0), open_beta.stride(0), hk, hv, dk, dv, C=chunk, BK=bk, BVF=bvf,
        num_warps=1, **opts,
    )  # fmt: skip
    return out, bounds


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    open_k: torch.Tensor,
    open_v: torch.Tensor,
    open_g: torch.Tensor,
    open_beta: torch.Tensor,
    start: int,
) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
    """One sequence (`lockstep.ops.chunked_delta.chunked_delta_rule`'s contract): the state
    and open rows updated in place; returns out [n, Hv, Dv] and the state at every multiple
    of C in (start, start + n]. A pool of one slot of `chunked_delta_rule_pooled`."""
    n, chunk = q.shape[0], open_k.shape[0]
    seqs = PooledRows.build([n], [start], [0], chunk, q.device)
    out, bounds = chunked_delta_rule_pooled(
        q, k, v, g, beta, state[None], open_k[None], open_v[None], open_g[None],
        open_beta[None], seqs,
    )  # fmt: skip
    found = [(p, bounds[i]) for i, (_, p) in enumerate(seqs.boundaries)]
    if n and (start + n) % chunk == 0:
        found.append((start + n, state.clone()))
    return out, found


def _opts(device: torch.device) -> dict:
    """Launch options: contraction off, so each formula rounds as written whatever code the
    compiler makes (the interpreter never contracts); PDL for calls of every row count, so
    a decode step and a prefill run one compiled kernel (as lockstep/ops/triton/gated_delta.py
    launches its kernels)."""
    opts = pdl_launch(device, 0)
    if not interpreting():
        opts["enable_fp_fusion"] = False
    return opts
