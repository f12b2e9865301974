"""Attention input in one kernel: from the fused q | k | v projection rows, per-head RMSNorm of
q and k (Qwen3), RoPE, q to its own tensor, k and v into the paged caches.

One program per (token, head), so every value depends on its own token's row only. The steps
are those of the composed path (`lockstep.ops.base.ComposedAttentionInput`): head RMSNorm,
rounded to the activation dtype, then RoPE `x1*c - x2*s`, `x2*c + x1*s` from float32 tables,
then exact copies into the caches (an FP8 cache: divided by the layer's scale, then rounded);
the per-head sum of squares is reduced as two half-head sums (fixed by head_dim alone). One launch per layer instead of five (two head norms, two
RoPEs, one cache write): at small decode steps each launch costs more than its work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lockstep.ops.base import AttentionInput, LayerKV
from lockstep.ops.triton.launch import pdl_launch, wait_for_inputs


@triton.jit
def _attention_input_kernel(
    qkv, q_out, k_cache, v_cache, positions, slots, cos, sin, q_norm, k_norm,
    sqkv, sqt, sqh, skc, skh, svc, svh, sc, eps, k_scale, v_scale, HQ, HKV,
    HALF: tl.constexpr, HAS_NORM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q heads 0..HQ-1, then k heads, then v heads
    dd = tl.arange(0, HALF)
    src = qkv + t * sqkv + head * (2 * HALF)
    x1 = tl.load(src + dd)
    x2 = tl.load(src + HALF + dd)
    slot = tl.load(slots + t).to(tl.int64)
    # A negative slot marks a padding row (as in write_kv): nothing is written to the caches.
    writes = (dd * 0 + slot) >= 0  # broadcast: the interpreter wants a tensor mask
    if head >= HQ + HKV:  # v: an exact copy (to an FP8 cache: `_to_cache`)
        v_dst = v_cache + slot * svc + (head - HQ - HKV) * svh
        tl.store(v_dst + dd, _to_cache(x1, v_cache, v_scale), mask=writes)
        tl.store(v_dst + HALF + dd, _to_cache(x2, v_cache, v_scale), mask=writes)
    else:
        y1 = x1.to(tl.float32)
        y2 = x2.to(tl.float32)
        if HAS_NORM:
            is_q = (dd * 0 + head) < HQ
            w1 = tl.where(is_q, tl.load(q_norm + dd), tl.load(k_norm + dd)).to(tl.float32)
            w2 = tl.where(is_q, tl.load(q_norm + HALF + dd), tl.load(k_norm + HALF + dd))
            w2 = w2.to(tl.float32)
            var = (tl.sum(y1 * y1, 0) + tl.sum(y2 * y2, 0)) / (2 * HALF)
            rstd = 1.0 / tl.sqrt(var + eps)
            y1 = (y1 * rstd * w1).to(x1.dtype).to(tl.float32)
            y2 = (y2 * rstd * w2).to(x1.dtype).to(tl.float32)
        pos = tl.load(positions + t).to(tl.int64)
        c = tl.load(cos + pos * sc + dd)
        s = tl.load(sin + pos * sc + dd)
        o1 = (y1 * c - y2 * s).to(x1.dtype)
        o2 = (y2 * c + y1 * s).to(x1.dtype)
        # One name per pointer type: Triton's compiler refuses a variable that is a bf16
        # pointer in one branch and an e4m3 pointer in the other (an FP8 cache).
        if head < HQ:
            q_dst = q_out + t * sqt + head * sqh
            tl.store(q_dst + dd, o1)
            tl.store(q_dst + HALF + dd, o2)
        else:
            k_dst = k_cache + slot * skc + (head - HQ) * skh
            tl.store(k_dst + dd, _to_cache(o1, k_cache, k_scale), mask=writes)
            tl.store(k_dst + HALF + dd, _to_cache(o2, k_cache, k_scale), mask=writes)


@triton.jit
def _to_cache(x, cache, scale):
    """x in the cache's element type: unchanged for a cache of x's dtype; for an FP8 cache
    `lockstep.ops.fp8.quantize_kv`: x widened to fp32, divided by the layer's scale
    (`div_rn`, correctly rounded as torch's division; exact for 1.0), rounded to the nearest
    e4m3 value, ties to even, and saturated at +-448. The rounding is spelled out in fp32 so that
    every Triton backend gives it (the interpreter's own fp8 conversion does not round to
    nearest even): with ulp the e4m3 spacing at |x| (2^(e-3) for |x| in [2^e, 2^(e+1)), e >=
    -6; 2^-9 below), (|x| + ulp*2^23) - ulp*2^23 is |x| rounded to a multiple of ulp, ties to
    even, by fp32 addition; the result is exact in e4m3, so the final conversion is exact."""
    if cache.dtype.element_ty == x.dtype:
        return x
    bits = tl.div_rn(x.to(tl.float32), scale).to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # unbiased, e4m3's normal floor
    magic = ((exponent - 3 + 23 + 127) << 23).to(tl.float32, bitcast=True)
    mag = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    rounded = tl.minimum((mag + magic) - magic, 448.0)
    signed = rounded.to(tl.int32, bitcast=True) | (bits & -0x80000000)
    return signed.to(tl.float32, bitcast=True).to(cache.dtype.element_ty)


def attention_input(
    qkv: Tensor, layer: AttentionInput, positions: Tensor, slots: Tensor, kv: LayerKV
) -> Tensor:
    """See `lockstep.ops.base.Ops.attention_input`."""
    k_cache, v_cache = kv.k, kv.v
    num_heads, q_norm, k_norm = layer.num_heads, layer.q_norm, layer.k_norm
    eps, cos, sin = layer.eps, layer.cos, layer.sin
    if k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} must be [S, Hkv, D]"
        )
    t, hq, (hkv, d) = qkv.shape[0], num_heads, k_cache.shape[1:]
    if qkv.dim() != 2 or qkv.shape[1] != (hq + 2 * hkv) * d or qkv.stride(1) != 1:
        raise ValueError(f"attention_input wants qkv [T, {(hq + 2 * hkv) * d}] with rows "
                         f"contiguous; got {tuple(qkv.shape)}")  # fmt: skip
    half = d // 2
    if d % 2 or half & (half - 1):
        raise ValueError(f"head_dim={d} must be twice a power of two")
    if k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("caches must be contiguous along head_dim")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if (k_cache.dtype != qkv.dtype and not fp8) or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"caches {k_cache.dtype}/{v_cache.dtype} must share qkv's {qkv.dtype} or both be "
            "float8_e4m3fn"
        )
    if (
        cos.dtype != torch.float32
        or sin.dtype != torch.float32
        or cos.shape != sin.shape
        or cos.dim() != 2
        or cos.shape[1] != half
        or cos.stride() != sin.stride()
        or cos.stride(1) != 1
    ):
        raise ValueError(f"rope tables {tuple(cos.shape)}/{tuple(sin.shape)} must be float32 "
                         f"[P, {half}], alike and contiguous per row")  # fmt: skip
    for name, norm in (("q_norm", q_norm), ("k_norm", k_norm)):
        if norm is not None and norm.shape != (d,):
            raise ValueError(f"{name} {tuple(norm.shape)} != ({d},)")
    if positions.shape != (t,) or slots.shape != (t,):
        raise ValueError(f"positions {tuple(positions.shape)} / slots {tuple(slots.shape)} "
                         f"!= ({t},)")  # fmt: skip
    has_norm = q_norm is not None and k_norm is not None
    q = torch.empty((t, hq, d), dtype=qkv.dtype, device=qkv.device)
    if t:
        _attention_input_kernel[(t, hq + 2 * hkv)](
            qkv, q, k_cache, v_cache, positions, slots, cos, sin,
            q_norm if has_norm else qkv, k_norm if has_norm else qkv,
            qkv.stride(0), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), cos.stride(0), float(eps),
            float(kv.k_scale), float(kv.v_scale), hq, hkv,
            HALF=half, HAS_NORM=has_norm, num_warps=1, **pdl_launch(qkv.device, t),
        )  # fmt: skip
    return q
