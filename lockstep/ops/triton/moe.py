"""Routed experts on the GPU (`Ops.moe`, contract in `lockstep/ops/moe.py`): routing, grouping,
a grouped per-expert GEMM and the rank-order combine, with no host synchronization.

One sparse layer, x [T, H], k experts per token, S = T * k slots (slot = token * k + rank):

    router   matmul(x, router, out_dtype=float32)                     [T, E] fp32 logits
    route    one program per token: top k (ties -> lower id), softmax weights   [T, k]
             (DeepSeek layers: grouped choice with a correction bias, `route_deepseek`)
    group    slots sorted by expert id, stably, by counting (one program up to 128 slots,
             else per-block counts, a scan over blocks, placement); offsets[e] = first of e
    gate_up  grouped GEMM over sorted slots, rows gathered from x, gate and up columns in one
             program, SiLU(gate) * up in the epilogue                  h [S, I] (sorted order)
    down     grouped GEMM over h, each row stored at its slot           y [S, H] (slot order)
    combine  out[t] = w_0 y_0 + ... + w_{k-1} y_{k-1}, fp32, ascending rank, one rounding

The grouped GEMM's grid is static for a given S (a CUDA graph holds it): programs cover
cdiv(S, BM) + min(E, S) row tiles (the most that S slots over E experts can need) times the
column tiles, and each program finds its expert from `offsets` in its prologue; programs past
the last real tile exit at once. So only experts that received slots have their weights read.

The numerics of a slot's output row (what every config computes):

  * each output element is the dense matmul's K order (`matmul.py`): K cut at the same split
    points (`split_count`), each split a tl.dot loop over ascending K blocks from zero, the
    splits folded ((0 + p0) + p1) in ascending order; rows are never mixed (no split-K over
    programs, nothing reduced across rows), so a row's bits do not depend on which rows share
    its tile, how many slots its expert received, or the tile config (the same observation on
    an H200 that keeps the dense matmul M-invariant; tests re-check it);
  * gate and up are rounded to x's dtype before SiLU(gate) * up, in `activation.py`'s formula,
    and h and y are rounded to x's dtype: the same roundings as the unfused path
    (`linear`, `silu_mul`, `linear`);
  * the combine keeps a * b + c as two roundings (contraction off), as
    `combine_in_rank_order` writes it.

Tile configs come from `GATE_UP_TABLE` / `DOWN_TABLE`, keyed by S (never autotuned): a speed
choice that never changes a bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lockstep.ops.moe import MoeLayer, Routing, write_routed_experts
from lockstep.ops.triton import matmul
from lockstep.ops.triton.launch import interpreting, pdl_launch, wait_for_inputs


@dataclass(frozen=True)
class GroupedConfig:
    bm: int
    bn: int
    bk: int
    num_warps: int
    num_stages: int


_INF = 1 << 62
_G = GroupedConfig

# (largest S = tokens * k, config), first fit, from CUDA-graph timings of each grouped GEMM
# alone on Qwen3-30B-A3B's shapes (`python -m bench.gpu_moe --sweep`, docs/results.md). Decode
# (S <= 64): 16-row tiles (the smallest MMA), 64 columns, 256-wide K blocks. S <= 4096
# (experts get tens of rows): 32-row tiles. Above: 64 x 128 tiles for gate_up (two
# accumulators) and 128 x 256 for down.
GATE_UP_TABLE: tuple[tuple[int, GroupedConfig], ...] = (
    (64, _G(16, 64, 256, 4, 3)),
    (512, _G(16, 64, 128, 4, 4)),
    (4096, _G(32, 64, 128, 4, 4)),
    (_INF, _G(64, 128, 64, 4, 4)),
)
DOWN_TABLE: tuple[tuple[int, GroupedConfig], ...] = (
    (64, _G(16, 64, 256, 4, 3)),
    (512, _G(16, 64, 128, 4, 4)),
    (4096, _G(32, 64, 128, 4, 4)),
    (_INF, _G(128, 256, 64, 8, 3)),
)


def pick_grouped_config(table: tuple[tuple[int, GroupedConfig], ...], slots: int) -> GroupedConfig:
    for max_slots, cfg in table:
        if slots <= max_slots:
            return cfg
    raise AssertionError("a grouped-GEMM table must end with an unbounded bucket")


def expert_pad(experts: int) -> int:
    """The vector width over experts in the kernels (padding lanes hold no expert)."""
    return max(16, triton.next_power_of_2(experts))


# ---------------------------------------------------------------------------------- routing


@triton.jit
def next_best(values, taken, ids, PAD: tl.constexpr):
    """One pass of a top-k: the largest value not yet taken, the lowest id holding it (ties
    toward the lower id), and `taken` with that id marked."""
    m = tl.max(tl.where(taken, -float("inf"), values), axis=0)
    pick = tl.min(tl.where((values == m) & (~taken), ids, PAD), axis=0)
    return m, pick, taken | (ids == pick)


@triton.jit
def _route_kernel(logits, experts, weights, E, sl, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                  RENORMALIZE: tl.constexpr, E_PAD: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """One token: k passes of (max, lowest id holding it), then w_r = exp(l_r - l_0) / s with
    s summed over the k in ascending rank (renormalize) or over all E by one tl.sum of a
    fixed shape. A NaN logit ranks as -inf, so every pass finds an expert id below E: a row
    of NaN (a padding row's garbage) takes experts 0..k-1 with NaN weights, its own loss.
    An id of E_PAD would send its slots to positions the grouping gives other slots, and
    those tokens would read rows no GEMM wrote."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    ids = tl.arange(0, E_PAD)
    valid = ids < E
    lg = tl.load(logits + row * sl + ids, mask=valid, other=-float("inf"))
    lg = tl.where(lg == lg, lg, -float("inf"))
    taken = ids >= E
    ranks = tl.arange(0, K_PAD)
    top_e = tl.zeros([K_PAD], tl.float32)
    top0 = tl.max(lg, axis=0)
    total = 0.0
    for r in tl.static_range(TOP_K):
        m, e, taken = next_best(lg, taken, ids, E_PAD)
        tl.store(experts + row * TOP_K + r, e.to(tl.int64))
        ex = tl.exp(m - top0)
        total = total + ex
        top_e = tl.where(ranks == r, ex, top_e)
    if not RENORMALIZE:
        total = tl.sum(tl.where(valid, tl.exp(lg - top0), 0.0), axis=0)
    tl.store(weights + row * TOP_K + ranks, top_e / total, mask=ranks < TOP_K)


def router_logits(x: torch.Tensor, layer: MoeLayer) -> torch.Tensor:
    """Contract step 1: fp32 logits [T, E] from the M-invariant matmul (the accumulator's
    bits, never rounded to x's dtype)."""
    return matmul.matmul(x, layer.router, out_dtype=torch.float32)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """Contract steps 2-3 for fp32 logits [T, E]: int64 experts [T, k] in rank order and
    fp32 weights [T, k]."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"route wants fp32 logits [T, E] with E contiguous; got "
                         f"{tuple(logits.shape)} {logits.dtype}")  # fmt: skip
    t, e = logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k={top_k} is invalid: expected 1 to {e} (the experts)")
    experts = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    if t:
        _route_kernel[(t,)](
            logits, experts, weights, e, logits.stride(0), TOP_K=top_k,
            K_PAD=max(2, triton.next_power_of_2(top_k)), RENORMALIZE=renormalize,
            E_PAD=expert_pad(e), num_warps=1 if e <= 256 else 4,
            **pdl_launch(logits.device, t),
        )  # fmt: skip
    return Routing(experts, weights)


@triton.jit
def _route_deepseek_kernel(
    logits, bias, experts, weights, E, sl, routed_scaling, TOP_K: tl.constexpr,
    K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr, GROUPS: tl.constexpr, G_PAD: tl.constexpr,
    TOPK_GROUPS: tl.constexpr, TOP2: tl.constexpr, E_PAD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One token, DeepSeek's steps 2'-3' (`lockstep.ops.moe`): scores s (sigmoid per element,
    or softmax with one tl.sum of a fixed shape), choice c = s + bias; with groups, each
    group's max or top-two sum (the larger plus the next, a tie counted twice) and
    TOPK_GROUPS passes of (max, lowest group holding it); then TOP_K passes of (max, lowest
    id holding it) over the kept groups' c; weights the chosen s, renormalized by
    ((s_0 + s_1) + ...) + 1e-20, times routed_scaling. A NaN choice ranks as -inf, so every
    pass finds an id below E (`_route_kernel`)."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    ids = tl.arange(0, E_PAD)
    valid = ids < E
    lg = tl.load(logits + row * sl + ids, mask=valid, other=-float("inf"))
    if SOFTMAX:
        ex = tl.exp(lg - tl.max(lg, axis=0))
        s = ex / tl.sum(ex, axis=0)
    else:
        s = 1.0 / (1.0 + tl.exp(-lg))
    c = s
    if HAS_BIAS:
        c = c + tl.load(bias + ids, mask=valid, other=0.0)
    c = tl.where(valid & (c == c), c, -float("inf"))
    if GROUPS > 1:
        grp = ids // (E // GROUPS)
        gids = tl.arange(0, G_PAD)
        gs = tl.full([G_PAD], -float("inf"), tl.float32)
        for g in tl.static_range(GROUPS):
            mine = valid & (grp == g)
            best = tl.max(tl.where(mine, c, -float("inf")), axis=0)
            if TOP2:
                first = tl.min(tl.where(mine & (c == best), ids, E_PAD), axis=0)
                best = best + tl.max(tl.where(mine & (ids != first), c, -float("inf")), axis=0)
            gs = tl.where(gids == g, best, gs)
        gtaken = gids >= GROUPS
        keep = ids < 0
        for _ in tl.static_range(TOPK_GROUPS):
            _, pick, gtaken = next_best(gs, gtaken, gids, G_PAD)
            keep = keep | (grp == pick)
        c = tl.where(keep, c, -float("inf"))
    taken = ids >= E
    ranks = tl.arange(0, K_PAD)
    top_w = tl.zeros([K_PAD], tl.float32)
    total = 0.0
    for r in tl.static_range(TOP_K):
        _, e, taken = next_best(c, taken, ids, E_PAD)
        tl.store(experts + row * TOP_K + r, e.to(tl.int64))
        w = tl.sum(tl.where(ids == e, s, 0.0), axis=0)  # one nonzero term: exact
        total = total + w
        top_w = tl.where(ranks == r, w, top_w)
    if RENORMALIZE:
        top_w = top_w / (total + 1e-20)
    tl.store(weights + row * TOP_K + ranks, top_w * routed_scaling, mask=ranks < TOP_K)


def route_deepseek(logits: torch.Tensor, layer: MoeLayer) -> Routing:
    """DeepSeek's steps 2'-3' (`lockstep.ops.moe`) for fp32 logits [T, E] and
    `layer.deepseek`, one program per token (`_route_deepseek_kernel`): every reduction is a
    max, a min of ids or one tl.sum of a fixed shape over the token's own row, so a token's
    experts and weights depend on its logits alone; selection ties go to the lower id (group
    or expert). No host synchronization (CUDA-graph safe)."""
    r = layer.deepseek
    if r is None:
        raise ValueError("route_deepseek wants a layer with DeepSeek routing (layer.deepseek)")
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"route_deepseek wants fp32 logits [T, E] with E contiguous; got "
                         f"{tuple(logits.shape)} {logits.dtype}")  # fmt: skip
    t, e = logits.shape
    if not 1 <= layer.top_k <= e or e % r.groups or not 1 <= r.topk_groups <= r.groups:
        raise ValueError(f"top_k={layer.top_k}, groups={r.groups}, topk_groups="
                         f"{r.topk_groups} are invalid for {e} experts")  # fmt: skip
    if r.scoring not in ("sigmoid", "softmax") or r.group_score not in ("max", "top2_sum"):
        raise ValueError(f"scoring={r.scoring!r} / group_score={r.group_score!r}: expected "
                         "sigmoid or softmax / max or top2_sum")  # fmt: skip
    experts = torch.empty((t, layer.top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((t, layer.top_k), dtype=torch.float32, device=logits.device)
    bias = r.correction_bias
    if t:
        _route_deepseek_kernel[(t,)](
            logits, logits if bias is None else bias.float().contiguous(), experts, weights, e,
            logits.stride(0), float(r.routed_scaling), TOP_K=layer.top_k,
            K_PAD=max(2, triton.next_power_of_2(layer.top_k)), RENORMALIZE=layer.renormalize,
            SOFTMAX=r.scoring == "softmax", HAS_BIAS=bias is not None, GROUPS=r.groups,
            G_PAD=max(2, triton.next_power_of_2(r.groups)), TOPK_GROUPS=r.topk_groups,
            TOP2=r.group_score == "top2_sum", E_PAD=expert_pad(e),
            num_warps=1 if e <= 256 else 4, **pdl_launch(logits.device, t),
        )  # fmt: skip
    return Routing(experts, weights)


def route_layer(logits: torch.Tensor, layer: MoeLayer) -> Routing:
    """Contract steps 2-3, or DeepSeek's 2'-3' for a layer with `deepseek` routing."""
    if layer.deepseek is not None:
        return route_deepseek(logits, layer)
    return route(logits, layer.top_k, layer.renormalize)


# ------------------------------------------------------------------------------- grouped GEMM


@triton.jit
def _k_loop(a_rows, w_cols, k_lo, k_hi, K, acc, EVEN_K: tl.constexpr, BK: tl.constexpr):
    """acc += a[rows, k_lo:k_hi] @ w[cols, k_lo:k_hi].T over ascending K blocks (the dense
    matmul's `_split_sum`, pointer form). a_rows [BM, 1], w_cols [1, BN]: row/col bases."""
    rk = tl.arange(0, BK)
    for kb in range(k_lo, k_hi, BK):
        if EVEN_K:
            a = tl.load(a_rows + (kb + rk)[None, :])
            b = tl.load(w_cols + (kb + rk)[:, None])
        else:
            a = tl.load(a_rows + (kb + rk)[None, :], mask=rk[None, :] < K - kb, other=0.0)
            b = tl.load(w_cols + (kb + rk)[:, None], mask=rk[:, None] < K - kb, other=0.0)
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def expert_tile_rows(offsets, tile_m, E, E_PAD: tl.constexpr, BM: tl.constexpr):
    """Which expert owns row tile `tile_m` of a grouped product (experts' tiles laid end to
    end in id order; e >= E: a spare tile, nothing to do), and the tile's sorted positions:
    in_rows marks the expert's own; padding rows point at a real row (read, never stored)."""
    eids = tl.arange(0, E_PAD)
    lo = tl.load(offsets + eids, mask=eids < E, other=0)
    hi = tl.load(offsets + eids + 1, mask=eids < E, other=0)
    tiles = (hi - lo + BM - 1) // BM
    ends = tl.cumsum(tiles, axis=0)
    e = tl.sum((ends <= tile_m).to(tl.int32), axis=0)
    mine = eids == e
    first_tile = tl.sum(tl.where(mine, ends - tiles, 0), axis=0)
    row_lo = tl.sum(tl.where(mine, lo, 0), axis=0) + (tile_m - first_tile) * BM
    row_hi = tl.sum(tl.where(mine, hi, 0), axis=0)
    pos = row_lo + tl.arange(0, BM)
    in_rows = pos < row_hi
    return e, tl.where(in_rows, pos, row_lo), in_rows


@triton.jit
def store_tile(total, total_up, out, order, pos, in_rows, rn, N, so, SILU: tl.constexpr,
               SCATTER: tl.constexpr):  # fmt: skip
    """A grouped product's epilogue: with SILU, out = silu(gate) * up from the two fp32
    accumulators each rounded to out's dtype first; rows stored at out[order[pos]] (SCATTER)
    or out[pos], the expert's rows and the N real columns only."""
    dtype = out.dtype.element_ty
    if SILU:
        g = total.to(dtype).to(tl.float32)
        u = total_up.to(dtype).to(tl.float32)
        total = g / (1.0 + tl.exp(-g)) * u  # activation.py's formula
    if SCATTER:
        dst = tl.load(order + pos)
    else:
        dst = pos
    ptrs = out + dst.to(tl.int64)[:, None] * so + rn[None, :]
    tl.store(ptrs, total.to(dtype), mask=in_rows[:, None] & (rn[None, :] < N))


@triton.jit(do_not_specialize=["M_TILES"])
def _grouped_kernel(
    a, w, out, order, offsets, N, K, E, M_TILES, SPLIT_LEN, NUM_SPLITS, sa, swe, swn, so,
    GATHER: tl.constexpr, SCATTER: tl.constexpr, SILU: tl.constexpr, TOP_K: tl.constexpr,
    EVEN_K: tl.constexpr, E_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One (row tile, column tile) of the grouped product over expert-sorted slots.
    GATHER: A row p is a[order[p] // TOP_K] (x's token rows), else a[p]. SCATTER: output row
    p goes to out[order[p]] (slot order), else out[p]. SILU: w columns n (gate) and N + n
    (up) in two accumulators, out = silu(gate) * up (w has 2N rows)."""
    wait_for_inputs(PDL)
    pid = tl.program_id(0)
    tile_m = pid % M_TILES
    pid_n = pid // M_TILES
    e, pos, in_rows = expert_tile_rows(offsets, tile_m, E, E_PAD, BM)
    if e < E:
        if GATHER:
            src = tl.load(order + pos) // TOP_K
        else:
            src = pos
        a_rows = a + src.to(tl.int64)[:, None] * sa
        rn = pid_n * BN + tl.arange(0, BN)
        rn_c = tl.where(rn < N, rn, N - 1).to(tl.int64)
        w_gate = w + e.to(tl.int64) * swe + rn_c[None, :] * swn
        total = tl.zeros([BM, BN], tl.float32)
        total_up = tl.zeros([BM, BN], tl.float32)
        for split in range(0, NUM_SPLITS):
            k_lo = split * SPLIT_LEN
            k_hi = tl.minimum(K, k_lo + SPLIT_LEN)
            zero = tl.zeros([BM, BN], tl.float32)
            total = total + _k_loop(a_rows, w_gate, k_lo, k_hi, K, zero, EVEN_K, BK)
            if SILU:
                w_up = w_gate + N * swn
                total_up = total_up + _k_loop(a_rows, w_up, k_lo, k_hi, K, zero, EVEN_K, BK)
        store_tile(total, total_up, out, order, pos, in_rows, rn, N, so, SILU, SCATTER)


def grouped_gemm(
    a: torch.Tensor, w: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, top_k: int,
    *, gather: bool, scatter: bool, silu: bool, config: GroupedConfig, splits: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """The grouped product over S = order.numel() expert-sorted slots (see `_grouped_kernel`
    for gather/scatter/silu). a [rows, K]; w [E, N, K] (silu: N = 2 * half, gate | up);
    order int64 [S]: sorted position -> slot; offsets int64 [E + 1]. Returns [S, N or half].
    `splits` overrides the matmul's split table (tests only: it changes the numerics)."""
    if a.dim() != 2 or w.dim() != 3 or a.shape[1] != w.shape[2]:
        raise ValueError(f"grouped_gemm wants a [M, K] and w [E, N, K]; got {tuple(a.shape)}, "
                         f"{tuple(w.shape)}")  # fmt: skip
    if a.dtype != w.dtype or a.stride(1) != 1 or w.stride(2) != 1:
        raise ValueError(f"grouped_gemm wants equal dtypes ({a.dtype}, {w.dtype}) and K "
                         "contiguous in a and w")  # fmt: skip
    if matmul.SPLIT_ALIGN % config.bk:
        raise ValueError(f"BK {config.bk} must divide SPLIT_ALIGN {matmul.SPLIT_ALIGN}")
    slots = order.numel()
    e, n, k = w.shape
    half = n // 2 if silu else n
    out = torch.empty((slots, half), dtype=a.dtype, device=a.device)
    if slots == 0:
        return out
    split_len = matmul.split_length(k, matmul.split_count(k) if splits is None else splits)
    m_tiles = triton.cdiv(slots, config.bm) + min(e, slots)
    grid = (m_tiles * triton.cdiv(half, config.bn),)
    _grouped_kernel[grid](
        a, w, out, order, offsets, half, k, e, m_tiles, split_len,
        triton.cdiv(k, split_len), a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        GATHER=gather, SCATTER=scatter, SILU=silu, TOP_K=top_k, EVEN_K=k % config.bk == 0,
        E_PAD=expert_pad(e), BM=config.bm, BN=config.bn, BK=config.bk,
        num_warps=config.num_warps, num_stages=config.num_stages,
        **pdl_launch(a.device, slots),
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------- combine


@triton.jit
def _combine_kernel(y, w, out, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.load(y + (t * TOP_K) * H + cols, mask=mask).to(tl.float32) * tl.load(w + t * TOP_K)
    for r in tl.static_range(1, TOP_K):
        yr = tl.load(y + (t * TOP_K + r) * H + cols, mask=mask).to(tl.float32)
        acc = acc + yr * tl.load(w + t * TOP_K + r)
    tl.store(out + t * H + cols, acc.to(out.dtype.element_ty), mask=mask)


def combine(slots: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """slots [T * k, H] (slot order), weights fp32 [T, k] -> [T, H] in `dtype`: contract
    step 5, the bits of `combine_in_rank_order(...).to(dtype)`."""
    t, top_k = weights.shape
    h = slots.shape[1]
    out = torch.empty((t, h), dtype=dtype, device=slots.device)
    if t:
        block = min(1024, triton.next_power_of_2(h))
        opts = {"num_warps": 4, **pdl_launch(slots.device, t)}
        if not interpreting():  # a * b + c stays two roundings, as in torch
            opts["enable_fp_fusion"] = False
        _combine_kernel[(t, triton.cdiv(h, block))](
            slots, weights, out, h, TOP_K=top_k, BLOCK=block, **opts
        )
    return out


# ------------------------------------------------------------------------------ the layer


# Up to this many slots (batch 16 at k = 8) one program groups them (`_group_kernel`: one
# launch); above, three kernels over blocks of GROUP_BLOCK slots. Both give the order of a
# stable sort by expert id, which the tests check against torch.sort(stable=True).
GROUP_KERNEL_MAX_SLOTS = 128
GROUP_BLOCK = 128
_PREFIX_CHUNK = 256


@triton.jit
def _group_kernel(experts, order, offsets, S, E, S_PAD: tl.constexpr, E_PAD: tl.constexpr,
                  PDL: tl.constexpr):  # fmt: skip
    """A counting sort in one program: offsets[e] = slots with a lower expert id, and slot s
    goes to offsets[id_s] + (earlier slots with id_s)."""
    wait_for_inputs(PDL)
    s = tl.arange(0, S_PAD)
    valid = s < S
    ids = tl.load(experts + s, mask=valid, other=E_PAD)  # padding: no expert's id
    eids = tl.arange(0, E_PAD)
    mine = ids[:, None] == eids[None, :]  # [S_PAD, E_PAD]
    counts = tl.sum(mine.to(tl.int32), axis=0)
    starts = tl.cumsum(counts, axis=0) - counts
    tl.store(offsets + eids, starts.to(tl.int64), mask=eids < E)
    tl.store(offsets + E, tl.sum(counts, axis=0).to(tl.int64))
    before = (ids[:, None] == ids[None, :]) & (s[None, :] < s[:, None])  # [S_PAD, S_PAD]
    rank = tl.sum(before.to(tl.int32), axis=1)
    start = tl.sum(tl.where(mine, starts[None, :], 0), axis=1)
    tl.store(order + start + rank, s.to(tl.int64), mask=valid)


@triton.jit
def _block_counts_kernel(experts, counts, S, BLOCK: tl.constexpr, E_PAD: tl.constexpr,
                         PDL: tl.constexpr):  # fmt: skip
    """counts[b, e]: slots of block b routed to expert e."""
    wait_for_inputs(PDL)
    b = tl.program_id(0)
    s = b * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(experts + s, mask=s < S, other=E_PAD)
    eids = tl.arange(0, E_PAD)
    c = tl.sum((ids[:, None] == eids[None, :]).to(tl.int32), axis=0)
    tl.store(counts + b * E_PAD + eids, c)


@triton.jit
def _block_prefix_kernel(counts, totals, NB, CHUNK: tl.constexpr, E_PAD: tl.constexpr,
                         PDL: tl.constexpr):  # fmt: skip
    """For expert e (one program each): counts[b, e] becomes the slots of e in blocks before
    b (an exclusive scan over blocks, in place); totals[e] = all slots of e."""
    wait_for_inputs(PDL)
    e = tl.program_id(0)
    carry = 0
    for b0 in range(0, NB, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        c = tl.load(counts + b * E_PAD + e, mask=b < NB, other=0)
        tl.store(counts + b * E_PAD + e, tl.cumsum(c, axis=0) - c + carry, mask=b < NB)
        carry = carry + tl.sum(c, axis=0)
    tl.store(totals + e, carry)


@triton.jit
def _block_place_kernel(experts, prefix, totals, order, offsets, S, E, BLOCK: tl.constexpr,
                        E_PAD: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Slot s of block b goes to offsets[id] + prefix[b, id] + (earlier slots of the block
    with id); block 0 also writes offsets."""
    wait_for_inputs(PDL)
    b = tl.program_id(0)
    eids = tl.arange(0, E_PAD)
    tot = tl.load(totals + eids)
    starts = tl.cumsum(tot, axis=0) - tot  # offsets[e], padding experts hold 0 slots
    if b == 0:
        tl.store(offsets + eids, starts.to(tl.int64), mask=eids < E)
        tl.store(offsets + E, tl.sum(tot, axis=0).to(tl.int64))
    r = tl.arange(0, BLOCK)
    s = b * BLOCK + r
    valid = s < S
    ids = tl.load(experts + s, mask=valid, other=E_PAD)
    mine = ids[:, None] == eids[None, :]  # [BLOCK, E_PAD]
    base = tl.load(prefix + b * E_PAD + eids) + starts
    before = (ids[:, None] == ids[None, :]) & (r[None, :] < r[:, None])
    rank = tl.sum(before.to(tl.int32), axis=1)
    pos = tl.sum(tl.where(mine, base[None, :], 0), axis=1) + rank
    tl.store(order + pos, s.to(tl.int64), mask=valid)


def group_slots(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots grouped by expert: order [S] (sorted position -> slot; ascending slot within an
    expert, as a stable sort orders them) and offsets [E + 1] (offsets[e] = first sorted
    position of expert e), both int64. Triton kernels only: no host synchronization, and
    nothing a CUDA graph cannot hold (CUB's sorts may not be captured at some sizes)."""
    flat = experts.reshape(-1)
    slots = flat.numel()
    dev = flat.device
    order = torch.empty(slots, dtype=torch.int64, device=dev)
    offsets = torch.empty(num_experts + 1, dtype=torch.int64, device=dev)
    e_pad = expert_pad(num_experts)
    pdl = pdl_launch(dev, slots)
    if slots <= GROUP_KERNEL_MAX_SLOTS:
        s_pad = max(16, triton.next_power_of_2(slots))
        _group_kernel[(1,)](flat, order, offsets, slots, num_experts, S_PAD=s_pad, E_PAD=e_pad,
                            num_warps=4, **pdl)  # fmt: skip
        return order, offsets
    blocks = triton.cdiv(slots, GROUP_BLOCK)
    counts = torch.empty((blocks, e_pad), dtype=torch.int32, device=dev)
    totals = torch.empty(e_pad, dtype=torch.int32, device=dev)
    _block_counts_kernel[(blocks,)](flat, counts, slots, BLOCK=GROUP_BLOCK, E_PAD=e_pad,
                                    num_warps=4, **pdl)  # fmt: skip
    _block_prefix_kernel[(e_pad,)](counts, totals, blocks, CHUNK=_PREFIX_CHUNK, E_PAD=e_pad,
                                   num_warps=4, **pdl)  # fmt: skip
    _block_place_kernel[(blocks,)](flat, counts, totals, order, offsets, slots, num_experts,
                                   BLOCK=GROUP_BLOCK, E_PAD=e_pad, num_warps=4, **pdl)  # fmt: skip
    return order, offsets


def moe(
    x: torch.Tensor, layer: MoeLayer, gate_up_config: GroupedConfig | None = None,
    down_config: GroupedConfig | None = None, splits: int | None = None,
    routed_experts: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """`Ops.moe` for x [T, H] (module docstring): [T, H] in x's dtype. The configs override
    the tables (tests and benchmarks; they never change a bit); `splits` overrides the K
    split count of both GEMMs (tests only: negative controls; it changes the bits).
    `routed_experts`: [T, k] ids the routing chose, copied on the device (`Ops.moe`)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"moe wants x [T, H] with H contiguous; got {tuple(x.shape)}")
    top_k = layer.top_k
    slots = x.shape[0] * top_k
    routing = route_layer(router_logits(x, layer), layer)
    write_routed_experts(routed_experts, routing.experts)
    order, offsets = group_slots(routing.experts, layer.num_experts)
    h = grouped_gemm(
        x, layer.gate_up, order, offsets, top_k, gather=True, scatter=False, silu=True,
        config=gate_up_config or pick_grouped_config(GATE_UP_TABLE, slots), splits=splits,
    )  # fmt: skip
    y = grouped_gemm(
        h, layer.down, order, offsets, top_k, gather=False, scatter=True, silu=False,
        config=down_config or pick_grouped_config(DOWN_TABLE, slots), splits=splits,
    )  # fmt: skip
    return combine(y, routing.weights, x.dtype)
