"""Gated DeltaNet on the GPU: the gated delta rule in chunks at absolute positions, and the
element-wise gates and norms of a linear-attention layer (lockstep.models.linear_attention).

`gated_delta_rule_pooled` runs one program per (value head, tile of BV value columns,
sequence) over that sequence's rows in order, all sequences of a step in one launch, each
continuing the state of its slot in a state pool (lockstep.models.linear_attention). It keeps
the boundary state tile S [Dk, BV], the open chunk's keys [C, Dk], cumulative log decays [C]
and corrected values [C, BV] in registers, and computes each row r of chunk c with the
formula of the CPU kernel (`gdn_rule`, csrc/lockstep_cpu.cpp):

    u_r   = beta_r (v_r - e^gamma_r S^T k_r) - sum_{j<r} beta_r (k_r.k_j) e^(gamma_r-gamma_j) u_j
    out_r = e^gamma_r S^T q_r + sum_{j<=r} (q_r.k_j) e^(gamma_r-gamma_j) u_j
    S'    = e^gamma_(C-1) S + sum_j e^(gamma_(C-1)-gamma_j) k_j u_j^T    (after row C-1,
            one outer product after another, j ascending)

Sums run over the whole chunk with the rows after r masked to zero, so every row, whatever
the step it is computed in, goes through the same reductions of the same shapes: a one-row
decode step and a prefill give the same bits. The bits differ from the CPU's (the contract is
per device type). No program reads what another writes in the same launch: the open keys
and decays, shared by a head's tiles (and a key head's group), are only read there and written
by a second kernel after it; each tile owns its value columns of S and of the open rows. Row
counts and starts are read from memory, never specialized on, and multiply-add contraction
is off, so a one-row call runs the code a long one does, whatever its batch-mates.
The rows run one after another (O(n C Dk) per program), which bounds prefill speed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lockstep.ops.base import PooledRows
from lockstep.ops.triton.launch import interpreting, pdl_launch, wait_for_inputs

# Value columns per program (a power of two; Dv is padded to it).
BLOCK_V = 32


@triton.jit
def _gdn_rule_kernel(
    q, k, v, g, beta, state, open_k, open_gamma, open_u, out, bounds,
    cu, starts, slots, bound_at, bound_index, s_slot, k_slot, g_slot, u_slot, HK, HV, DK, DV,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # One program per (value head, value tile, sequence). Each sequence's row count, first
    # position and slot are read from memory, never specialized on: a one-row decode step
    # runs the code a long prefill does (docs/gpu.md, "gated_delta.py").
    wait_for_inputs(PDL)
    h = tl.program_id(0)
    tile = tl.program_id(1)
    seq = tl.program_id(2)
    r0 = tl.load(cu + seq)
    n = tl.load(cu + seq + 1) - r0
    start = tl.load(starts + seq)
    slot = tl.load(slots + seq).to(tl.int64)
    first_boundary = (start // C + 1) * C
    q += r0 * HK * DK
    k += r0 * HK * DK
    v += r0 * HV * DV
    g += r0 * HV
    beta += r0 * HV
    out += r0 * HV * DV
    state += slot * s_slot
    open_k += slot * k_slot
    open_gamma += slot * g_slot
    open_u += slot * u_slot
    bound_index += tl.load(bound_at + seq)
    kh = h // (HV // HK)
    dk = tl.arange(0, BK)
    dv = tile * BV + tl.arange(0, BV)
    rows = tl.arange(0, C)
    mk, mv = dk < DK, dv < DV
    s_ptr = state + h * DK * DV + dk[:, None] * DV + dv[None, :]
    s = tl.load(s_ptr, mask=mk[:, None] & mv[None, :], other=0.0)
    # The open keys and decays are read here and written by `_gdn_open_rows_kernel` after
    # this launch: the programs of a head (and of a key head's group) share them.
    kk = tl.load(open_k + (rows[:, None] * HK + kh) * DK + dk[None, :], mask=mk[None, :],
                 other=0.0)  # fmt: skip
    gammas = tl.load(open_gamma + rows * HV + h)
    uu = tl.load(open_u + (rows[:, None] * HV + h) * DV + dv[None, :], mask=mv[None, :], other=0.0)
    for i in range(0, n):
        p = start + i
        r = p % C
        qi = tl.load(q + (i * HK + kh) * DK + dk, mask=mk, other=0.0)
        ki = tl.load(k + (i * HK + kh) * DK + dk, mask=mk, other=0.0)
        vi = tl.load(v + (i * HV + h) * DV + dv, mask=mv, other=0.0)
        bi = tl.load(beta + i * HV + h)
        prev = tl.sum(tl.where(rows == r - 1, gammas, 0.0), axis=0)
        gam = tl.where(r == 0, 0.0, prev) + tl.load(g + i * HV + h)
        gammas = tl.where(rows == r, gam, gammas)
        kk = tl.where(rows[:, None] == r, ki[None, :], kk)
        e = tl.exp(gam)
        ks = tl.sum(s * ki[:, None], axis=0)
        qs = tl.sum(s * qi[:, None], axis=0)
        decay = tl.exp(tl.where(rows <= r, gam - gammas, float("-inf")))
        a = tl.where(rows < r, (bi * tl.sum(kk * ki[None, :], axis=1)) * decay, 0.0)
        u = bi * (vi - e * ks) - tl.sum(a[:, None] * uu, axis=0)
        uu = tl.where(rows[:, None] == r, u[None, :], uu)
        # Row r's corrected values go to the slot now (this program owns its value columns
        # of them), where the boundary update below reads them back.
        tl.store(open_u + (r * HV + h) * DV + dv, u, mask=mv)
        c = tl.sum(kk * qi[None, :], axis=1) * decay
        o = e * qs + tl.sum(c[:, None] * uu, axis=0)
        tl.store(out + (i * HV + h) * DV + dv, o, mask=mv)
        if r == C - 1:
            # S' = e S + sum_j (w_j k_j) u_j^T, one outer product at a time in ascending j,
            # each row j loaded from memory: its key from the step's rows (or the slot's,
            # for rows of earlier calls), u_j from the slot, where every row's u already
            # is (the barrier makes this program's own stores visible to all its threads).
            # Not a tl.dot: with one, on an H200, the boundary state (though no row's
            # output) depended on how many open rows the call had loaded from memory.
            tl.debug_barrier()
            s = s * e
            for j in range(0, C):
                gj = tl.sum(tl.where(rows == j, gammas, 0.0), axis=0)
                pj = p - r + j
                k_step = k + ((pj - start) * HK + kh) * DK + dk
                k_slot_row = open_k + (j * HK + kh) * DK + dk
                kj = tl.load(tl.where(pj >= start, k_step, k_slot_row), mask=mk, other=0.0)
                uj = tl.load(open_u + (j * HV + h) * DV + dv, mask=mv, other=0.0)
                s = s + (kj * tl.exp(gam - gj))[:, None] * uj[None, :]
            if i < n - 1:  # a boundary at the last row is the state the call ends in
                b = tl.load(bound_index + (p + 1 - first_boundary) // C).to(tl.int64)
                if b >= 0:  # a captured one
                    tl.store(bounds + (b * HV + h) * DK * DV + dk[:, None] * DV + dv[None, :],
                             s, mask=mk[:, None] & mv[None, :])  # fmt: skip
    if (start + n) // C != start // C:  # a chunk closed: S moved (a decode step rarely)
        tl.store(s_ptr, s, mask=mk[:, None] & mv[None, :])


@triton.jit
def _gdn_open_rows_kernel(
    k, g, open_k, open_gamma, cu, starts, slots, k_slot, g_slot, HK, HV, DK,
    C: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # After `_gdn_rule_kernel`: the rows of each sequence's last chunk that the call added,
    # keys copied and cumulative log decays summed as that kernel sums them (one add per
    # row from the chunk's start, or from the previous call's last row).
    wait_for_inputs(PDL)
    seq = tl.program_id(0)
    h = tl.program_id(1)
    r0 = tl.load(cu + seq)
    n = tl.load(cu + seq + 1) - r0
    start = tl.load(starts + seq)
    slot = tl.load(slots + seq).to(tl.int64)
    open_k += slot * k_slot
    open_gamma += slot * g_slot
    end = start + n
    first = tl.maximum(start, ((end - 1) // C) * C)
    kh = h // (HV // HK)
    dk = tl.arange(0, BK)
    mk = dk < DK
    prev = tl.load(open_gamma + ((first % C) - 1) * HV + h, mask=(n > 0) & (first % C > 0),
                   other=0.0)  # fmt: skip
    for p in range(first, end):
        r = p % C
        i = p - start
        gam = tl.where(r == 0, 0.0, prev) + tl.load(g + (r0 + i) * HV + h)
        tl.store(open_gamma + r * HV + h, gam)
        prev = gam
        if h % (HV // HK) == 0:
            ki = tl.load(k + ((r0 + i) * HK + kh) * DK + dk, mask=mk, other=0.0)
            tl.store(open_k + (r * HK + kh) * DK + dk, ki, mask=mk)


def gated_delta_rule_pooled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    open_k: torch.Tensor,
    open_gamma: torch.Tensor,
    open_u: torch.Tensor,
    seqs: PooledRows,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over a step's sequences in one launch: q, k [T, Hk, Dk], v [T, Hv, Dv], g,
    beta [T, Hv] (float32, contiguous, sequences back to back as `seqs.cu` says), each
    continuing the state [S, Hv, Dk, Dv] and open rows (open_k [S, C, Hk, Dk], open_gamma
    [S, C, Hv], open_u [S, C, Hv, Dv]) of its slot in place (each a pool's layer: slot
    strides may exceed one slot). Returns out [T, Hv, Dv] and the captured boundary states [N,
    Hv, Dk, Dv] (`seqs.boundaries` order: crossed before a sequence's last row and kept; one at
    the last row is the state the slot ends in). Per row the arithmetic the module docstring states."""
    tensors = (q, k, v, g, beta)
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
        raise ValueError("gated_delta_rule wants contiguous float32 tensors")
    t_rows, hk, dk = q.shape
    hv, dv, chunk = v.shape[1], v.shape[2], open_k.shape[1]
    if hv % hk or state.shape[1:] != (hv, dk, dv) or chunk & (chunk - 1):
        raise ValueError(f"gated_delta_rule: q [n, Hk, Dk] {tuple(q.shape)}, v {tuple(v.shape)}, "
                         f"state {tuple(state.shape)}, chunk {chunk} (a power of two)")  # fmt: skip
    for pool in (state, open_k, open_gamma, open_u):
        if not pool[0].is_contiguous() or pool.dtype != torch.float32:
            raise ValueError("gated_delta_rule: each slot of the state pool contiguous float32")
    out = torch.empty((t_rows, hv, dv), dtype=torch.float32, device=q.device)
    bounds = torch.empty((seqs.bound_count, hv, dk, dv), dtype=torch.float32, device=q.device)
    b = seqs.starts.numel()
    if t_rows and b:
        opts = _opts(q.device)
        grid = (hv, triton.cdiv(dv, BLOCK_V), b)
        _gdn_rule_kernel[grid](
            q, k, v, g, beta, state, open_k, open_gamma, open_u, out, bounds,
            seqs.cu, seqs.starts, seqs.slots, seqs.bound_at, seqs.bound_index,
            state.stride(0), open_k.stride(0), open_gamma.stride(0), open_u.stride(0),
            hk, hv, dk, dv, C=chunk, BK=triton.next_power_of_2(dk), BV=BLOCK_V, num_warps=4,
            **opts,
        )  # fmt: skip
        _gdn_open_rows_kernel[(b, hv)](
            k, g, open_k, open_gamma, seqs.cu, seqs.starts, seqs.slots,
            open_k.stride(0), open_gamma.stride(0), hk, hv, dk,
            C=chunk, BK=triton.next_power_of_2(dk), num_warps=1, **opts,
        )  # fmt: skip
    return out, bounds


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    open_k: torch.Tensor,
    open_gamma: torch.Tensor,
    open_u: torch.Tensor,
    start: int,
) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
    """`Ops.gated_delta_rule` (lockstep.ops.base): float32 contiguous tensors, the state and
    open rows updated in place; returns out [n, Hv, Dv] and the state at every multiple of C
    in (start, start + n]. One sequence of `gated_delta_rule_pooled` (a pool of one slot)."""
    n, chunk = q.shape[0], open_k.shape[0]
    seqs = PooledRows.build([n], [start], [0], chunk, q.device)
    out, bounds = gated_delta_rule_pooled(
        q, k, v, g, beta, state[None], open_k[None], open_gamma[None], open_u[None], seqs
    )
    found = [(p, bounds[i]) for i, (_, p) in enumerate(seqs.boundaries)]
    if n and (start + n) % chunk == 0:
        found.append((start + n, state.clone()))
    return out, found


@triton.jit
def _conv_silu_kernel(
    mixed, windows, weight, out, cu, slots, row_seq, x_row, w_slot, CD,
    K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # Row t of the step: silu(sum_tap x[t - K + 1 + tap] * w[tap]) with the taps ascending,
    # one multiply and one add each, rows before the step's first read from the slot's window.
    wait_for_inputs(PDL)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < CD
    seq = tl.load(row_seq + t)
    r0 = tl.load(cu + seq)
    i = t - r0
    windows += tl.load(slots + seq).to(tl.int64) * w_slot
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for tap in tl.static_range(K):
        j = i - (K - 1) + tap
        in_step = (cols * 0 + j) >= 0  # the row's source, as a vector mask
        from_rows = tl.load(mixed + (r0 + j).to(tl.int64) * x_row + cols, mask=mask & in_step,
                            other=0.0).to(tl.float32)  # fmt: skip
        from_window = tl.load(windows + (K - 1 + j) * CD + cols, mask=mask & ~in_step, other=0.0)
        x = tl.where(in_step, from_rows, from_window)
        w = tl.load(weight + cols * K + tap, mask=mask, other=0.0)
        if tap == 0:
            acc = x * w
        else:
            acc = acc + x * w
    # silu as `gate_activation` computes it (1 * act is exact).
    tl.store(out + t.to(tl.int64) * CD + cols, acc / (1.0 + tl.exp(-acc)), mask=mask)


@triton.jit
def _conv_window_kernel(
    mixed, windows, dest, cu, starts, slots, req_seq, req_end, req_dest, x_row, w_slot, d_slot,
    CD, K1: tl.constexpr, K1P: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # Request e: the K1 pre-convolution rows before position req_end[e] of sequence
    # req_seq[e] (from the step's rows, or before its first from the slot's window) into
    # dest[req_dest[e]]. All loads before any store: dest may be the window it reads.
    wait_for_inputs(PDL)
    e = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seq = tl.load(req_seq + e)
    r0 = tl.load(cu + seq)
    windows += tl.load(slots + seq).to(tl.int64) * w_slot
    dest += tl.load(req_dest + e).to(tl.int64) * d_slot
    w = tl.arange(0, K1P)
    j = tl.load(req_end + e) - tl.load(starts + seq) - K1 + w
    m = (w < K1)[:, None] & (cols < CD)[None, :]
    from_rows = tl.load(mixed + (r0 + j).to(tl.int64)[:, None] * x_row + cols[None, :],
                        mask=m & (j >= 0)[:, None], other=0.0).to(tl.float32)  # fmt: skip
    from_window = tl.load(windows + (K1 + j)[:, None] * CD + cols[None, :],
                          mask=m & (j < 0)[:, None], other=0.0)  # fmt: skip
    x = tl.where((j >= 0)[:, None], from_rows, from_window)
    tl.debug_barrier()
    tl.store(dest + w[:, None] * CD + cols[None, :], x, mask=m)


CONV_BLOCK = 256


def causal_conv_silu_pooled(
    mixed: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor, seqs: PooledRows
) -> torch.Tensor:
    """The short convolution and SiLU of a step's rows: mixed [T, CD] (any float dtype, rows
    may be strided), each sequence's window [K-1, CD] (float32) at its slot of `windows` [S,
    K-1, CD], weight [CD, K] (float32) -> float32 [T, CD]. Windows are not updated here
    (`update_conv_windows`)."""
    t_rows, cd = mixed.shape
    k = weight.shape[1]
    _check_windows(mixed, windows, weight)
    out = torch.empty((t_rows, cd), dtype=torch.float32, device=mixed.device)
    if t_rows:
        _conv_silu_kernel[(t_rows, triton.cdiv(cd, CONV_BLOCK))](
            mixed, windows, weight, out, seqs.cu, seqs.slots, seqs.row_seq, mixed.stride(0),
            windows.stride(0), cd, K=k, BLOCK=CONV_BLOCK, num_warps=4, **_opts(mixed.device),
        )  # fmt: skip
    return out


def update_conv_windows(
    mixed: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor, seqs: PooledRows
) -> torch.Tensor:
    """After `causal_conv_silu_pooled` on the same step: returns the window at each of the
    step's boundaries [N, K-1, CD] (`seqs.boundaries` order), then moves each sequence's
    window in its slot to the step's end, in place."""
    cd, k1 = mixed.shape[1], weight.shape[1] - 1
    _check_windows(mixed, windows, weight)
    found = torch.empty((seqs.bound_count, k1, cd), dtype=torch.float32, device=mixed.device)
    requests = [(seqs.bound_seq, seqs.bound_pos, seqs.bound_ids, found),
                (seqs.seq_ids, seqs.ends, seqs.slots, windows)]  # fmt: skip
    for req_seq, req_end, req_dest, dest in requests:
        if req_seq.numel() and k1:
            _conv_window_kernel[(req_seq.numel(), triton.cdiv(cd, CONV_BLOCK))](
                mixed, windows, dest, seqs.cu, seqs.starts, seqs.slots, req_seq, req_end,
                req_dest, mixed.stride(0), windows.stride(0), dest.stride(0), cd, K1=k1,
                K1P=triton.next_power_of_2(k1), BLOCK=CONV_BLOCK, num_warps=4,
                **_opts(mixed.device),
            )  # fmt: skip
    return found


def _check_windows(mixed: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor) -> None:
    cd, k = mixed.shape[1], weight.shape[1]
    if (mixed.stride(1) != 1 or windows.dtype != torch.float32 or weight.dtype != torch.float32
            or not weight.is_contiguous() or windows.shape[1:] != (k - 1, cd)
            or not windows[0].is_contiguous() or weight.shape[0] != cd):  # fmt: skip
        raise ValueError(f"causal conv: mixed {tuple(mixed.shape)} (unit column stride), "
                         f"windows {tuple(windows.shape)} float32, weight {tuple(weight.shape)} "
                         "float32 contiguous")  # fmt: skip


def _opts(device: torch.device) -> dict:
    """Launch options of every kernel here: multiply-add contraction off, so each formula
    rounds as written whatever code the compiler makes of a call's shape (the interpreter
    takes no compiler options and never contracts); PDL on wherever the device has it, for
    calls of every row count (elsewhere only up to `PDL_MAX_ROWS`), so that a one-row decode
    step and a long prefill run one compiled kernel, not two variants."""
    opts = pdl_launch(device, 0)
    if not interpreting():
        opts["enable_fp_fusion"] = False
    return opts


@triton.jit
def _gates_kernel(a, b, a_log, dt_bias, g, beta, total, H, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    head = offs % H
    x = tl.load(a + offs, mask=mask, other=0.0) + tl.load(dt_bias + head, mask=mask, other=0.0)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    tl.store(g + offs, -(tl.exp(tl.load(a_log + head, mask=mask, other=0.0)) * softplus), mask=mask)
    bv = tl.load(b + offs, mask=mask, other=0.0)
    tl.store(beta + offs, 1.0 / (1.0 + tl.exp(-bv)), mask=mask)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), per element of [T, H]."""
    a, b = a.float().contiguous(), b.float().contiguous()
    g, beta = torch.empty_like(a), torch.empty_like(b)
    if a.numel():
        _gates_kernel[(triton.cdiv(a.numel(), 1024),)](
            a, b, a_log.float().contiguous(), dt_bias.float().contiguous(), g, beta, a.numel(),
            a.shape[1], BLOCK=1024, **_opts(a.device),
        )  # fmt: skip
    return g, beta


@triton.jit
def _l2_kernel(x, y, D, eps, scale, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    h = tl.load(x + row * D + offs, mask=mask, other=0.0)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, 0) + eps)
    tl.store(y + row * D + offs, (h * inv) * scale, mask=mask)


def l2_normalize(x: torch.Tensor, eps: float, scale: float) -> torch.Tensor:
    """x [R, D] -> x / sqrt(sum(x^2) + eps) * scale, one row per program."""
    x = x.float().contiguous()
    y = torch.empty_like(x)
    if x.shape[0]:
        block = triton.next_power_of_2(x.shape[1])
        _l2_kernel[(x.shape[0],)](
            x, y, x.shape[1], float(eps), float(scale), BLOCK=block,
            **_opts(x.device),
        )  # fmt: skip
    return y


@triton.jit
def _gate_kernel(x, gate, y, total, SIGMOID: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    xv = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
    gv = tl.load(gate + offs, mask=mask, other=0.0).to(tl.float32)
    act = 1.0 / (1.0 + tl.exp(-gv)) if SIGMOID else gv / (1.0 + tl.exp(-gv))
    tl.store(y + offs, (xv * act).to(y.dtype.element_ty), mask=mask)


def gate_activation(x: torch.Tensor, gate: torch.Tensor, kind: str) -> torch.Tensor:
    """x * sigmoid(gate) ("sigmoid") or x * silu(gate) ("silu"), per element, in x's dtype."""
    if kind not in ("sigmoid", "silu") or x.shape != gate.shape:
        raise ValueError(f"gate_activation: kind {kind!r} (sigmoid or silu), shapes "
                         f"{tuple(x.shape)} and {tuple(gate.shape)} must agree")  # fmt: skip
    x, gate = x.contiguous(), gate.contiguous()
    y = torch.empty_like(x)
    if x.numel():
        _gate_kernel[(triton.cdiv(x.numel(), 1024),)](
            x, gate, y, x.numel(), SIGMOID=kind == "sigmoid", BLOCK=1024,
            **_opts(x.device),
        )  # fmt: skip
    return y
