"""Paged causal latent attention (MLA, absorbed form: `LatentAttentionOps.latent_attention`):
the paged-attention kernel family of `attention.py`, for one cache row per token shared by
every query head.

    cache row of a token (W = DL + DR values):   | latent c (DL)          | k_pe (DR) |
    its key: the whole row; its value: c         |<--- value (DL) ------->|
    q [T, H, W] per head:                        | q_lat (DL)             | q_pe (DR) |

    s = dot(q_pe, k_pe^T, dot(q_lat, c^T))       two tensor-core dots, the latent one first

The arithmetic of a row is `attention.py`'s, with the same guarantees and the same shared
pieces (its module docstring is the argument):

  * keys in blocks of BLOCK_N at absolute positions, grouped into splits of SPLIT keys at
    absolute positions, each split a fresh online softmax (max, sum, acc) in log2 units;
  * split partials folded in ascending order by the one `merge_partials`: in-kernel on the
    prefill and fold paths, by `_attn_merge` on the split path (`split_waves`, the same
    workspace layout as paged attention with one KV head of width DL);
  * the row sum of p is `row_sum_mma`, so decode tiles (16 rows) and prefill tiles (128 rows)
    sum p in the same MMA order; blocks wholly in a row's future are exact identities;
  * rows of a tile are (query position, head) pairs, `_tile_rows` with G = H: a V2-Lite
    decode tile is the 16 heads of one token, a prefill tile 8 positions x 16 heads;
  * the scores are the latent dot (K = DL) accumulated into by the RoPE dot (K = DR), in that
    order on every path; DL and DR are powers of two, so a W of 576 needs no padding;
  * value columns: a program accumulates DVC of the DL output columns (prefill tiles may cut
    them in chunks, `LatentConfig.value_cols`, to keep the fp32 accumulator in registers;
    each chunk recomputes the same scores, so the chunking changes no bit); with DVC = DL
    the loaded latent block is the key and the value at once, one read of the cache
    (decode tiles always);
  * FP8 (e4m3) caches are widened by `widen_kv` exactly as for paged attention (q and the
    score scale times 2**(KV_WIDEN_EXP/2), p times 2**KV_WIDEN_EXP before p @ V);
  * multiply-add contraction off (`enable_fp_fusion=False`).

A row's bits therefore depend only on q and cache rows 0..p of its sequence: the same across
prefill tiles, chunked prefill, decode (fold and split paths), batch-mates and CUDA-graph
replays (every launch's grid and workspace are sized by the call's shapes alone).

Shared memory per program (bf16): the q tile, ROWS x W x 2 bytes (18 KiB for 16 rows, 144 KiB
for 128), and per pipeline stage one cache block BLOCK_N x W x 2 bytes (36 KiB for 32 keys),
plus a DVC-wide value block when DVC < DL; `stages_that_fit` caps the stages on the device.
Registers: the fp32 accumulator ROWS x DVC over the program's threads (16 x 512 on 4 warps:
64 per thread; 128 x 256 on 8 warps: 128 per thread). Workspace of the split path: WAVE * T * H
* (DL + 2) * 4 bytes, bounded by `workspace_bytes`, never by context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lockstep.ops.base import AttentionMeta
from lockstep.ops.triton.attention import (
    KV_WIDEN_EXP,
    LOG2E,
    AttentionConfig,
    _block_slots,
    _tile_rows,
    attention_path,
    finalize_rows,
    merge_partials,
    needs_wide_offsets,
    row_sum_mma,
    scaled_kv,
    split_waves,
    stages_that_fit,
    widen_kv,
)
from lockstep.ops.triton.launch import interpreting, pdl_launch, wait_for_inputs


@dataclass(frozen=True)
class LatentConfig(AttentionConfig):
    """`AttentionConfig`'s fields with latent attention's values, and `value_cols`, the
    output columns a prefill-tile program accumulates (a power of two dividing the value
    width; speed only: module docstring). block_n and split are part of the numerics.
    Decode tiles: 16 rows (a V2-Lite token's heads) on 4 warps, the 512 value columns of
    one program's accumulator spread over them. Prefill tiles: 128 rows on 8 warps, two
    programs of 256 value columns each, one stage (the q tile takes 144 KiB of shared
    memory). Decode calls whose sequences span several splits always take the split path
    (fold_programs_per_sm infinite): a fold program walks its whole context alone, and
    timed slower than split + merge at every batch of the benchmark
    (scripts/latent_attention_bench.py)."""

    block_n: int = 32
    split: int = 256
    rows: int = 128
    rows_split: int = 16
    num_warps: int = 8
    num_warps_split: int = 4
    num_stages: int = 1
    num_stages_split: int = 2
    fold_programs_per_sm: float = math.inf
    value_cols: int = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        v = self.value_cols
        if v < 16 or v & (v - 1):
            raise ValueError(f"value_cols={v} must be a power of two >= 16")


# The production table (H200, Triton 3.6).
DEFAULT_LATENT_CONFIG = LatentConfig()


@triton.jit
def _latent_block(
    m, lsum, acc, q_lat, q_pe, cache, slots, sc, col0, pos, j0, hi, qk_scale,
    MASKED: tl.constexpr, BLOCK_N: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr,
    DVC: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    """One key block of the online softmax (`attention._block_update`'s steps): scores from
    the latent dot then the RoPE dot into it, values the latent columns col0 .. col0 + DVC.
    MASKED=0 only on blocks every valid row sees entirely (same bits, less work)."""
    offs_l = tl.arange(0, DL)
    offs_r = DL + tl.arange(0, DR)
    offs_j = j0 + tl.arange(0, BLOCK_N)
    if WIDE:
        slots = slots.to(tl.int64)
    row = cache + slots[:, None] * sc
    if MASKED:
        jmask = offs_j[:, None] < hi
        k_lat = tl.load(row + offs_l[None, :], mask=jmask, other=0.0)
        k_pe = tl.load(row + offs_r[None, :], mask=jmask, other=0.0)
    else:
        k_lat = tl.load(row + offs_l[None, :])
        k_pe = tl.load(row + offs_r[None, :])
    k_lat = widen_kv(k_lat, q_lat.dtype)
    k_pe = widen_kv(k_pe, q_lat.dtype)
    s = tl.dot(q_lat, tl.trans(k_lat))
    s = tl.dot(q_pe, tl.trans(k_pe), s)
    if MASKED:
        s = tl.where(offs_j[None, :] <= pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1) * qk_scale)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.where(m == m_new, 1.0, tl.exp2(m - m_use))
    p = tl.exp2(s * qk_scale - m_use[:, None])
    if DVC == DL:  # the key's latent columns are the value
        v = k_lat
    else:
        offs_v = col0 + tl.arange(0, DVC)
        if MASKED:
            v = tl.load(row + offs_v[None, :], mask=jmask, other=0.0)
        else:
            v = tl.load(row + offs_v[None, :])
        v = widen_kv(v, q_lat.dtype)
    pv = p.to(v.dtype)
    lsum = lsum * alpha + row_sum_mma(pv, BLOCK_N)
    if scaled_kv(cache, q_lat.dtype):  # undo the widening's 2**-KV_WIDEN_EXP (exact; pv <= 1)
        pv = (pv.to(tl.float32) * (2.0**KV_WIDEN_EXP)).to(v.dtype)
    acc = tl.dot(pv, v, acc * alpha[:, None])
    return m_new, lsum, acc


@triton.jit
def _latent_split(
    q_lat, q_pe, cache, slots_ptr, sc, col0, pos, pos_lo, lo, hi, qk_scale,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr,
    DVC: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    """Online softmax over keys [lo, hi) (lo a multiple of BLOCK_N), fresh state, blocks
    ascending; those wholly at or before pos_lo (the tile's first position) skip the mask.

        lo           mid            hi
        |unmasked     |masked (causal)|"""
    m = tl.full([ROWS], float("-inf"), tl.float32)
    lsum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DVC], tl.float32)
    mid = lo + tl.maximum(tl.minimum(pos_lo + 1, hi) - lo, 0) // BLOCK_N * BLOCK_N
    for j0 in range(lo, mid, BLOCK_N):
        m, lsum, acc = _latent_block(
            m, lsum, acc, q_lat, q_pe, cache, _block_slots(slots_ptr, j0, hi, False, BLOCK_N),
            sc, col0, pos, j0, hi, qk_scale, False, BLOCK_N, DL, DR, DVC, WIDE,
        )  # fmt: skip
    for j0 in range(mid, hi, BLOCK_N):
        m, lsum, acc = _latent_block(
            m, lsum, acc, q_lat, q_pe, cache, _block_slots(slots_ptr, j0, hi, True, BLOCK_N),
            sc, col0, pos, j0, hi, qk_scale, True, BLOCK_N, DL, DR, DVC, WIDE,
        )  # fmt: skip
    return m, lsum, acc


@triton.jit
def _latent_fwd(
    q, cache, out, cu_q, q_start, cu_kv, slot_table, ws_m, ws_l, ws_acc, wave_base, R, sqt, sqh,
    sc, sot, soh, qk_scale, H: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr, DVC: tl.constexpr,
    WRITE_PARTIALS: tl.constexpr, WIDE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Prefill and fold paths (WRITE_PARTIALS=0): one program per (tile, sequence, chunk of
    DVC value columns), every split folded in-kernel. Split path (WRITE_PARTIALS=1, DVC =
    DL): one program per (tile, sequence, split of this wave), partials to the workspace
    in `_attn_merge`'s layout (one KV head, G = H)."""
    wait_for_inputs(PDL)
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # latest positions (longest) first
    b = tl.program_id(1)
    tok, head, valid, pos, hi = _tile_rows(cu_q, q_start, b, tile, H, ROWS)
    qrow = q + tok.to(tl.int64)[:, None] * sqt + head.to(tl.int64)[:, None] * sqh
    q_lat = tl.load(qrow + tl.arange(0, DL)[None, :], mask=valid[:, None], other=0.0)
    q_pe = tl.load(qrow + DL + tl.arange(0, DR)[None, :], mask=valid[:, None], other=0.0)
    if scaled_kv(cache, q_lat.dtype):  # the cache is widened times 2**-KV_WIDEN_EXP: undo it
        q_lat = (q_lat.to(tl.float32) * (2.0 ** (KV_WIDEN_EXP // 2))).to(q_lat.dtype)
        q_pe = (q_pe.to(tl.float32) * (2.0 ** (KV_WIDEN_EXP // 2))).to(q_pe.dtype)
        qk_scale = qk_scale * (2.0 ** (KV_WIDEN_EXP // 2))
    slots_ptr = slot_table + tl.load(cu_kv + b)
    pos_lo = tl.min(tl.where(valid, pos, hi), 0)
    if WRITE_PARTIALS:
        lo = (wave_base + tl.program_id(2)) * SPLIT
        m, lsum, acc = _latent_split(
            q_lat, q_pe, cache, slots_ptr, sc, 0, pos, pos_lo, lo, tl.minimum(lo + SPLIT, hi),
            qk_scale, ROWS, BLOCK_N, DL, DR, DVC, WIDE,
        )  # fmt: skip
        wrow = tl.program_id(2).to(tl.int64) * R + tok.to(tl.int64) * H + head
        smask = valid & (pos * 0 + lo < hi)  # broadcast: the interpreter wants a bool tensor
        tl.store(ws_m + wrow, m, mask=smask)
        tl.store(ws_l + wrow, lsum, mask=smask)
        tl.store(ws_acc + wrow[:, None] * DL + tl.arange(0, DL)[None, :], acc,
                 mask=smask[:, None])  # fmt: skip
    else:
        col0 = tl.program_id(2) * DVC
        m_s = tl.full([ROWS], float("-inf"), tl.float32)
        l_s = tl.zeros([ROWS], tl.float32)
        acc_s = tl.zeros([ROWS, DVC], tl.float32)
        for lo in range(0, hi, SPLIT):
            m, lsum, acc = _latent_split(
                q_lat, q_pe, cache, slots_ptr, sc, col0, pos, pos_lo, lo,
                tl.minimum(lo + SPLIT, hi), qk_scale, ROWS, BLOCK_N, DL, DR, DVC, WIDE,
            )  # fmt: skip
            m_s, l_s, acc_s = merge_partials(m_s, l_s, acc_s, m, lsum, acc)
        o = finalize_rows(l_s, acc_s)
        orow = tok.to(tl.int64) * sot + head.to(tl.int64) * soh
        offs_o = orow[:, None] + col0 + tl.arange(0, DVC)[None, :]
        tl.store(out + offs_o, o.to(out.dtype.element_ty), mask=valid[:, None])


def width_refusal(latent: int, rope: int) -> str | None:
    """The kernel's one shape rule, in the model's terms: the latent and the RoPE key are
    each a power of two of at least 16 (the two dots' K widths; 512 and 64 in every
    DeepSeek-V2/V3 and GLM-4.7-Flash size). None where the widths are fine."""
    for name, d in (("kv_lora_rank", latent), ("qk_rope_head_dim", rope)):
        if d < 16 or d & (d - 1):
            return (f"{name}={d}: the Triton latent-attention kernel takes a latent and a RoPE "
                    "width that are each a power of two >= 16")  # fmt: skip
    return None


def _check(q: torch.Tensor, cache: torch.Tensor, value_dim: int) -> None:
    if q.dim() != 3 or cache.dim() != 3 or cache.shape[1] != 1 or q.shape[2] != cache.shape[2]:
        raise ValueError(f"latent attention wants q [T, H, W] and a cache [S, 1, W]; got "
                         f"{tuple(q.shape)}, {tuple(cache.shape)}")  # fmt: skip
    refusal = width_refusal(value_dim, q.shape[2] - value_dim)
    if refusal is not None:
        raise ValueError(refusal)
    fp8_cache = cache.dtype == torch.float8_e4m3fn
    if q.dtype != cache.dtype and not (fp8_cache and q.dtype in (torch.bfloat16, torch.float32)):
        raise ValueError(f"dtypes differ: q {q.dtype}, cache {cache.dtype}; the cache must have "
                         "q's dtype or be float8_e4m3fn (bfloat16 or float32 q)")  # fmt: skip
    if q.stride(2) != 1 or cache.stride(2) != 1:
        raise ValueError("latent attention wants the W axis contiguous")


def latent_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMeta,
    scale: float,
    value_dim: int,
    config: LatentConfig = DEFAULT_LATENT_CONFIG,
    force_path: str | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Causal latent attention of q [T, H, W] over the cache rows [S, 1, W] (module
    docstring): scores q . row * scale, values row[:value_dim]; [T, H, value_dim] in q's
    dtype (or `out_dtype`). The path is speed only, all three give the same bits: "prefill"
    for calls with a chunk longer than `config.split_path_max_q`, else decode tiles on
    "fold" or "split" (`attention.decode_path`). `force_path` and `out_dtype` exist for
    tests and benchmarks."""
    _check(q, cache, value_dim)
    t, h, w = q.shape
    dl, dr = value_dim, w - value_dim
    out = torch.empty((t, h, dl), dtype=out_dtype or q.dtype, device=q.device)
    if t == 0 or meta.num_seqs == 0:
        return out
    if force_path not in (None, "prefill", "fold", "split"):
        raise ValueError(f"force_path={force_path!r} is invalid: expected prefill, fold or "
                         "split")  # fmt: skip
    path = force_path or attention_path(config, meta, h, 1, q.device)
    prefill = path == "prefill"
    rows = config.rows if prefill else config.rows_split
    dvc = min(config.value_cols, dl) if prefill else dl
    n_tiles = triton.cdiv(meta.max_q * h, rows)
    stages = stages_that_fit(
        config.num_stages if prefill else config.num_stages_split, rows, config.block_n, q, cache
    )
    opts = {"num_warps": config.num_warps if prefill else config.num_warps_split,
            "num_stages": stages}  # fmt: skip
    if not interpreting():  # no multiply-add contraction (module docstring)
        opts["enable_fp_fusion"] = False
    pdl = pdl_launch(q.device, t)
    common = (meta.cu_q, meta.q_start, meta.cu_kv, meta.slot_table)
    strides = (q.stride(0), q.stride(1), cache.stride(0))
    out_strides = (out.stride(0), out.stride(1))
    consts = dict(H=h, ROWS=rows, BLOCK_N=config.block_n, SPLIT=config.split, DL=dl, DR=dr,
                  WIDE=needs_wide_offsets(cache), **opts)  # fmt: skip
    qk_scale = float(scale) * LOG2E
    if path in ("prefill", "fold"):
        _latent_fwd[(n_tiles, meta.num_seqs, dl // dvc)](
            q, cache, out, *common, q, q, q, 0, 0, *strides, *out_strides, qk_scale, DVC=dvc,
            WRITE_PARTIALS=0, **consts, **pdl,
        )  # fmt: skip
        return out

    def launch_split(grid: tuple[int, int, int], base: int, ws: tuple, r: int) -> None:
        _latent_fwd[grid](
            q, cache, out, *common, *ws, base, r, *strides, *out_strides, qk_scale, DVC=dl,
            WRITE_PARTIALS=1, **consts, **pdl,
        )  # fmt: skip

    split_waves(out, meta, config, n_tiles, 1, h, dl, rows, launch_split)
    return out
