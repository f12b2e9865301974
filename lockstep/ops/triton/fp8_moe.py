"""FP8 routed experts on the GPU (`Ops.moe` for a layer with FP8 experts; the contract is
lockstep/ops/moe.py's, "FP8 experts"): `moe.py`'s pipeline with each expert GEMM an FP8 one.
One sparse layer, x [T, H], k experts per token, S = T * k slots (the block scheme shown; the
per-channel and per-tensor schemes quantize per token or with the layer's static input scale,
and read one weight scale per row, the same in every K block):

    router    matmul(x, router, fp32)            the router is never quantized (`moe.py`)
    route, group                                 `moe.route_layer`, `moe.group_slots`
    quantize  x -> q [T, H] e4m3, sx [T, ceil(H/128)]   (`fp8_gemm.quantize_activation`,
              per token and 128-column group: the dense FP8 linear's bits)
    gate_up   grouped FP8 GEMM over sorted slots, rows and their scales gathered from q,
              gate and up in one program, SiLU(gate) * up in the epilogue   h [S, I] x.dtype
    quantize  h -> qh [S, I], sxh                 (row-local, as above)
    down      grouped FP8 GEMM over qh, each row stored at its slot          y [S, H]
    combine   `moe.combine`: ascending rank, fp32, one rounding

The grid and the expert lookup are `moe.py`'s (static for a given S, no host synchronization,
only the chosen experts' weights read). What every output element computes, for every S:

    total = 0
    for b in 0, 1, ..., ceil(K / 128) - 1:                    K blocks = the scale blocks
        p     = dot(Xq[row, 128b : 128b+128], Wq[e, n, same])  e4m3 tensor-core dot from 0
        total = total + p * (sx[row, b] * sw[e, n, b])         fp32, no multiply-add contraction

with sw[e, n, b] the block scale of row n in its checkpoint part (gate rows use gate's scale
rows, up rows up's: `MoeLayer.gate_up_scale`). That is `fp8_gemm._fp8_gemm_kernel`'s K order
and rounding, and the epilogue rounds gate, up, h and y to x's dtype as the unfused path
(`fp8_linear`, `silu_mul`, `fp8_linear`) does, so a slot's row equals the dense FP8 linear's
row over the expert's weights, whatever rows share its tile or how many its expert received.
Every config has BM 64 or 128, the tensor cores' wgmma flavour on which those bits rest
(fp8_gemm.py's docstring: at BM 16 or 32 Triton compiles another accumulation).

Tile configs come from `FP8_GATE_UP_TABLE` / `FP8_DOWN_TABLE`, keyed by S (never autotuned):
a speed choice that never changes a bit. They are not tuned on a GPU yet (docs/gpu.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lockstep.ops.fp8 import BLOCK, E4M3
from lockstep.ops.moe import MoeLayer, write_routed_experts
from lockstep.ops.triton.fp8_gemm import quantize_activation
from lockstep.ops.triton.launch import interpreting, pdl_launch, wait_for_inputs
from lockstep.ops.triton.moe import (
    combine,
    expert_pad,
    expert_tile_rows,
    group_slots,
    route_layer,
    router_logits,
    store_tile,
)


@dataclass(frozen=True)
class Fp8GroupedConfig:
    bm: int  # 64 or 128 (wgmma)
    bn: int
    num_warps: int
    num_stages: int


_INF = 1 << 62
_C = Fp8GroupedConfig
# (largest S = tokens * k, config), first fit. 64-row tiles everywhere (the smallest wgmma
# tile; an expert's rows rarely fill more at decode), 64 columns up to S 4096, then 128.
FP8_GATE_UP_TABLE: tuple[tuple[int, Fp8GroupedConfig], ...] = (
    (4096, _C(64, 64, 4, 3)),
    (_INF, _C(64, 128, 4, 3)),
)
FP8_DOWN_TABLE: tuple[tuple[int, Fp8GroupedConfig], ...] = (
    (4096, _C(64, 64, 4, 3)),
    (_INF, _C(64, 128, 4, 3)),
)


def pick_fp8_grouped_config(
    table: tuple[tuple[int, Fp8GroupedConfig], ...], slots: int
) -> Fp8GroupedConfig:
    for max_slots, cfg in table:
        if slots <= max_slots:
            return cfg
    raise AssertionError("a grouped-GEMM table must end with an unbounded bucket")


@triton.jit
def _block_step(total, a_t, w_blk, kb, K, sx_b, sw_ptrs, blk, s_wsk, EVEN_K: tl.constexpr,
                BK: tl.constexpr):  # fmt: skip
    """total + dot(a_t, w block) * (sx * sw): one K block of `fp8_gemm`'s sum. w_blk: the
    weight columns' bases at K offset kb, [1, BN]; sw_ptrs: their scales' bases, K block
    `blk` at `blk * s_wsk` (0: one scale per row, "channel" and "tensor")."""
    rk = tl.arange(0, BK)
    if EVEN_K:
        b_t = tl.load(w_blk + rk[:, None])
    else:
        b_t = tl.load(w_blk + rk[:, None], mask=rk[:, None] < K - kb, other=0.0)
    p = tl.dot(a_t, b_t)
    return total + p * (sx_b[:, None] * tl.load(sw_ptrs + blk * s_wsk)[None, :])


@triton.jit(do_not_specialize=["M_TILES"])
def _grouped_fp8_kernel(
    a, a_scale, w, w_scale, out, order, offsets, N, K, E, M_TILES, UP_ROWS, sa, s_as, s_ask,
    swe, swn, s_wse, s_wsn, s_wsk, so,
    GATHER: tl.constexpr, SCATTER: tl.constexpr, SILU: tl.constexpr, TOP_K: tl.constexpr,
    EVEN_K: tl.constexpr, E_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, ROW_BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One (row tile, column tile) of the grouped FP8 product over expert-sorted slots: a
    e4m3 [rows, K] with scales a_scale (row r's scale of K block b at r * s_as + b * s_ask);
    w e4m3 [E, N or 2N, K] with w_scale [E, scale rows, K blocks] (weight row n's scale row
    n // ROW_BLOCK: 128 for block scales, 1 for per-row ones, whose K stride s_wsk is 0).
    GATHER, SCATTER, SILU as in `moe._grouped_kernel`; with SILU, up's weight rows start at N
    and its scale rows at UP_ROWS."""
    wait_for_inputs(PDL)
    pid = tl.program_id(0)
    tile_m = pid % M_TILES
    pid_n = pid // M_TILES
    e, pos, in_rows = expert_tile_rows(offsets, tile_m, E, E_PAD, BM)
    if e < E:
        if GATHER:
            src = (tl.load(order + pos) // TOP_K).to(tl.int64)
        else:
            src = pos.to(tl.int64)
        a_rows = a + src[:, None] * sa
        sx_row = a_scale + src * s_as
        rn = pid_n * BN + tl.arange(0, BN)
        rn_c = tl.where(rn < N, rn, N - 1).to(tl.int64)
        e64 = e.to(tl.int64)
        w_gate = w + e64 * swe + rn_c[None, :] * swn
        sw_gate = w_scale + e64 * s_wse + (rn_c // ROW_BLOCK) * s_wsn
        w_up = w_gate + N * swn
        sw_up = sw_gate + UP_ROWS * s_wsn
        rk = tl.arange(0, BK)
        total = tl.zeros([BM, BN], tl.float32)
        total_up = tl.zeros([BM, BN], tl.float32)
        for kb in range(0, K, BK):
            blk = kb // BK
            if EVEN_K:
                a_t = tl.load(a_rows + (kb + rk)[None, :])
            else:
                a_t = tl.load(a_rows + (kb + rk)[None, :], mask=rk[None, :] < K - kb, other=0.0)
            sx_b = tl.load(sx_row + blk * s_ask)
            total = _block_step(total, a_t, w_gate + kb, kb, K, sx_b, sw_gate, blk, s_wsk,
                                EVEN_K, BK)  # fmt: skip
            if SILU:
                total_up = _block_step(total_up, a_t, w_up + kb, kb, K, sx_b, sw_up, blk, s_wsk,
                                       EVEN_K, BK)  # fmt: skip
        store_tile(total, total_up, out, order, pos, in_rows, rn, N, so, SILU, SCATTER)


def grouped_fp8_gemm(
    q: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
    order: torch.Tensor, offsets: torch.Tensor, top_k: int, *, gather: bool, scatter: bool,
    silu: bool, out_dtype: torch.dtype, config: Fp8GroupedConfig, scheme: str = "block",
) -> torch.Tensor:  # fmt: skip
    """The grouped FP8 product over S = order.numel() expert-sorted slots (`_grouped_fp8_kernel`
    for gather/scatter/silu). q e4m3 [rows, K] (unit column stride) and sx fp32 from
    `quantize_activation(_, scheme)` ([rows, ceil(K/128)], [rows, 1] or the static [1]); w
    e4m3 [E, N, K] (silu: N = 2 * half, gate | up) and w_scale fp32 [E, SB, ceil(K/128)]
    ("block"; silu: gate's ceil(half/128) rows, then up's) or [E, N] (one per row);
    order int64 [S]; offsets int64 [E + 1]. Returns [S, N or half] out_dtype."""
    if q.dim() != 2 or w.dim() != 3 or q.shape[1] != w.shape[2]:
        raise ValueError(f"grouped_fp8_gemm wants q [M, K] and w [E, N, K]; got "
                         f"{tuple(q.shape)}, {tuple(w.shape)}")  # fmt: skip
    if q.dtype != E4M3 or w.dtype != E4M3 or q.stride(1) != 1 or w.stride(2) != 1:
        raise ValueError(f"grouped_fp8_gemm wants e4m3 q and w ({q.dtype}, {w.dtype}) with K "
                         "contiguous")  # fmt: skip
    if config.bm not in (64, 128):
        raise ValueError(f"BM {config.bm} is invalid: expected 64 or 128 (wgmma, module "
                         "docstring)")  # fmt: skip
    slots = order.numel()
    e, n, k = w.shape
    half = n // 2 if silu else n
    kb = triton.cdiv(k, BLOCK)
    block = scheme == "block"
    if block:
        rows = 2 * triton.cdiv(half, BLOCK) if silu else triton.cdiv(n, BLOCK)
        want_w, want_x = (e, rows, kb), (q.shape[0], kb)
    else:  # one scale per weight row; per token ("channel") or one static ("tensor")
        rows = n
        want_w, want_x = (e, n), ((q.shape[0], 1) if scheme == "channel" else (1,))
    if w_scale.dtype != torch.float32 or tuple(w_scale.shape) != want_w:
        raise ValueError(f"grouped_fp8_gemm w_scale: {w_scale.dtype} {list(w_scale.shape)}, "
                         f"expected float32 {list(want_w)} for scheme {scheme!r}")  # fmt: skip
    if sx.dtype != torch.float32 or tuple(sx.shape) != want_x or sx.stride(-1) != 1:
        raise ValueError(f"grouped_fp8_gemm sx: {sx.dtype} {list(sx.shape)}, expected float32 "
                         f"{list(want_x)} for scheme {scheme!r}")  # fmt: skip
    # Scale strides: a K block's activation and weight scales (0 where one serves every
    # block), and a row's activation scale (0 for the one static scale).
    s_as = sx.stride(0) if scheme != "tensor" else 0
    s_ask = 1 if block else 0
    s_wsk = w_scale.stride(2) if block else 0
    out = torch.empty((slots, half), dtype=out_dtype, device=q.device)
    if slots == 0:
        return out
    m_tiles = triton.cdiv(slots, config.bm) + min(e, slots)
    grid = (m_tiles * triton.cdiv(half, config.bn),)
    opts = {"num_warps": config.num_warps, "num_stages": config.num_stages,
            **pdl_launch(q.device, slots)}  # fmt: skip
    if not interpreting():  # no multiply-add contraction (module docstring)
        opts["enable_fp_fusion"] = False
    _grouped_fp8_kernel[grid](
        q, sx, w, w_scale, out, order, offsets, half, k, e, m_tiles, rows // 2 if silu else 0,
        q.stride(0), s_as, s_ask, w.stride(0), w.stride(1), w_scale.stride(0),
        w_scale.stride(1), s_wsk, out.stride(0), GATHER=gather, SCATTER=scatter, SILU=silu,
        TOP_K=top_k, EVEN_K=k % BLOCK == 0, E_PAD=expert_pad(e), BM=config.bm, BN=config.bn,
        BK=BLOCK, ROW_BLOCK=BLOCK if block else 1, **opts,
    )  # fmt: skip
    return out


def moe_fp8(
    x: torch.Tensor, layer: MoeLayer, gate_up_config: Fp8GroupedConfig | None = None,
    down_config: Fp8GroupedConfig | None = None, routed_experts: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """`Ops.moe` for x [T, H] and a layer with FP8 experts (module docstring): [T, H]
    in x's dtype. The configs override the tables (tests and benchmarks; never a bit).
    `routed_experts`: [T, k] ids the routing chose, copied on the device (`Ops.moe`)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"moe wants x [T, H] with H contiguous; got {tuple(x.shape)}")
    if layer.gate_up_scale is None or layer.down_scale is None:
        raise ValueError("moe_fp8 wants a layer with FP8 experts (MoeLayer.fp8)")
    top_k = layer.top_k
    slots = x.shape[0] * top_k
    routing = route_layer(router_logits(x, layer), layer)
    write_routed_experts(routed_experts, routing.experts)
    order, offsets = group_slots(routing.experts, layer.num_experts)
    scheme = layer.fp8_scheme
    q, sx = quantize_activation(x, scheme, layer.gate_up_input_scale)
    h = grouped_fp8_gemm(
        q, sx, layer.gate_up, layer.gate_up_scale, order, offsets, top_k, gather=True,
        scatter=False, silu=True, out_dtype=x.dtype,
        config=gate_up_config or pick_fp8_grouped_config(FP8_GATE_UP_TABLE, slots),
        scheme=scheme,
    )  # fmt: skip
    qh, sxh = quantize_activation(h, scheme, layer.down_input_scale)
    y = grouped_fp8_gemm(
        qh, sxh, layer.down, layer.down_scale, order, offsets, top_k, gather=False,
        scatter=True, silu=False, out_dtype=x.dtype,
        config=down_config or pick_fp8_grouped_config(FP8_DOWN_TABLE, slots), scheme=scheme,
    )  # fmt: skip
    return combine(y, routing.weights, x.dtype)
