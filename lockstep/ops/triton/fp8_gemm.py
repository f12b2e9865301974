"""Position-invariant FP8 linears: row-local activation quantization to e4m3, then an FP8 GEMM
on the tensor cores. Implements `lockstep.ops.fp8` (the numeric specification) on the GPU.

Quantization (`quantize_activation`, one kernel): row m's e4m3 values and scales depend only on
row m. Per 128-column group ("block"), per row ("channel") or with the checkpoint's static
scale ("tensor"): amax is a max (exact in any order), scale = div_rn(max(amax, AMAX_FLOOR),
448), q = e4m3_sat_rne(div_rn(x, scale)). The e4m3 rounding is done in integer arithmetic on
the fp32 bits (`_e4m3_sat_rne`), not by a cast, so the interpreter (whose fp8 cast neither
saturates nor rounds to nearest even) and the GPU produce the same bits as the spec's
`x.clamp(-448, 448).to(torch.float8_e4m3fn)`.

The GEMM (`fp8_gemm`), what every output element computes, for every M:

    total = 0
    for b in 0, 1, ..., ceil(K / 128) - 1:                  K blocks = the scale blocks
        p     = dot(Xq[m, 128b : 128b+128], Wq[n, same])     e4m3 tensor-core dot, fp32, from 0
        total = total + p * (sx[m, b] * sw[n, b])            fp32, three roundings, no FMA
    y[m, n] = cast(total + bias[n])

A partial last block reads zeros past K (masked loads, or TMA's out-of-bounds fill). Each block's
dot starts from zero, so the tensor cores' reduced-precision FP8 accumulation (on Hopper) spans
128 products at most and the sum over blocks is fp32 on the CUDA cores, in ascending order,
never split. Multiply-add contraction is off (`enable_fp_fusion=False`) so the three roundings
are those written. The tile shape is a speed choice from `TILE_TABLE`, keyed by M, N and K (never
autotuned at run time). Every table config uses the same MMA flavour, wgmma (BM a multiple of
64), whose per-block sum is what the bits rest on: at BM 16 or 32 Triton compiles the dot to
mma.sync on e4m3 values widened to fp16 (the sm_90 PTX shows it), another accumulation.
tests/kernels/test_fp8_gemm.py checks rows for every M across the table's buckets on the GPU, and under
the interpreter the indexing, masking and block order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lockstep.ops.fp8 import AMAX_FLOOR, BLOCK, E4M3, E4M3_MAX, SCHEMES
from lockstep.ops.triton.launch import interpreting, pdl_launch, wait_for_inputs

SCALE_BLOCK = BLOCK  # the weight's scale block (N and K) and the activation group ("block")
# The spec's constants as compile-time values of the kernels.
_FLOOR = tl.constexpr(AMAX_FLOOR)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
# The kernels' scale modes (constexpr), one per scheme.
_MODE = {"block": 0, "tensor": 1, "channel": 2}
_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Fp8GemmConfig:
    bm: int
    bn: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    tma: bool = True


_INF = 1 << 62
_C = Fp8GemmConfig
# (largest M, largest N, largest K, config): the first row that fits is used. BK is always 128
# (the scale block); BM is 64 or 128 everywhere (wgmma; see the module docstring). Chosen from
# `python -m bench.fp8_gemm` on the H200 (docs/results.md, "FP8 GEMM"): 64 x 64 tiles to M 256
# (at N <= 8192; 64 x 128 above), 64 x 128 tiles up to M 1024 and for K <= 8192, 128 x 128 on
# 8 warps for the long K of down projections at M > 1024 (GROUP_M 16 for L2 reuse).
TILE_TABLE: tuple[tuple[int, int, int, Fp8GemmConfig], ...] = (
    (16, _INF, _INF, _C(64, 64, 4, 6)),
    (128, 8192, _INF, _C(64, 64, 4, 6)),
    (256, 8192, _INF, _C(64, 64, 4, 4)),
    (1024, _INF, _INF, _C(64, 128, 4, 4)),
    (_INF, _INF, 8192, _C(64, 128, 4, 4)),
    (_INF, _INF, _INF, _C(128, 128, 8, 4, group_m=16)),
)


def pick_config(m: int, n: int, k: int) -> Fp8GemmConfig:
    for max_m, max_n, max_k, cfg in TILE_TABLE:
        if m <= max_m and n <= max_n and k <= max_k:
            return cfg
    raise AssertionError("TILE_TABLE must end with an unbounded bucket")


# ---------------------------------------------------------------------------- quantization


@triton.jit
def _e4m3_sat_rne(v):
    """fp32 -> e4m3fn code (uint8): clamp to +-448, round to nearest, ties to even. |v| >= 2**-6
    (e4m3 normal): round the 23-bit mantissa to 3 bits on the integer bits (a carry moves into
    the exponent; the exponent is rebiased from 127 to 7). Below: a multiple of 2**-9, rounded
    by an fp32 add of 2**23 (exact scaling by 512, then RNE to an integer 0..8; 8 is 2**-6)."""
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    scaled = mag.to(tl.float32, bitcast=True) * 512.0
    sub = ((scaled + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(mag >= (121 << 23), normal, sub)
    return (code | sign).to(tl.uint8)


@triton.jit
def _row_ptr(x, row, ROWS_PER_BATCH, sxb, sxt):
    """Address of row `row` of a 2-D [M, K] (ROWS_PER_BATCH = M, sxb = 0) or 3-D [B, T, K]
    (ROWS_PER_BATCH = T) input with any strides."""
    r = row.to(tl.int64)
    return x + (r // ROWS_PER_BATCH) * sxb + (r % ROWS_PER_BATCH) * sxt


@triton.jit
def _quantize_kernel(
    x, q, scale, static_scale, K, ROWS_PER_BATCH, sxb, sxt, sxk, sq, ss,
    MODE: tl.constexpr, GROUPS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (row, g): GROUPS 128-column groups of one row. MODE 0: a scale per group
    (stored); 1: the static scale; 2: one scale for the row (this program loops over the
    whole row for its amax first; grid (M, 1)). The amax is a max: its order cannot matter."""
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    xrow = _row_ptr(x, row, ROWS_PER_BATCH, sxb, sxt)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    c = tl.arange(0, 128)
    if MODE == 2:
        amax = tl.zeros([GROUPS], tl.float32)
        for start in range(0, K, 128 * GROUPS):
            cols = start + g[:, None] * 128 + c[None, :]
            v = tl.load(xrow + cols * sxk, mask=cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
        s = tl.div_rn(tl.maximum(tl.max(amax, axis=0), _FLOOR), _E4M3_MAX)
        tl.store(scale + row.to(tl.int64) * ss, s)
        for start in range(0, K, 128 * GROUPS):
            cols = start + g[:, None] * 128 + c[None, :]
            v = tl.load(xrow + cols * sxk, mask=cols < K, other=0.0).to(tl.float32)
            q_ptrs = q + row.to(tl.int64) * sq + cols
            tl.store(q_ptrs, _e4m3_sat_rne(tl.div_rn(v, s)), mask=cols < K)
    else:
        cols = g[:, None] * 128 + c[None, :]
        v = tl.load(xrow + cols * sxk, mask=cols < K, other=0.0).to(tl.float32)
        if MODE == 0:
            s = tl.div_rn(tl.maximum(tl.max(tl.abs(v), axis=1), _FLOOR), _E4M3_MAX)
            tl.store(scale + row.to(tl.int64) * ss + g, s, mask=g * 128 < K)
            s = s[:, None]
        else:
            s = tl.load(static_scale)
        q_ptrs = q + row.to(tl.int64) * sq + cols
        tl.store(q_ptrs, _e4m3_sat_rne(tl.div_rn(v, s)), mask=cols < K)


def _rows_view(x: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(M, rows per batch, batch stride, row stride, column stride) of a 2-D or 3-D input."""
    if x.dim() == 2:
        return x.shape[0], max(x.shape[0], 1), 0, x.stride(0), x.stride(1)
    if x.dim() == 3:
        b, t, _ = x.shape
        return b * t, max(t, 1), x.stride(0), x.stride(1), x.stride(2)
    raise ValueError(f"FP8 input must be 2-D [M, K] or 3-D [B, T, K], got shape {list(x.shape)}")


def quantize_activation(
    x: torch.Tensor, scheme: str, input_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] or [B, T, K] (bf16/fp16/fp32, any strides) -> (q e4m3 [B*T or M, K], sx fp32):
    sx [M, ceil(K/128)] for "block", [M, 1] for "channel", `input_scale` as [1] for "tensor".
    q's rows are 16-byte aligned (its row stride is K rounded up to 16) so that TMA can read
    it; the bits are `lockstep.ops.fp8.quantize_rows` / `quantize_static`."""
    if scheme not in SCHEMES:
        raise ValueError(f"FP8 scheme {scheme!r} is invalid: expected one of {SCHEMES}")
    if x.dtype not in _ACT_DTYPES:
        raise ValueError(f"FP8 input dtype {x.dtype} is invalid: expected one of {_ACT_DTYPES}")
    m, per_batch, sxb, sxt, sxk = _rows_view(x)
    k = x.shape[-1]
    if k == 0:
        raise ValueError("FP8 linear over an empty K axis")
    groups = triton.cdiv(k, SCALE_BLOCK)
    q = torch.empty((m, triton.cdiv(k, 16) * 16), dtype=E4M3, device=x.device)[:, :k]
    if scheme == "tensor":
        if input_scale is None or input_scale.numel() != 1 or input_scale.dtype != torch.float32:
            raise ValueError("FP8 scheme 'tensor' needs input_scale: one float32 value")
        sx = input_scale.reshape(1)
        cols = 1
    else:
        if input_scale is not None:
            raise ValueError(f"FP8 scheme {scheme!r} takes no input_scale (dynamic per token)")
        cols = groups if scheme == "block" else 1
        sx = torch.empty((m, cols), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, sx
    mode = _MODE[scheme]
    per_program = 8 if mode != 2 else 4
    grid = (m, triton.cdiv(groups, per_program) if mode != 2 else 1)
    _quantize_kernel[grid](
        x, q.view(torch.uint8), sx, sx, k, per_batch, sxb, sxt, sxk, q.stride(0), sx.stride(0),
        MODE=mode, GROUPS=per_program, num_warps=4,
        **pdl_launch(x.device, m),
    )  # fmt: skip
    return q, sx


# -------------------------------------------------------------------------------------- GEMM


@triton.jit
def _tile_ids(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped tile order for L2 reuse; it changes which program computes a tile, never its bits.
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % group) % size_m, (pid % group) // size_m


# M is not specialized (Triton would compile M == 1 apart): one binary per config for all M.
@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    x, w, sx, sw, bias, y, M, N, K, sxm, swn, sym, s_sxm, s_swn,
    MODE: tl.constexpr, HAS_BIAS: tl.constexpr, TMA: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """y = Xq @ Wq.T with per-block scales (+ bias) for one output tile, K order as in the
    module docstring. x, w: e4m3 pointers, or (TMA) tensor descriptors. MODE 0 "block": sx
    [M, K/128], sw [N/128, K/128]; 1 "tensor": sx one value, sw [N]; 2 "channel": sx [M, 1],
    sw [N]."""
    wait_for_inputs(PDL)
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BM, BN, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    # Clamp out-of-range rows/cols to a valid one instead of masking: never stored.
    rm_c = tl.where(rm < M, rm, M - 1).to(tl.int64)
    rn_c = tl.where(rn < N, rn, N - 1).to(tl.int64)
    if MODE == 1:
        s = tl.load(sx) * tl.load(sw + rn_c)[None, :]
        s = tl.broadcast_to(s, [BM, BN])
    elif MODE == 2:
        s = tl.load(sx + rm_c * s_sxm)[:, None] * tl.load(sw + rn_c)[None, :]
    elif MODE == 0:
        # Block scales are loaded one K block ahead (carried through the loop) so that their
        # latency hides behind a dot; the values and the arithmetic are block b's. A tile
        # whose columns lie in one 128-row weight block (BN divides 128) reads one scalar.
        sx_row = sx + rm_c * s_sxm
        if 128 % BN == 0:
            sw_row = sw + ((pid_n * BN) // 128).to(tl.int64) * s_swn
        else:
            sw_row = sw + (rn_c // 128) * s_swn
        sx_next = tl.load(sx_row)
        sw_next = tl.load(sw_row)
        last_blk = tl.cdiv(K, BK) - 1
    rk = tl.arange(0, BK)
    if not TMA:
        x_ptrs = x + rm_c[:, None] * sxm + rk[None, :]
        w_ptrs = w + rn_c[None, :] * swn + rk[:, None]
    total = tl.zeros([BM, BN], tl.float32)
    for kb in range(0, K, BK):
        if MODE == 0:
            sx_b = sx_next
            sw_b = sw_next
            ahead = tl.minimum(kb // BK + 1, last_blk)
            sx_next = tl.load(sx_row + ahead)
            sw_next = tl.load(sw_row + ahead)
            if 128 % BN == 0:
                s = (sx_b * sw_b)[:, None]
            else:
                s = sx_b[:, None] * sw_b[None, :]
        if TMA:
            a = x.load([pid_m * BM, kb])
            b = w.load([pid_n * BN, kb])
            p = tl.dot(a, b.T)
        else:
            a = tl.load(x_ptrs, mask=rk[None, :] < K - kb, other=0.0)
            b = tl.load(w_ptrs, mask=rk[:, None] < K - kb, other=0.0)
            p = tl.dot(a, b)
            x_ptrs += BK
            w_ptrs += BK
        total = total + p * s
    if HAS_BIAS:
        total = total + tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    ptrs = y + rm[:, None].to(tl.int64) * sym + rn[None, :]
    tl.store(ptrs, total.to(y.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA needs a 16-byte aligned base and row stride (and a unit column stride)."""
    return t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0


def fp8_gemm(
    q: torch.Tensor,
    sx: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    scheme: str,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """q e4m3 [M, K] (unit column stride) and sx from `quantize_activation`; weight e4m3
    [N, K] (unit column stride), weight_scale fp32 ("block": [ceil(N/128), ceil(K/128)], else
    [N]); bias [N] or None -> [M, N] in out_dtype. `config` overrides the tile table (tests and
    benchmarks; the table's configs give the same bits)."""
    if scheme not in SCHEMES:
        raise ValueError(f"FP8 scheme {scheme!r} is invalid: expected one of {SCHEMES}")
    if q.dim() != 2 or weight.dim() != 2 or q.shape[1] != weight.shape[1]:
        raise ValueError(f"fp8_gemm wants q [M, K] and weight [N, K]; got {list(q.shape)}, "
                         f"{list(weight.shape)}")  # fmt: skip
    if q.dtype != E4M3 or weight.dtype != E4M3:
        raise ValueError(f"fp8_gemm dtypes q={q.dtype} weight={weight.dtype}: expected {E4M3}")
    if q.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("fp8_gemm wants the K axis contiguous in q and weight")
    if out_dtype not in _ACT_DTYPES:
        raise ValueError(f"fp8_gemm out_dtype {out_dtype} is invalid: expected {_ACT_DTYPES}")
    m, k = q.shape
    n = weight.shape[0]
    cfg = config or pick_config(m, n, k)
    kb = triton.cdiv(k, SCALE_BLOCK)
    want_sw = (triton.cdiv(n, SCALE_BLOCK), kb) if scheme == "block" else (n,)
    want_sx = {"block": (m, kb), "channel": (m, 1), "tensor": (1,)}[scheme]
    for name, t, want in (("weight_scale", weight_scale, want_sw), ("sx", sx, want_sx)):
        if t.dtype != torch.float32 or tuple(t.shape) != want or t.stride(-1) != 1:
            raise ValueError(f"fp8_gemm {name}: {t.dtype} {list(t.shape)}, expected float32 "
                             f"{list(want)}, unit last stride, for scheme {scheme!r}")  # fmt: skip
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"fp8_gemm bias shape {list(bias.shape)} != [{n}]")
    y = torch.empty((m, n), dtype=out_dtype, device=q.device)
    if m == 0 or n == 0:
        return y
    tma = cfg.tma and not interpreting() and _tma_ok(q) and _tma_ok(weight)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        xa = TensorDescriptor.from_tensor(q, [cfg.bm, SCALE_BLOCK])
        wa = TensorDescriptor.from_tensor(weight, [cfg.bn, SCALE_BLOCK])
    else:
        xa, wa = q, weight
    opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **pdl_launch(q.device, m)}
    if not interpreting():  # no multiply-add contraction (module docstring)
        opts["enable_fp_fusion"] = False
    sw_stride = weight_scale.stride(0) if scheme == "block" else 1
    grid = (triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn),)
    _fp8_gemm_kernel[grid](
        xa, wa, sx, weight_scale, bias if bias is not None else y, y, m, n, k, q.stride(0),
        weight.stride(0), y.stride(0), sx.stride(0), sw_stride, MODE=_MODE[scheme],
        HAS_BIAS=bias is not None, TMA=tma, BM=cfg.bm, BN=cfg.bn, BK=SCALE_BLOCK,
        GROUP_M=cfg.group_m, **opts,
    )  # fmt: skip
    return y


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    scheme: str,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """`lockstep.ops.fp8.fp8_linear` on the GPU: x [..., K] (2-D or 3-D, bf16/fp16/fp32, any
    strides) quantized row-locally, then `fp8_gemm` -> [..., N] in out_dtype (default x's).
    Row m of the result depends only on row m of x: the same bits for every M."""
    q, sx = quantize_activation(x, scheme, input_scale)
    y = fp8_gemm(q, sx, weight, weight_scale, scheme, bias, out_dtype or x.dtype, config)
    return y.view(*x.shape[:-1], weight.shape[0])
