"""Position-invariant matmul: y = x @ w.T (+ bias), bf16/fp32 in, fp32 accumulate.

Every output element reduces K in one order: a plain `tl.dot` loop over K in ascending blocks,
no split-K, so a row's bits cannot depend on M. The tile shape is picked per M bucket from
`TILE_TABLE` (never autotuned at run time); on an H200 with Triton 3.6 the tile shape (BM, BN,
BK, the MMA flavour: mma.sync at BM 16/32, wgmma at BM >= 64) did not change any row's bits,
which tests/test_ops_triton.py re-checks across every config of the table. Three kernels share
the K order: pointer loads, TMA tensor descriptors, and a persistent TMA kernel for large M.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class MatmulConfig:
    bm: int
    bn: int
    bk: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    tma: bool = False
    warp_specialize: bool = False  # TMA kernels only: producer/consumer warps (Hopper)
    persistent: bool = False  # TMA kernel only: one program per SM walks the tiles


_INF = 1 << 62

# (largest M, largest N, config): the first row that fits is used. Chosen on an H200 (Triton
# 3.6) from CUDA-graph timings of lockstep/bench/gpu_kernels.py --sweep (docs/gpu.md,
# bench/results/). Small M is bandwidth-bound: narrow N tiles give enough CTAs to stream the
# weight from every SM. Large M: a persistent TMA kernel (one program per SM).
TILE_TABLE: tuple[tuple[int, int, MatmulConfig], ...] = (
    (16, 4096, MatmulConfig(16, 32, 256, 4, 5, tma=True)),
    (16, _INF, MatmulConfig(16, 64, 256, 4, 4, tma=True)),
    (32, 4096, MatmulConfig(32, 32, 256, 4, 5, tma=True)),
    (32, 32768, MatmulConfig(32, 32, 256, 4, 4)),
    (32, _INF, MatmulConfig(32, 64, 128, 4, 5)),
    (128, 4096, MatmulConfig(64, 64, 256, 4, 3, tma=True)),
    (128, 8192, MatmulConfig(128, 64, 128, 4, 3, tma=True)),
    (128, _INF, MatmulConfig(128, 64, 64, 4, 4, tma=True)),
    (512, 8192, MatmulConfig(128, 128, 64, 8, 4, tma=True)),
    (512, _INF, MatmulConfig(128, 128, 64, 8, 4, tma=True, persistent=True)),
    (2048, 8192, MatmulConfig(128, 128, 64, 8, 5, tma=True)),
    (_INF, _INF, MatmulConfig(128, 128, 64, 8, 4, tma=True, persistent=True)),
)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def pick_config(m: int, n: int) -> MatmulConfig:
    for max_m, max_n, cfg in TILE_TABLE:
        if m <= max_m and n <= max_n:
            return cfg
    raise AssertionError("TILE_TABLE must end with an unbounded bucket")


@triton.jit
def _tile_ids(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped tile order for L2 reuse; it changes which CTA computes a tile, never its bits.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    return pid_m, pid_n


@triton.jit
def _epilogue(acc, bias, y, pid_m, pid_n, M, N, sym, HAS_BIAS: tl.constexpr, BM: tl.constexpr,
              BN: tl.constexpr):  # fmt: skip
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    if HAS_BIAS:
        acc = acc + tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    ptrs = y + rm[:, None].to(tl.int64) * sym + rn[None, :]
    tl.store(ptrs, acc.to(y.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


# M is not specialized (Triton would compile M == 1 apart): one binary per config for all M.
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x, w, bias, y, M, N, K, sxm, swn, sym,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _tile_ids(M, N, BM, BN, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    # Clamp out-of-range rows/cols to a valid one instead of masking: they are never stored.
    rm_c = tl.where(rm < M, rm, M - 1).to(tl.int64)
    rn_c = tl.where(rn < N, rn, N - 1).to(tl.int64)
    x_ptrs = x + rm_c[:, None] * sxm + rk[None, :]
    w_ptrs = w + rn_c[None, :] * swn + rk[:, None]
    acc = tl.zeros([BM, BN], tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            a = tl.load(x_ptrs, mask=rk[None, :] < K - k * BK, other=0.0)
            b = tl.load(w_ptrs, mask=rk[:, None] < K - k * BK, other=0.0)
        acc = tl.dot(a, b, acc)
        x_ptrs += BK
        w_ptrs += BK
    _epilogue(acc, bias, y, pid_m, pid_n, M, N, sym, HAS_BIAS, BM, BN)


@triton.jit(do_not_specialize=["M"])
def _matmul_tma_kernel(
    x_desc, w_desc, bias, y, M, N, K, sym,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _tile_ids(M, N, BM, BN, GROUP_M)
    acc = tl.zeros([BM, BN], tl.float32)
    for k in tl.range(0, tl.cdiv(K, BK), warp_specialize=WARP_SPECIALIZE):
        a = x_desc.load([pid_m * BM, k * BK])
        b = w_desc.load([pid_n * BN, k * BK])
        acc = tl.dot(a, b.T, acc)
    _epilogue(acc, bias, y, pid_m, pid_n, M, N, sym, HAS_BIAS, BM, BN)


@triton.jit(do_not_specialize=["M"])
def _matmul_persistent_kernel(
    x_desc, w_desc, y_desc, bias, M, N, K, NUM_SMS,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):  # fmt: skip
    """Each program computes tiles start, start + NUM_SMS, ...; every tile still reduces K in
    the same ascending blocks as `_matmul_kernel`, so the bits are the same."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    group = GROUP_M * num_n
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):  # fmt: skip
        first_m = (tile // group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % group) % size_m
        pid_n = (tile % group) // size_m
        acc = tl.zeros([BM, BN], tl.float32)
        for k in range(0, k_tiles):
            a = x_desc.load([pid_m * BM, k * BK])
            b = w_desc.load([pid_n * BN, k * BK])
            acc = tl.dot(a, b.T, acc)
        if HAS_BIAS:
            rn = pid_n * BN + tl.arange(0, BN)
            acc = acc + tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        y_desc.store([pid_m * BM, pid_n * BN], acc.to(y_desc.dtype))


_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: MatmulConfig | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [M, K] @ w[N, K].T (+ bias [N]) -> [M, N] in out_dtype (default x's dtype; float32
    keeps the accumulator's bits, e.g. for logits). `config` overrides the table (tests and
    benchmarks only)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"matmul wants x [M, K] and w [N, K]; got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}")  # fmt: skip
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"matmul dtypes x={x.dtype} w={w.dtype}: expected equal bf16/fp16/fp32")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("matmul wants the K axis contiguous in x and w")
    if bias is not None and bias.shape != (w.shape[0],):
        raise ValueError(f"bias shape {tuple(bias.shape)} != ({w.shape[0]},)")
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = config or pick_config(m, n)
    grid = (triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn),)
    has_bias = bias is not None
    b = bias if has_bias else y
    opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.tma and not _interpreting() and x.dtype != torch.float32:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_desc = TensorDescriptor.from_tensor(x, [cfg.bm, cfg.bk])
        w_desc = TensorDescriptor.from_tensor(w, [cfg.bn, cfg.bk])
        if cfg.persistent:
            y_desc = TensorDescriptor.from_tensor(y, [cfg.bm, cfg.bn])
            n_sms = _num_sms(x.device)
            _matmul_persistent_kernel[(min(n_sms, grid[0]),)](
                x_desc, w_desc, y_desc, b, m, n, k, n_sms, HAS_BIAS=has_bias, BM=cfg.bm,
                BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, WARP_SPECIALIZE=cfg.warp_specialize,
                **opts,
            )  # fmt: skip
            return y
        _matmul_tma_kernel[grid](
            x_desc, w_desc, b, y, m, n, k, y.stride(0), HAS_BIAS=has_bias,
            BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m,
            WARP_SPECIALIZE=cfg.warp_specialize, **opts,
        )  # fmt: skip
        return y
    _matmul_kernel[grid](
        x, w, b, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), HAS_BIAS=has_bias,
        EVEN_K=k % cfg.bk == 0, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, **opts,
    )  # fmt: skip
    return y
