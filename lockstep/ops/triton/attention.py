"""Paged causal attention for prefill, extend and decode: one kernel family, one set of bits.

Why a query row's bits cannot depend on the schedule (docs/design.md, "Attention"):

    keys of a sequence, absolute positions:
    |<------ split 0 (SPLIT keys) ------>|<------ split 1 ------>|<-- split 2 ...
    | blk 0 | blk 1 | ... (BLOCK_N keys)| blk   | blk   | ...   |
    0       B       2B                  S                       2S

  * Keys are visited in blocks of BLOCK_N at absolute positions 0, B, 2B, ... and grouped into
    splits of SPLIT keys at absolute positions 0, S, 2S, ...; each split starts a fresh
    online-softmax state (max, sum, acc).
  * Split partials are folded in ascending split order by `merge_partials`, the ONE
    `@triton.jit` merge routine: in-kernel by the prefill and fold paths (`_attn_fwd`,
    WRITE_PARTIALS=0; prefill tiles, or decode tiles when every sequence fits one split or a
    decode's programs fill the GPU, `decode_path`) and in a second kernel by the split path
    (`_attn_merge`), so all three compute the same sum.
  * A block or split that is entirely in a row's causal future is an exact identity on that
    row's state (max unchanged, weights exactly 1 and 0), so it does not matter how many rows
    share a tile, how far the tile reaches, or which sequence the batch-mates belong to.
  * Rows of a tile are (query position, q head of one GQA group) pairs; every op on a row is
    row-local. The row sum of p over a key block is a tensor-core dot with ones
    (`row_sum_mma`): one MMA chain per row in k-step order, so prefill tiles (128 rows on 8
    warps, wgmma) and decode tiles (16 rows on 2 warps, mma.sync) give the same bits whatever
    their warps (a GPU test over 1-8 decode warps); tl.sum would reduce in an order fixed by
    the MMA layout, which differs between the two tile shapes.
  * Sliding windows (a runtime argument, `NO_WINDOW` for none): the row at p sees keys
    p - window + 1 .. p. A block wholly below a row's window is an identity on its state as
    a future block is, so tiles start at the block of their first row's window and the
    window mask joins the causal mask on the blocks that need it: every tile shape and path
    still folds, for each row, the same blocks in the same order.
  * Multiply-add contraction is switched off (`enable_fp_fusion=False`) so the two kernels
    cannot contract the shared formulas differently.

Workspace of the split path (float32), bounded by batch and wave size, never by context:
    partials: WAVE * T * Hq * (D + 2) * 4 bytes,
    running state (several waves only): T * Hq * (D + 2 * D / min(merge_cols, D)) * 4 bytes,
with WAVE = min(splits of the longest sequence, max(1, WORKSPACE_BYTES // (T*Hq*(D+2)*4))).
Contexts longer than WAVE * SPLIT run as several waves that fold into the running state in the
same ascending order. The prefill and fold paths need no workspace at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lockstep.ops.base import AttentionMeta
from lockstep.ops.triton.launch import (
    compiled_for_gpu,
    interpreting,
    num_sms,
    pdl_launch,
    shared_memory_per_block,
    wait_for_inputs,
)

LOG2E = 1.4426950408889634
# The window of a layer without one: larger than any context (positions are int32).
NO_WINDOW = 1 << 30


@dataclass(frozen=True)
class AttentionConfig:
    """Tile configuration. block_n and split are part of the numerics: changing them changes
    bits. Nothing else does (the tests check each): tile rows, warps and stages, slot ids
    loaded ahead, the path a call takes, the merge's shape, the workspace size."""

    block_n: int = 64
    split: int = 512
    rows: int = 128  # query rows (position x head) per tile on the prefill path
    # Decode tiles: 16 rows (query positions x q heads of one GQA group) on 2 warps. The row
    # sum is a dot (`row_sum_mma`), so the warp count is speed only.
    rows_split: int = 16
    num_warps: int = 8
    num_warps_split: int = 2
    num_stages: int = 3
    num_stages_split: int = 3
    # The unmasked key loop of the prefill tiles (slots_ahead), and of the decode tiles
    # (slots_ahead_split), loads the next block's slot ids before this block's arithmetic, so
    # that Triton double-buffers K/V and the next gather runs under this block's arithmetic.
    # The same values reach the same arithmetic: speed only.
    slots_ahead: bool = True
    slots_ahead_split: bool = True
    # Decode tiles load slot ids a block ahead only while the launch's grid has at most this
    # many programs per SM (`split_slots_ahead`): their double buffers fit three per SM on
    # sm_90, and a grid that does not fit at once runs slower with them on an H200.
    slots_ahead_programs_per_sm: int = 3
    # The split path's merge (`_attn_merge`): output columns per program and the partials in
    # flight (its loop's pipeline stages; a launch uses at most the wave's partials rounded up
    # to a power of two: a deeper prologue only costs). Speed only: the fold is elementwise in
    # the columns, and stages move loads, not folds.
    merge_cols: int = 32
    merge_stages: int = 8
    merge_warps: int = 1  # warps of a merge program: speed only
    # Calls whose longest chunk has at most split_path_max_q queries (decode, short extends)
    # run decode tiles (rows_split, num_warps_split) on one of two paths (`decode_path`):
    # "fold", one program per (tile, sequence x kv head) folding its splits in-kernel like the
    # prefill path (no workspace, no merge), when every sequence fits one split or the
    # programs number at least fold_programs_per_sm per SM; else "split", one program per
    # split, partials merged by `_attn_merge`, which spreads a long context over the SMs.
    # Speed only; the thresholds are where fold timed faster than split on an H200 (the
    # decode table in docs/results.md names the path each cell takes).
    split_path_max_q: int = 4
    fold_programs_per_sm: float = 1.5
    workspace_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if self.slots_ahead_programs_per_sm < 1:
            raise ValueError(f"slots_ahead_programs_per_sm={self.slots_ahead_programs_per_sm} "
                             "must be >= 1")  # fmt: skip
        if self.split % self.block_n:
            raise ValueError(f"split={self.split} must be a multiple of block_n={self.block_n}")
        for name in ("merge_cols", "merge_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two")
        if not self.fold_programs_per_sm > 0:
            raise ValueError(f"fold_programs_per_sm={self.fold_programs_per_sm} must be > 0 "
                             "(math.inf keeps multi-split decodes on the split path)")  # fmt: skip
        if self.merge_stages < 1:
            raise ValueError(f"merge_stages={self.merge_stages} must be >= 1")
        if self.workspace_bytes >= 2**33:  # the merge addresses partials with 32-bit offsets
            raise ValueError(f"workspace_bytes={self.workspace_bytes} must be < 2**33 (8 GiB)")
        for name in ("block_n", "rows", "rows_split"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two >= 16")


# The production table (H200, Triton 3.6); docs/results.md has its figures.
DEFAULT_CONFIG = AttentionConfig()


@triton.jit
def merge_partials(m_a, l_a, acc_a, m_b, l_b, acc_b):
    """Fold partial (m_b, l_b, acc_b) into state (m_a, l_a, acc_a); m is in log2 units.
    A partial with m = -inf (no visible key) is an exact identity."""
    m_new = tl.maximum(m_a, m_b)
    w_a = tl.where(m_a == m_new, 1.0, tl.exp2(m_a - m_new))
    w_b = tl.where(m_b == m_new, 1.0, tl.exp2(m_b - m_new))
    l_new = l_a * w_a + l_b * w_b
    acc_new = acc_a * w_a[:, None] + acc_b * w_b[:, None]
    return m_new, l_new, acc_new


@triton.jit
def finalize_rows(lsum, acc):
    return acc / lsum[:, None]


@triton.jit
def _tile_rows(cu_q, q_start, b, tile, G: tl.constexpr, ROWS: tl.constexpr):
    """Rows of this tile: query index within the chunk, head within the group, validity,
    absolute position, and the tile's key bound hi (one past the last visible key)."""
    q_lo = tl.load(cu_q + b)
    n_q = tl.load(cu_q + b + 1) - q_lo
    start = tl.load(q_start + b)
    r = tile * ROWS + tl.arange(0, ROWS)
    qi = r // G
    gi = r % G
    valid = qi < n_q
    pos = tl.where(valid, start + qi, -1)
    last_row = tl.minimum(tile * ROWS + ROWS, n_q * G) - 1
    hi = tl.where(tile * ROWS < n_q * G, start + last_row // G + 1, 0)
    return q_lo + qi, gi, valid, pos, hi


@triton.jit
def _block_slots(slots_ptr, j0, hi, MASKED: tl.constexpr, BLOCK_N: tl.constexpr):
    """Slot ids of keys j0 .. j0 + BLOCK_N - 1 (0 past hi when MASKED)."""
    offs_j = j0 + tl.arange(0, BLOCK_N)
    if MASKED:
        return tl.load(slots_ptr + offs_j, mask=offs_j < hi, other=0)
    return tl.load(slots_ptr + offs_j)


@triton.jit
def _block_update(
    m, lsum, acc, q, k_cache, v_cache, slots, kvh, skc, skh, pos, j0, hi, qk_scale, window,
    MASKED: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    """One key block of the online softmax. MASKED=0 is only used on blocks that every valid
    row sees entirely, where the causal, window and bounds masks are all-true: same bits,
    less work.
    The K and V caches share one layout, so one gather offset per element serves both; the
    offsets are 32-bit (64-bit address arithmetic is a large share of a decode program's
    instructions) unless the cache holds 2**31 elements or more (WIDE)."""
    offs_d = tl.arange(0, D)
    offs_j = j0 + tl.arange(0, BLOCK_N)
    if WIDE:
        slots = slots.to(tl.int64)
    kv_offs = slots[:, None] * skc + kvh * skh + offs_d[None, :]
    if MASKED:
        jmask = offs_j < hi
        k = tl.load(k_cache + kv_offs, mask=jmask[:, None], other=0.0)
    else:
        k = tl.load(k_cache + kv_offs)
    k = widen_kv(k, q.dtype)
    s = tl.dot(q, tl.trans(k))
    if MASKED:
        seen = (offs_j[None, :] <= pos[:, None]) & (offs_j[None, :] > pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1) * qk_scale)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.where(m == m_new, 1.0, tl.exp2(m - m_use))
    p = tl.exp2(s * qk_scale - m_use[:, None])
    if MASKED:
        v = tl.load(v_cache + kv_offs, mask=jmask[:, None], other=0.0)
    else:
        v = tl.load(v_cache + kv_offs)
    v = widen_kv(v, q.dtype)
    pv = p.to(v.dtype)
    lsum = lsum * alpha + row_sum_mma(pv, BLOCK_N)
    if scaled_kv(v_cache, q.dtype):  # undo the widening's 2**-KV_WIDEN_EXP (exact; pv <= 1)
        pv = (pv.to(tl.float32) * (2.0**KV_WIDEN_EXP)).to(v.dtype)
    acc = tl.dot(pv, v, acc * alpha[:, None])
    return m_new, lsum, acc


# An FP8 (e4m3) cache read by bfloat16 queries is widened by moving bits, not by conversion
# instructions (one e4m3 -> bf16 conversion per value made the decode tiles conversion-bound):
# e4m3's sign, 4-bit exponent and 3-bit mantissa become a bf16's sign, exponent field
# 0000EEEE and mantissa MMM0000, which is the exact value times 2**-KV_WIDEN_EXP (bias 127
# against 7; e4m3's subnormals land on bf16 subnormals, the same factor). The dots undo the
# factor at no cost: q is multiplied by 2**(KV_WIDEN_EXP/2) once per program and the score
# scale by the same power (exact: powers of two), and p by 2**KV_WIDEN_EXP before p @ V, so
# every product the tensor cores form is the one the exact widening gives (bit for bit on the
# H200, subnormals included: docs/results.md; only a |q| of 2**68 or more, which no model has,
# would overflow).
# Per 32-bit register of four cache bytes [b3 b2 b1 b0]: prmt builds [sign(b1) b1 sign(b0) b0]
# (selector nibbles 8-B replicate a byte's sign), a shift by 4 moves each byte's low 7 bits
# to bf16 bits 10..4 and a sign copy to bit 15, and the mask drops the rest. Three integer
# instructions per two values.
KV_WIDEN_EXP = tl.constexpr(120)
_E4M3_TO_BF16_SCALED = tl.constexpr(
    """{
    .reg .b32 t;
    prmt.b32 t, $2, 0, 0x9180;
    shl.b32 t, t, 4;
    and.b32 $0, t, 0x87F087F0;
    prmt.b32 t, $2, 0, 0xB3A2;
    shl.b32 t, t, 4;
    and.b32 $1, t, 0x87F087F0;
    }"""
)
# e4m3 -> fp32 for float32 queries (rare; exact, unscaled): the e4m3 -> fp16 pairs of sm_89+.
_E4M3_TO_F32 = tl.constexpr(
    """{
    .reg .b16 lo, hi;
    .reg .b32 h01, h23;
    .reg .f16 a0, a1, a2, a3;
    mov.b32 {lo, hi}, $4;
    cvt.rn.f16x2.e4m3x2 h01, lo;
    cvt.rn.f16x2.e4m3x2 h23, hi;
    mov.b32 {a0, a1}, h01;
    mov.b32 {a2, a3}, h23;
    cvt.f32.f16 $0, a0;
    cvt.f32.f16 $1, a1;
    cvt.f32.f16 $2, a2;
    cvt.f32.f16 $3, a3;
    }"""
)
_COMPILED = tl.constexpr(not interpreting())


@triton.jit
def widen_kv(x, dtype: tl.constexpr):
    """Cache values for dots in the activation dtype: unchanged for a cache of that dtype; an
    FP8 (e4m3, scale 1.0) cache exactly, times 2**-KV_WIDEN_EXP for bfloat16 (see
    `scaled_kv`; the dots undo it), unscaled for float32.

    Why not `x.to(dtype)`: Triton lays out a dot operand for the narrowest type it was loaded
    as, so a dot over values loaded as e4m3 gets 4 consecutive K elements per thread instead
    of 2 on the decode tiles' mma.sync, which permutes the K order inside each MMA
    instruction, and the tensor cores' fp32 sums follow that order: decode tiles then
    disagree with the prefill tiles' wgmma (whose B operand comes from shared memory in
    order) in the last bits. A widening the compiler cannot see through (inline PTX with side
    effects, which ends its search for the loaded type) keeps every dot laid out as for a
    cache of the activation dtype. tests/kernels/test_kernel_compile_sm90.py checks the layouts; the
    interpreter has no PTX and no layouts, so it makes the same bit moves in Triton ops."""
    if x.dtype == dtype:
        y = x
    elif dtype == tl.float32:
        if _COMPILED:
            y = tl.inline_asm_elementwise(
                _E4M3_TO_F32, "=r,=r,=r,=r,r", [x], dtype=tl.float32, is_pure=False, pack=4
            )
        else:
            y = x.to(tl.float32)
    elif _COMPILED:  # bfloat16 (`_check`)
        y = tl.inline_asm_elementwise(
            _E4M3_TO_BF16_SCALED, "=r,=r,r", [x], dtype=tl.bfloat16, is_pure=False, pack=4
        )
    else:  # the same bit moves (the interpreter's float32 -> bf16 rounds subnormals wrongly)
        b = x.to(tl.uint8, bitcast=True).to(tl.uint16)
        y = (((b & 0x80) << 8) | ((b & 0x7F) << 4)).to(tl.bfloat16, bitcast=True)
    return y


@triton.jit
def scaled_kv(cache_ptr, dtype: tl.constexpr):
    """Whether `widen_kv` scales this cache's values for `dtype` dots (an FP8 cache read by
    bfloat16 queries)."""
    return cache_ptr.dtype.element_ty == tl.float8e4nv and dtype == tl.bfloat16


@triton.jit
def row_sum_mma(p, BLOCK_N: tl.constexpr):
    """Row sums of p as a tensor-core dot with ones: each output is one MMA chain over the
    keys in k-step order, the same whatever the warps, the tile's rows or the instruction
    family (mma.sync, wgmma), where tl.sum reduces in an order fixed by the layout. Every
    column holds the same sum, so the max over them is exact. p is the rounded p that the
    p @ V dot uses, so the normaliser sums the weights the numerator applied."""
    ones = tl.full([BLOCK_N, 16], 1.0, p.dtype)
    return tl.max(tl.dot(p, ones), 1)


@triton.jit
def _split_partial(
    q, k_cache, v_cache, slots_ptr, kvh, skc, skh, pos, pos_lo, lo, hi, qk_scale, window,
    key_lo, key_all, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    WIDE: tl.constexpr, SLOTS_AHEAD: tl.constexpr,
):  # fmt: skip
    """Online softmax over keys [lo, hi) (lo a multiple of BLOCK_N), fresh state. Blocks are
    visited in ascending order from the block of key_lo (the first key any row of the tile
    sees); those wholly at or before pos_lo (the tile's first position) and at or after
    key_all (every row's window holds every later key) skip the masks. SLOTS_AHEAD: the
    unmasked loop loads the next block's slot ids before this block's arithmetic (same
    values, so the same bits).

        lo    start            free      mid            hi
        |.....|masked (window)|unmasked  |masked (causal)|"""
    m = tl.full([ROWS], float("-inf"), tl.float32)
    lsum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    mid = lo + tl.maximum(tl.minimum(pos_lo + 1, hi) - lo, 0) // BLOCK_N * BLOCK_N
    start = tl.maximum(lo, key_lo // BLOCK_N * BLOCK_N)
    free = tl.maximum(start, tl.minimum(tl.cdiv(key_all, BLOCK_N) * BLOCK_N, mid))
    for j0 in range(start, free, BLOCK_N):
        m, lsum, acc = _block_update(
            m, lsum, acc, q, k_cache, v_cache, _block_slots(slots_ptr, j0, hi, True, BLOCK_N),
            kvh, skc, skh, pos, j0, hi, qk_scale, window, True, BLOCK_N, D, WIDE,
        )  # fmt: skip
    if SLOTS_AHEAD:
        nxt = _block_slots(slots_ptr, free, hi, True, BLOCK_N)
        for j0 in range(free, mid, BLOCK_N):
            cur = nxt
            nxt = _block_slots(slots_ptr, j0 + BLOCK_N, hi, True, BLOCK_N)
            m, lsum, acc = _block_update(
                m, lsum, acc, q, k_cache, v_cache, cur, kvh, skc, skh, pos, j0, hi, qk_scale,
                window, False, BLOCK_N, D, WIDE,
            )  # fmt: skip
    else:
        for j0 in range(free, mid, BLOCK_N):
            m, lsum, acc = _block_update(
                m, lsum, acc, q, k_cache, v_cache, _block_slots(slots_ptr, j0, hi, False, BLOCK_N),
                kvh, skc, skh, pos, j0, hi, qk_scale, window, False, BLOCK_N, D, WIDE,
            )  # fmt: skip
    for j0 in range(tl.maximum(free, mid), hi, BLOCK_N):
        m, lsum, acc = _block_update(
            m, lsum, acc, q, k_cache, v_cache, _block_slots(slots_ptr, j0, hi, True, BLOCK_N),
            kvh, skc, skh, pos, j0, hi, qk_scale, window, True, BLOCK_N, D, WIDE,
        )  # fmt: skip
    return m, lsum, acc


@triton.jit
def _attn_fwd(
    q,
    k_cache,
    v_cache,
    out,
    cu_q,
    q_start,
    cu_kv,
    slot_table,
    ws_m,
    ws_l,
    ws_acc,
    wave_base,
    R,
    sqt,
    sqh,
    skc,
    skh,
    sot,
    soh,
    qk_scale,
    window,
    HKV: tl.constexpr,
    G: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    D: tl.constexpr,
    WRITE_PARTIALS: tl.constexpr,
    WIDE: tl.constexpr,
    SLOTS_AHEAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """Prefill and fold paths (WRITE_PARTIALS=0; prefill or decode tiles): one program per
    (tile, seq*kv head), all splits merged in-kernel. Split path (WRITE_PARTIALS=1): one
    program per (tile, seq*kv head, split of this wave), partials to the workspace for
    `_attn_merge`."""
    wait_for_inputs(PDL)
    n_tiles = tl.num_programs(0)
    # Longest tiles (latest positions) first: better balance for causal prefill.
    tile = n_tiles - 1 - tl.program_id(0)
    b = tl.program_id(1) // HKV
    kvh = tl.program_id(1) % HKV
    tok, gi, valid, pos, hi = _tile_rows(cu_q, q_start, b, tile, G, ROWS)
    head = kvh * G + gi
    offs_d = tl.arange(0, D)
    qrow = tok.to(tl.int64) * sqt + head.to(tl.int64) * sqh
    qt = tl.load(q + qrow[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
    if scaled_kv(k_cache, qt.dtype):  # the keys are widened times 2**-KV_WIDEN_EXP: undo it
        qt = (qt.to(tl.float32) * (2.0 ** (KV_WIDEN_EXP // 2))).to(qt.dtype)
        qk_scale = qk_scale * (2.0 ** (KV_WIDEN_EXP // 2))
    slots_ptr = slot_table + tl.load(cu_kv + b)
    pos_lo = tl.min(tl.where(valid, pos, hi), 0)  # first position of the tile
    # The window's keys: the first any row sees, and the first from which every row sees all.
    key_lo = tl.maximum(pos_lo - window + 1, 0)
    key_all = tl.maximum(hi - window, 0)
    if WRITE_PARTIALS:
        split = wave_base + tl.program_id(2)
        lo = split * SPLIT
        m, lsum, acc = _split_partial(
            qt, k_cache, v_cache, slots_ptr, kvh, skc, skh, pos, pos_lo, lo,
            tl.minimum(lo + SPLIT, hi), qk_scale, window, key_lo, key_all, ROWS, BLOCK_N, D,
            WIDE, SLOTS_AHEAD,
        )  # fmt: skip
        wrow = tl.program_id(2).to(tl.int64) * R + tok.to(tl.int64) * (HKV * G) + head
        smask = valid & (pos * 0 + lo < hi)  # broadcast: the interpreter wants a bool tensor
        tl.store(ws_m + wrow, m, mask=smask)
        tl.store(ws_l + wrow, lsum, mask=smask)
        tl.store(ws_acc + wrow[:, None] * D + offs_d[None, :], acc, mask=smask[:, None])
    else:
        m_s = tl.full([ROWS], float("-inf"), tl.float32)
        l_s = tl.zeros([ROWS], tl.float32)
        acc_s = tl.zeros([ROWS, D], tl.float32)
        # Splits wholly below every row's window would merge as identities: skipped.
        for lo in range(key_lo // SPLIT * SPLIT, hi, SPLIT):
            m, lsum, acc = _split_partial(
                qt, k_cache, v_cache, slots_ptr, kvh, skc, skh, pos, pos_lo, lo,
                tl.minimum(lo + SPLIT, hi), qk_scale, window, key_lo, key_all, ROWS, BLOCK_N,
                D, WIDE, SLOTS_AHEAD,
            )  # fmt: skip
            m_s, l_s, acc_s = merge_partials(m_s, l_s, acc_s, m, lsum, acc)
        o = finalize_rows(l_s, acc_s)
        orow = tok.to(tl.int64) * sot + head.to(tl.int64) * soh
        tl.store(
            out + orow[:, None] + offs_d[None, :], o.to(out.dtype.element_ty), mask=valid[:, None]
        )


@triton.jit
def _load_partial(w, ws_m, ws_l, ws_acc, R, row, valid, D: tl.constexpr, offs_d):
    """Columns offs_d of split partial w of these rows from the workspace (32-bit offsets:
    the wrapper keeps the workspace below 2**31 elements)."""
    wrow = w * R + row
    m = tl.load(ws_m + wrow, mask=valid, other=float("-inf"))
    lsum = tl.load(ws_l + wrow, mask=valid, other=0.0)
    acc = tl.load(ws_acc + wrow[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
    return m, lsum, acc


@triton.jit
def _attn_merge(
    out,
    cu_q,
    q_start,
    ws_m,
    ws_l,
    ws_acc,
    st_m,
    st_l,
    st_acc,
    wave_base,
    wave,
    R,
    sot,
    soh,
    HKV: tl.constexpr,
    G: tl.constexpr,
    ROWS: tl.constexpr,
    SPLIT: tl.constexpr,
    D: tl.constexpr,
    DC: tl.constexpr,
    STAGES: tl.constexpr,
    FIRST: tl.constexpr,
    LAST: tl.constexpr,
    PDL: tl.constexpr,
):
    """Fold this wave's split partials, ascending, into each row's running state; the last
    wave writes the output. One program per (row tile, seq*kv head, chunk of DC of the D
    output columns): the fold is elementwise in the columns, and every chunk folds the same
    (m, l) in the same order, so chunking changes no bit. ROWS divides the split path's
    tile rows, so every partial a tile folds was written by its split tile (those wholly in
    a row's causal future are identities for that row)."""
    wait_for_inputs(PDL)
    tile = tl.program_id(0)
    b = tl.program_id(1) // HKV
    kvh = tl.program_id(1) % HKV
    chunk = tl.program_id(2)
    tok, gi, valid, pos, hi = _tile_rows(cu_q, q_start, b, tile, G, ROWS)
    head = kvh * G + gi
    offs_d = chunk * DC + tl.arange(0, DC)
    row = tok * (HKV * G) + head
    # Each chunk keeps its own copy of the running (m, l): a chunk reads it while another
    # program of the same launch writes its update.
    srow = chunk * R + row
    if FIRST:
        m_s = tl.full([ROWS], float("-inf"), tl.float32)
        l_s = tl.zeros([ROWS], tl.float32)
        acc_s = tl.zeros([ROWS, DC], tl.float32)
    else:
        m_s = tl.load(st_m + srow, mask=valid, other=0.0)
        l_s = tl.load(st_l + srow, mask=valid, other=0.0)
        acc_s = tl.load(st_acc + row[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
    n_here = tl.minimum(wave, tl.cdiv(hi, SPLIT) - wave_base)
    # The fold is sequential, its loads are not: Triton software-pipelines this loop (an
    # explicit tl.range with STAGES; without it a loop with no dot is not pipelined), so the
    # partials STAGES - 1 ahead are in flight as asynchronous copies while this one folds
    # (on sm_90: cp.async with counted waits). Only loads move: the folds are the same in the
    # same order.
    for w in tl.range(0, n_here, num_stages=STAGES):
        m, lsum, acc = _load_partial(w, ws_m, ws_l, ws_acc, R, row, valid, D, offs_d)
        m_s, l_s, acc_s = merge_partials(m_s, l_s, acc_s, m, lsum, acc)
    if LAST:
        o = finalize_rows(l_s, acc_s)
        orow = tok.to(tl.int64) * sot + head.to(tl.int64) * soh
        tl.store(
            out + orow[:, None] + offs_d[None, :], o.to(out.dtype.element_ty), mask=valid[:, None]
        )
    else:
        tl.store(st_m + srow, m_s, mask=valid)
        tl.store(st_l + srow, l_s, mask=valid)
        tl.store(st_acc + row[:, None] * D + offs_d[None, :], acc_s, mask=valid[:, None])


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"attention wants q [T, Hq, D] and caches [S, Hkv, D]; got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    d = q.shape[2]
    if k_cache.shape[2] != d or d < 16 or d & (d - 1):
        raise ValueError(f"head_dim={d} must match the cache and be a power of two >= 16")
    if q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"Hq={q.shape[1]} is not a multiple of Hkv={k_cache.shape[1]}")
    fp8_cache = k_cache.dtype == torch.float8_e4m3fn
    if (q.dtype != k_cache.dtype and not fp8_cache) or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"dtypes differ: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}; the caches "
            "must have q's dtype or both be float8_e4m3fn"
        )
    if fp8_cache and q.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"an FP8 cache widens to bfloat16 or float32 queries, not {q.dtype}")
    if q.stride(2) != 1 or k_cache.stride(2) != 1:
        raise ValueError("attention wants the head_dim axis contiguous")
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"the K and V caches must share one layout (one gather offset serves "
                         f"both); strides {k_cache.stride()} vs {v_cache.stride()}")  # fmt: skip


def needs_wide_offsets(cache: torch.Tensor) -> bool:
    """Whether gather offsets into this cache overflow 32 bits (its element span, strides
    included, reaches 2**31): then the kernels compute them in 64 bits. Same bits either way."""
    return sum((n - 1) * st for n, st in zip(cache.shape, cache.stride(), strict=True)) >= 2**31


def split_slots_ahead(config: AttentionConfig, programs: int, device: torch.device) -> bool:
    """Whether a decode-tile launch of `programs` programs loads slot ids a block ahead:
    `slots_ahead_split` is on (production) and they fit `slots_ahead_programs_per_sm` per SM
    (the interpreter has no limit). Speed only: both variants give the same bits."""
    if not config.slots_ahead_split:
        return False
    if not compiled_for_gpu(device):
        return True
    return programs <= config.slots_ahead_programs_per_sm * num_sms(device)


def attention_path(
    config: AttentionConfig, meta: AttentionMeta, q_per_kv: int, n_kv_heads: int,
    device: torch.device,
) -> str:  # fmt: skip
    """The path `paged_attention` takes for a call (speed only): "prefill" when a chunk is
    longer than `split_path_max_q`, else `decode_path` over the fold's decode tiles."""
    if meta.max_q > config.split_path_max_q:
        return "prefill"
    tiles = triton.cdiv(meta.max_q * q_per_kv, config.rows_split)
    return decode_path(config, tiles * meta.num_seqs * n_kv_heads, meta.max_kv, device)


def decode_path(config: AttentionConfig, programs: int, max_kv: int, device: torch.device) -> str:
    """The path of a call whose chunks are all short (max_q <= split_path_max_q), given its
    fold-path programs (tiles x sequences x kv heads) and longest context: "fold" when every
    sequence fits one split (the merge would only copy) or the programs fill
    `fold_programs_per_sm` per SM, else "split". The interpreter has no SMs: there only the
    one-split case folds. Speed only: all paths give the same bits."""
    if max_kv <= config.split:
        return "fold"
    if not compiled_for_gpu(device):
        return "split"
    return "fold" if programs >= config.fold_programs_per_sm * num_sms(device) else "split"


# Shared memory a tile needs beyond its q rows and staged K/V blocks (layout conversions).
_SMEM_SLACK = 4096


def stages_that_fit(
    num_stages: int, rows: int, block_n: int, q: torch.Tensor, k_cache: torch.Tensor
) -> int:
    """The most K/V pipeline stages, up to `num_stages`, whose buffers fit the device's shared
    memory beside a tile's q rows: head_dim 256 (Qwen3.5's full attention) fits two prefill
    stages on an H200 where head_dim 128 fits three. Stages move loads, not arithmetic, so
    this changes speed only."""
    if not compiled_for_gpu(q.device):
        return num_stages
    d = q.shape[-1]
    limit = shared_memory_per_block(q.device)
    per_stage = 2 * block_n * d * k_cache.element_size()
    room = limit - _SMEM_SLACK - rows * d * q.element_size()
    return max(1, min(num_stages, room // per_stage))


def _launch_opts(num_warps: int, num_stages: int, device: torch.device, tokens: int) -> dict:
    opts = {"num_warps": num_warps, "num_stages": num_stages, **pdl_launch(device, tokens)}
    if not interpreting():  # no multiply-add contraction (module docstring)
        opts["enable_fp_fusion"] = False
    return opts


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    scale: float,
    config: AttentionConfig = DEFAULT_CONFIG,
    force_path: str | None = None,
    out_dtype: torch.dtype | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over the paged caches (see `lockstep.ops.base`),
    within a sliding `window` of keys where one is given.
    The path is chosen for speed only, all three give the same bits: "prefill" (prefill
    tiles, splits folded in-kernel) for calls with a longer chunk than
    `config.split_path_max_q`, else decode tiles on "fold" (splits folded in-kernel) or
    "split" (one program per split, then the merge), by `decode_path`. `force_path` and
    `out_dtype` (float32 shows every bit of the float32 result) exist for tests and
    benchmarks."""
    _check(q, k_cache, v_cache)
    t, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    out = torch.empty(q.shape, dtype=out_dtype or q.dtype, device=q.device)
    b = meta.num_seqs
    if t == 0 or b == 0:
        return out
    qk_scale = float(scale) * LOG2E
    if window is not None and not 1 <= window < NO_WINDOW:
        raise ValueError(f"window={window} must be between 1 and {NO_WINDOW - 1}")
    win = NO_WINDOW if window is None else int(window)
    if force_path not in (None, "prefill", "fold", "split"):
        raise ValueError(f"force_path={force_path!r} is invalid: expected prefill, fold or "
                         "split")  # fmt: skip
    path = force_path or attention_path(config, meta, g, hkv, q.device)
    rows = config.rows if path == "prefill" else config.rows_split
    n_tiles = triton.cdiv(meta.max_q * g, rows)
    common = (meta.cu_q, meta.q_start, meta.cu_kv, meta.slot_table)
    wide = needs_wide_offsets(k_cache)
    strides = (
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0),
        out.stride(1),
    )  # fmt: skip
    if path == "prefill":
        stages = stages_that_fit(config.num_stages, rows, config.block_n, q, k_cache)
        opts = _launch_opts(config.num_warps, stages, q.device, q.shape[0])
    else:  # decode tiles (fold and split paths)
        stages = stages_that_fit(config.num_stages_split, rows, config.block_n, q, k_cache)
        opts = _launch_opts(config.num_warps_split, stages, q.device, q.shape[0])
    if path in ("prefill", "fold"):
        ahead = config.slots_ahead if path == "prefill" else (
            split_slots_ahead(config, n_tiles * b * hkv, q.device))  # fmt: skip
        _attn_fwd[(n_tiles, b * hkv)](
            q, k_cache, v_cache, out, *common, q, q, q, 0, 0, *strides, qk_scale, win,
            HKV=hkv, G=g, ROWS=rows, BLOCK_N=config.block_n, SPLIT=config.split, D=d,
            WRITE_PARTIALS=0, WIDE=wide, SLOTS_AHEAD=ahead, **opts,
        )  # fmt: skip
        return out

    def launch_split(grid: tuple[int, int, int], base: int, ws: tuple, r: int) -> None:
        _attn_fwd[grid](
            q, k_cache, v_cache, out, *common, *ws, base, r, *strides, qk_scale, win, HKV=hkv,
            G=g, ROWS=rows, BLOCK_N=config.block_n, SPLIT=config.split, D=d, WRITE_PARTIALS=1,
            WIDE=wide, SLOTS_AHEAD=split_slots_ahead(config, math.prod(grid), q.device), **opts,
        )  # fmt: skip

    split_waves(out, meta, config, n_tiles, hkv, g, d, rows, launch_split)
    return out


def split_waves(
    out: torch.Tensor, meta: AttentionMeta, config: AttentionConfig, n_tiles: int, hkv: int,
    g: int, d: int, rows: int, launch_split: Callable[[tuple[int, int, int], int, tuple, int], None],
) -> None:  # fmt: skip
    """The split path's waves (module docstring, "Workspace"): for each wave of splits,
    `launch_split(grid, wave_base, (ws_m, ws_l, ws_acc), R)` writes the wave's partials (grid
    (tiles, sequences x kv heads, splits of the wave); R = T * Hq rows per split) and
    `_attn_merge` folds them, ascending, into out [T, Hq, d] (d value columns). Shared by every
    kernel whose split partials have this layout (`lockstep.ops.triton.latent_attention`)."""
    t, hq = out.shape[0], out.shape[1]
    r = t * hq
    b = meta.num_seqs
    # Merge tiles: the longest query chunk's rows (max_q x G) at most, as a power of two that
    # divides the split tile's rows (so a tile folds only partials its split tile wrote);
    # the output columns in chunks of m_cols.
    m_rows = min(rows, triton.next_power_of_2(meta.max_q * g))
    m_cols = min(config.merge_cols, d)
    merge_grid = (triton.cdiv(meta.max_q * g, m_rows), b * hkv, d // m_cols)
    n_splits = triton.cdiv(meta.max_kv, config.split)
    per_split = r * (d + 2) * 4
    wave = max(1, min(n_splits, config.workspace_bytes // per_split))
    if wave * r * d >= 2**31:  # 32-bit merge offsets; with workspace_bytes < 2**33 only a
        # single split of a huge batch can get here
        raise ValueError(f"the split path's workspace for {t} query rows x {hq} heads "
                         f"({wave * r * d} elements) reaches 2**31 elements, the merge's "
                         "32-bit offsets: split the batch")  # fmt: skip
    f32, dev = torch.float32, out.device
    ws_acc = torch.empty((wave, r, d), dtype=f32, device=dev)
    ws_m = torch.empty((wave, r), dtype=f32, device=dev)
    ws_l = torch.empty((wave, r), dtype=f32, device=dev)
    n_waves = math.ceil(n_splits / wave)
    if n_waves > 1:
        st_acc = torch.empty((r, d), dtype=f32, device=dev)
        st_m = torch.empty((d // m_cols, r), dtype=f32, device=dev)
        st_l = torch.empty((d // m_cols, r), dtype=f32, device=dev)
    else:
        st_acc, st_m, st_l = ws_acc, ws_m, ws_l
    merge_opts = _launch_opts(config.merge_warps, 1, dev, t)
    # At most one stage per partial of a wave (a deeper prologue only costs), rounded up to
    # a power of two so that eager calls compile few variants.
    merge_stages = min(config.merge_stages, triton.next_power_of_2(wave))
    for i in range(n_waves):
        base = i * wave
        launch_split((n_tiles, b * hkv, min(wave, n_splits - base)), base, (ws_m, ws_l, ws_acc), r)
        _attn_merge[merge_grid](
            out, meta.cu_q, meta.q_start, ws_m, ws_l, ws_acc, st_m, st_l, st_acc, base, wave, r,
            out.stride(0), out.stride(1), HKV=hkv, G=g, ROWS=m_rows, SPLIT=config.split, D=d,
            DC=m_cols, STAGES=merge_stages, FIRST=i == 0,
            LAST=i == n_waves - 1, **merge_opts,
        )  # fmt: skip
