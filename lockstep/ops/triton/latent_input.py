"""MLA's attention input in two kernels (`LatentAttentionOps.write_latent_row` and
`latent_query`): RoPE of the key and query tails, the cache row written, the query assembled.

    kv_a row of a token:  | latent (R, normed before) | k_rope (dr) |
    its cache row:        | latent                    | rope(k_rope) |   at its slot
    query of (token, h):  | q_lat (R, W_UK^T q_nope)  | rope(q_rope) |   [T, H, R + dr]

The composed path (`lockstep.ops.base.ComposedLatentInput`) takes about nine torch kernels per
RoPE and a few copies per layer: at batch-1 decode each is a launch for almost no work. These
kernels do the same arithmetic in two launches and read the RoPE parts in place (strided
views of the projections, no copies).

The bits are the composed path's, value by value: RoPE `x1*c - x2*s`, `x2*c + x1*s` in float32
from the float32 tables at the token's position (one rounding per product and per sum:
multiply-add contraction is off, `enable_fp_fusion=False`), rounded to the activation dtype,
then to the destination's dtype as `IndexCopyKVWrite.write_latent` rounds (bf16: nearest even;
float8_e4m3fn: `e4m3_sat` at scale 1.0). Every rounding is spelled out in integer and fp32
arithmetic (`_stored_as`), so the Triton interpreter, whose own float conversions truncate,
computes the GPU's bits. One program per token (the cache row) or per (token, head) (the
query): a value depends only on its own token's inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lockstep.ops.triton.attention_input import _to_cache
from lockstep.ops.triton.launch import interpreting, pdl_launch, wait_for_inputs

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)


@triton.jit
def _bf16_rounded(x):
    """float32 x rounded to the nearest bfloat16 value, ties to even, as a float32 (exact in
    bf16, so converting it afterwards is exact however the conversion rounds): add half an
    ulp of bf16 minus one, plus the kept part's lowest bit, to the bits, then drop the low 16.
    Overflow goes to +-inf as in a hardware conversion; NaN stays NaN."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return tl.where(x == x, rounded.to(tl.float32, bitcast=True), x)


@triton.jit
def _stored_as(x, dst):
    """x in the element type of the pointer `dst`, rounded as torch's `.to` rounds it
    (float32 -> bf16: nearest even; to float8_e4m3fn: `e4m3_sat`, `attention_input._to_cache`
    at scale 1.0; a widening or the same type: exact)."""
    ty = dst.dtype.element_ty
    if ty == x.dtype:
        return x
    if ty == tl.float32:
        return x.to(tl.float32)
    if ty == tl.bfloat16:
        return _bf16_rounded(x.to(tl.float32)).to(tl.bfloat16)
    return _to_cache(x, dst, 1.0)


@triton.jit
def _rotated(src, pos, cos, sin, s_cos, dd, live, HALF: tl.constexpr):
    """Rotate-half RoPE of the dr = 2 HALF values at `src` (x1 | x2) at position `pos`:
    (x1*c - x2*s, x2*c + x1*s) in float32, each rounded to src's dtype."""
    c = tl.load(cos + pos * s_cos + dd, mask=live, other=0.0)
    s = tl.load(sin + pos * s_cos + dd, mask=live, other=0.0)
    x1 = tl.load(src + dd, mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + dd, mask=live, other=0.0).to(tl.float32)
    return _stored_as(x1 * c - x2 * s, src), _stored_as(x2 * c + x1 * s, src)


@triton.jit
def _latent_row_kernel(
    latent, k_rope, cache, positions, slots, cos, sin, s_lat, s_rope, s_cache, s_cos,
    R: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    rr = tl.arange(0, BLOCK_R)
    dd = tl.arange(0, BLOCK_H)
    slot = tl.load(slots + t).to(tl.int64)
    pos = tl.load(positions + t).to(tl.int64)
    # A negative slot marks a padding row (as in attention_input): nothing is written.
    writes = (rr * 0 + slot) >= 0
    x = tl.load(latent + t * s_lat + rr, mask=rr < R, other=0.0)
    row = cache + slot * s_cache
    tl.store(row + rr, _stored_as(x, cache), mask=writes & (rr < R))
    live = dd < HALF
    o1, o2 = _rotated(k_rope + t * s_rope, pos, cos, sin, s_cos, dd, live, HALF)
    rope_writes = live & ((dd * 0 + slot) >= 0)
    tl.store(row + R + dd, _stored_as(o1, cache), mask=rope_writes)
    tl.store(row + R + HALF + dd, _stored_as(o2, cache), mask=rope_writes)


@triton.jit
def _latent_query_kernel(
    q_lat, q_rope, out, positions, cos, sin, s_lt, s_lh, s_rt, s_rh, s_ot, s_oh, s_cos,
    R: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    rr = tl.arange(0, BLOCK_R)
    dd = tl.arange(0, BLOCK_H)
    pos = tl.load(positions + t).to(tl.int64)
    dst = out + t * s_ot + h * s_oh
    x = tl.load(q_lat + t * s_lt + h * s_lh + rr, mask=rr < R, other=0.0)
    tl.store(dst + rr, x, mask=rr < R)
    live = dd < HALF
    o1, o2 = _rotated(q_rope + t * s_rt + h * s_rh, pos, cos, sin, s_cos, dd, live, HALF)
    tl.store(dst + R + dd, _stored_as(o1, out), mask=live)
    tl.store(dst + R + HALF + dd, _stored_as(o2, out), mask=live)


def _launch_opts(num_warps: int, device: torch.device, tokens: int) -> dict:
    opts = {"num_warps": num_warps, **pdl_launch(device, tokens)}
    if not interpreting():  # no multiply-add contraction (module docstring)
        opts["enable_fp_fusion"] = False
    return opts


def _check_tables(cos: Tensor, sin: Tensor, half: int) -> None:
    if (
        cos.dtype != torch.float32
        or sin.dtype != torch.float32
        or cos.dim() != 2
        or cos.shape != sin.shape
        or cos.shape[1] != half
        or cos.stride() != sin.stride()
        or cos.stride(1) != 1
    ):
        raise ValueError(f"rope tables {tuple(cos.shape)}/{tuple(sin.shape)} must be float32 "
                         f"[P, {half}], alike and contiguous per row")  # fmt: skip


def _check_rows(name: str, x: Tensor, dims: int) -> None:
    if x.dim() != dims or x.stride(-1) != 1 or x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"{name} must be [{'T, H, D' if dims == 3 else 'T, D'}] float32 or "
                         f"bfloat16 with its last dim contiguous; got {tuple(x.shape)} "
                         f"{x.dtype}, strides {x.stride()}")  # fmt: skip


def write_latent_row(
    cache: Tensor, latent: Tensor, k_rope: Tensor, positions: Tensor, cos: Tensor,
    sin: Tensor, slots: Tensor,
) -> None:  # fmt: skip
    """See `lockstep.ops.base.LatentAttentionOps.write_latent_row`."""
    _check_rows("latent", latent, 2)
    _check_rows("k_rope", k_rope, 2)
    (t, r), dr = latent.shape, k_rope.shape[1]
    if k_rope.shape[0] != t or dr % 2 or k_rope.dtype != latent.dtype:
        raise ValueError(f"k_rope {tuple(k_rope.shape)} {k_rope.dtype} must be [{t}, even] "
                         f"of latent's {latent.dtype}")  # fmt: skip
    if cache.dim() != 3 or cache.shape[1:] != (1, r + dr) or cache.stride(2) != 1:
        raise ValueError(f"cache {tuple(cache.shape)} must be [S, 1, {r + dr}], rows "
                         "contiguous")  # fmt: skip
    if cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"cache dtype {cache.dtype} is not one of {CACHE_DTYPES}")
    _check_tables(cos, sin, dr // 2)
    if positions.shape != (t,) or slots.shape != (t,):
        raise ValueError(f"positions {tuple(positions.shape)} / slots {tuple(slots.shape)} "
                         f"!= ({t},)")  # fmt: skip
    if t:
        _latent_row_kernel[(t,)](
            latent, k_rope, cache, positions, slots, cos, sin, latent.stride(0),
            k_rope.stride(0), cache.stride(0), cos.stride(0), R=r, HALF=dr // 2,
            BLOCK_R=triton.next_power_of_2(r), BLOCK_H=triton.next_power_of_2(dr // 2),
            **_launch_opts(4, latent.device, t),
        )  # fmt: skip


def latent_query(q_lat: Tensor, q_rope: Tensor, positions: Tensor, cos: Tensor,
                 sin: Tensor) -> Tensor:  # fmt: skip
    """See `lockstep.ops.base.LatentAttentionOps.latent_query`."""
    _check_rows("q_lat", q_lat, 3)
    _check_rows("q_rope", q_rope, 3)
    (t, h, r), dr = q_lat.shape, q_rope.shape[2]
    if q_rope.shape[:2] != (t, h) or dr % 2:
        raise ValueError(f"q_rope {tuple(q_rope.shape)} must be [{t}, {h}, even]")
    _check_tables(cos, sin, dr // 2)
    if positions.shape != (t,):
        raise ValueError(f"positions {tuple(positions.shape)} != ({t},)")
    out = torch.empty((t, h, r + dr), dtype=q_lat.dtype, device=q_lat.device)
    if t and h:
        _latent_query_kernel[(t, h)](
            q_lat, q_rope, out, positions, cos, sin, q_lat.stride(0), q_lat.stride(1),
            q_rope.stride(0), q_rope.stride(1), out.stride(0), out.stride(1), cos.stride(0),
            R=r, HALF=dr // 2, BLOCK_R=triton.next_power_of_2(r),
            BLOCK_H=triton.next_power_of_2(dr // 2), **_launch_opts(2, q_lat.device, t),
        )  # fmt: skip
    return out
