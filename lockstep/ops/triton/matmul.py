"""Position-invariant matmul: y = x @ w.T (+ bias), bf16/fp32 in, fp32 accumulate.

The numerics (what every output element computes, for every M):

    K is cut into `split_count(K)` splits at fixed points (multiples of SPLIT_ALIGN), a
    function of the weight's K only. Within a split, a `tl.dot` loop over K in ascending
    blocks accumulates from zero; the split sums are then folded in ascending order starting
    from zero: y = ((0 + p0) + p1) + ... (+ bias), rounded once to the output dtype.

How the work is laid out is a speed choice picked per (M, N, K) bucket from `TILE_TABLE` (never
autotuned at run time) and never changes a bit: the tile shape (BM, BN, BK, the MMA flavour:
mma.sync at BM 16/32, wgmma at BM >= 64; on an H200 with Triton 3.6 none of these changed a
row's bits, which tests/kernels/test_ops_triton.py re-checks), and where the splits run: all in one
program (large M: plenty of tiles), or one program per split (small M: K-parallelism to stream
the weight from every SM) whose partials go to a float32 workspace and are folded, in the same
order, by the last program of the tile to finish (an atomic arrival counter, reset by that
program, so CUDA-graph replays find it zeroed). Three kernels share the K order: pointer loads,
TMA tensor descriptors, and a persistent TMA kernel for large M.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lockstep.ops.triton.launch import interpreting, num_sms, pdl_launch, wait_for_inputs


@dataclass(frozen=True)
class MatmulConfig:
    bm: int
    bn: int
    bk: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    tma: bool = False
    persistent: bool = False  # TMA kernel only: one program per SM walks the tiles
    # Persistent kernel only: Triton's warp specialization (loads and MMAs in separate warps).
    warp_specialize: bool = False
    split_programs: bool = False  # one program per K split, folded by the tile's last program


_INF = 1 << 62

# Split points are multiples of this, so that every BK of the table (<= 256) divides a split
# and no K block straddles two splits.
SPLIT_ALIGN = 256

# (largest K, splits): THE NUMERICS of every matmul, keyed by the weight's K (never by M).
# Changing a row here changes the bits of every model. One split up to K 8192, two above: the
# split-count timings in docs/results.md (two splits only pay off at large K).
SPLIT_TABLE: tuple[tuple[int, int], ...] = (
    (8192, 1),
    (_INF, 2),
)

# (largest M, largest N, largest K, config): the first row that fits is used. Chosen from
# CUDA-graph timings of `python -m bench.gpu_kernels --sweep` with a clean L2 (the matmul
# table in docs/results.md). Small M is bandwidth-bound: narrow N tiles for enough CTAs. Mid M:
# 64-row tiles; at K > 8192 one program per split. M 129-256 (decode at RL batch sizes): the
# tile that best fills the waves of 132 SMs per shape (`--sweep --ms 256`, docs/results.md). M
# 257-512: 256x128 tiles for N > 4096 at K <= 8192 and for N > 8192. Large M: persistent 128x128 tiles walked in groups of 16 M-tiles
# (GROUP_M 16, for L2 reuse), 256x128 for N <= 8192 up to M 2048; at K > 8192 (two splits)
# 128x256 tiles.
_C = MatmulConfig
TILE_TABLE: tuple[tuple[int, int, int, MatmulConfig], ...] = (
    # 7 stages: at M = 1 a projection like Qwen3-8B's o streams its weight from one program
    # per SM, which needs 6 x 16 KB of weight in flight per SM to cover the copy rate times
    # the load latency (147,504 B of shared memory). Stages never change a bit.
    (16, 4096, 8192, _C(16, 32, 256, 4, 7, tma=True)),
    (16, 8192, 8192, _C(16, 64, 256, 4, 4, tma=True)),
    (16, _INF, 8192, _C(16, 128, 128, 4, 4, tma=True)),
    (16, _INF, _INF, _C(16, 64, 256, 4, 4, tma=True, split_programs=True)),
    (32, 4096, 8192, _C(32, 32, 256, 4, 5, tma=True)),
    (32, 8192, 8192, _C(32, 64, 256, 4, 4, tma=True)),
    (32, 32768, 8192, _C(32, 128, 64, 4, 6, tma=True)),
    (32, _INF, 8192, _C(32, 64, 128, 4, 5, tma=True)),
    (32, _INF, _INF, _C(32, 64, 128, 4, 5, tma=True, split_programs=True)),
    (128, 4096, 8192, _C(64, 64, 128, 4, 4, tma=True)),
    (128, 32768, 8192, _C(64, 128, 128, 4, 4, tma=True)),
    (128, _INF, 8192, _C(128, 128, 64, 8, 4, tma=True, persistent=True)),
    (128, _INF, _INF, _C(64, 128, 128, 4, 4, tma=True, split_programs=True)),
    # Decode at batch 129-256 (RL rollouts): tiles that fill the 132 SMs' waves.
    (256, 4096, _INF, _C(64, 128, 128, 4, 4, tma=True)),
    (256, 8192, 8192, _C(128, 128, 64, 8, 4, tma=True)),
    (256, 32768, 8192, _C(128, 128, 64, 8, 4, tma=True, persistent=True)),
    (256, _INF, 8192, _C(256, 128, 64, 8, 3, tma=True)),
    (256, _INF, _INF, _C(64, 128, 128, 4, 4, tma=True)),
    (512, 4096, _INF, _C(128, 128, 64, 8, 4, tma=True)),
    (512, 8192, 8192, _C(256, 128, 64, 8, 3, tma=True)),
    (512, 8192, _INF, _C(128, 128, 64, 8, 4, tma=True)),
    (512, _INF, _INF, _C(256, 128, 64, 8, 3, tma=True)),
    (2048, 8192, 8192, _C(256, 128, 64, 8, 3, tma=True)),
    (_INF, _INF, 8192, _C(128, 128, 64, 8, 4, group_m=16, tma=True, persistent=True)),
    (_INF, _INF, _INF, _C(128, 256, 64, 8, 3, tma=True)),
)


def pick_config(m: int, n: int, k: int) -> MatmulConfig:
    for max_m, max_n, max_k, cfg in TILE_TABLE:
        if m <= max_m and n <= max_n and k <= max_k:
            return cfg
    raise AssertionError("TILE_TABLE must end with an unbounded bucket")


def split_count(k: int) -> int:
    """How many splits the table asks for at this K (before alignment; see `split_length`)."""
    for max_k, splits in SPLIT_TABLE:
        if k <= max_k:
            return splits
    raise AssertionError("SPLIT_TABLE must end with an unbounded bucket")


def split_length(k: int, splits: int) -> int:
    """Length of every split but possibly the last: ceil(K / splits) rounded up to
    SPLIT_ALIGN. The actual number of splits is ceil(K / split_length)."""
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    return triton.cdiv(triton.cdiv(k, splits), SPLIT_ALIGN) * SPLIT_ALIGN


@triton.jit
def _tile_ids(tile, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped tile order for L2 reuse; it changes which program computes a tile, never its bits.
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    group = GROUP_M * num_n
    first_m = (tile // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % group) % size_m
    pid_n = (tile % group) // size_m
    return pid_m, pid_n


@triton.jit
def _split_sum(x, w, pid_m, pid_n, split, M, N, K, SPLIT_LEN, sxm, swn,
               TMA: tl.constexpr, EVEN_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr):  # fmt: skip
    """One split's partial sum: K blocks of the split in ascending order, from zero. With
    TMA, x and w are tensor descriptors (out-of-range K reads as zero); else pointers."""
    k_lo = split * SPLIT_LEN
    k_hi = tl.minimum(K, k_lo + SPLIT_LEN)
    acc = tl.zeros([BM, BN], tl.float32)
    if TMA:
        for kb in range(k_lo, k_hi, BK):
            a = x.load([pid_m * BM, kb])
            b = w.load([pid_n * BN, kb])
            acc = tl.dot(a, b.T, acc)
    else:
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        # Clamp out-of-range rows/cols to a valid one instead of masking: never stored.
        rm_c = tl.where(rm < M, rm, M - 1).to(tl.int64)
        rn_c = tl.where(rn < N, rn, N - 1).to(tl.int64)
        x_ptrs = x + rm_c[:, None] * sxm + (k_lo + rk)[None, :]
        w_ptrs = w + rn_c[None, :] * swn + (k_lo + rk)[:, None]
        for kb in range(k_lo, k_hi, BK):
            if EVEN_K:
                a = tl.load(x_ptrs)
                b = tl.load(w_ptrs)
            else:
                a = tl.load(x_ptrs, mask=rk[None, :] < K - kb, other=0.0)
                b = tl.load(w_ptrs, mask=rk[:, None] < K - kb, other=0.0)
            acc = tl.dot(a, b, acc)
            x_ptrs += BK
            w_ptrs += BK
    return acc


@triton.jit
def _epilogue(total, bias, y, pid_m, pid_n, M, N, sym, HAS_BIAS: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    if HAS_BIAS:
        total = total + tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    ptrs = y + rm[:, None].to(tl.int64) * sym + rn[None, :]
    tl.store(ptrs, total.to(y.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _fold_at_last_arrival(part, ws, counters, tile, split, pid_m, pid_n, M, N, NUM_SPLITS,
                          BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """Publish this program's split sum; the tile's last program to arrive folds all of them
    in ascending split order from zero (the same fold as one program doing every split) and
    re-arms the counter. Returns (total, is_last)."""
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    plane = M.to(tl.int64) * N
    tl.store(ws + split * plane + offs, part, mask=mask)
    # Every thread's stores precede the barrier; the gpu-scope release of the arrival then
    # publishes them to whichever program acquires the last arrival.
    tl.debug_barrier()
    arrived = tl.atomic_add(counters + tile, 1, sem="acq_rel", scope="gpu")
    is_last = arrived == NUM_SPLITS - 1
    total = tl.zeros([BM, BN], tl.float32)
    if is_last:
        for s in range(0, NUM_SPLITS):
            # .cg: read L2 (coherent), not this SM's L1.
            total = total + tl.load(ws + s * plane + offs, mask=mask, other=0.0,
                                    cache_modifier=".cg")  # fmt: skip
        tl.atomic_xchg(counters + tile, 0, sem="relaxed", scope="gpu")
    return total, is_last


# M is not specialized (Triton would compile M == 1 apart): one binary per config for all M.
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x, w, bias, y, ws, counters, M, N, K, SPLIT_LEN, NUM_SPLITS, sxm, swn, sym,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
    SPLIT_PROGRAMS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """y = x @ w.T (+ bias) for one output tile (or one K split of it: SPLIT_PROGRAMS), `w` a
    pointer or (TMA) a tensor descriptor; K order as in the module docstring."""
    wait_for_inputs(PDL)
    pid = tl.program_id(0)
    if SPLIT_PROGRAMS:
        tile = pid // NUM_SPLITS
        split = pid % NUM_SPLITS
        pid_m, pid_n = _tile_ids(tile, M, N, BM, BN, GROUP_M)
        part = _split_sum(x, w, pid_m, pid_n, split, M, N, K, SPLIT_LEN, sxm, swn, TMA, EVEN_K,
                          BM, BN, BK)  # fmt: skip
        total, is_last = _fold_at_last_arrival(part, ws, counters, tile, split, pid_m, pid_n, M,
                                               N, NUM_SPLITS, BM, BN)  # fmt: skip
        if is_last:
            _epilogue(total, bias, y, pid_m, pid_n, M, N, sym, HAS_BIAS, BM, BN)
    else:
        pid_m, pid_n = _tile_ids(pid, M, N, BM, BN, GROUP_M)
        total = tl.zeros([BM, BN], tl.float32)
        for split in tl.range(0, NUM_SPLITS, flatten=True):
            total = total + _split_sum(x, w, pid_m, pid_n, split, M, N, K, SPLIT_LEN, sxm, swn,
                                       TMA, EVEN_K, BM, BN, BK)  # fmt: skip
        _epilogue(total, bias, y, pid_m, pid_n, M, N, sym, HAS_BIAS, BM, BN)


@triton.jit(do_not_specialize=["M"])
def _grouped_matmul_kernel(
    x, w, y, M, N, K, SPLIT_LEN, NUM_SPLITS, sxm, sxg, swn, swg, sym, syg,
    EVEN_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """y[:, g] = x[:, g] @ w[g].T for group g = program_id(1): `_matmul_kernel`'s one-program
    path (pointer loads) on the group's base pointers, so each group's tile computes what the
    dense kernel computes for it (same splits, same K blocks, same fold)."""
    wait_for_inputs(PDL)
    g = tl.program_id(1).to(tl.int64)
    xg, wg, yg = x + g * sxg, w + g * swg, y + g * syg
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BM, BN, GROUP_M)
    total = tl.zeros([BM, BN], tl.float32)
    for split in tl.range(0, NUM_SPLITS, flatten=True):
        total = total + _split_sum(xg, wg, pid_m, pid_n, split, M, N, K, SPLIT_LEN, sxm, swn,
                                   False, EVEN_K, BM, BN, BK)  # fmt: skip
    _epilogue(total, yg, yg, pid_m, pid_n, M, N, sym, False, BM, BN)


@triton.jit(do_not_specialize=["M"])
def _matmul_persistent_kernel(
    x_desc, w_desc, y_desc, bias, M, N, K, SPLIT_LEN, NUM_SPLITS, NUM_SMS,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, WS: tl.constexpr, FLATTEN: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program p computes tiles p, p + NUM_SMS, ...; one flattened loop walks (tile, split)
    units, a tile's splits consecutively, folding each split sum into the tile's total in the
    same order as `_matmul_kernel`, so the bits are the same."""
    wait_for_inputs(PDL)
    num_tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    my_tiles = tl.cdiv(num_tiles - tl.program_id(0), NUM_SMS)
    total = tl.zeros([BM, BN], tl.float32)
    for unit in tl.range(0, my_tiles * NUM_SPLITS, flatten=FLATTEN, warp_specialize=WS):
        tile = tl.program_id(0) + (unit // NUM_SPLITS) * NUM_SMS
        split = unit % NUM_SPLITS
        pid_m, pid_n = _tile_ids(tile, M, N, BM, BN, GROUP_M)
        k_lo = split * SPLIT_LEN
        k_hi = tl.minimum(K, k_lo + SPLIT_LEN)
        acc = tl.zeros([BM, BN], tl.float32)
        for kb in range(k_lo, k_hi, BK):
            a = x_desc.load([pid_m * BM, kb])
            b = w_desc.load([pid_n * BN, kb])
            acc = tl.dot(a, b.T, acc)
        total = tl.where(split == 0, 0.0, total) + acc
        if split == NUM_SPLITS - 1:
            out = total
            if HAS_BIAS:
                rn = pid_n * BN + tl.arange(0, BN)
                out = out + tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            y_desc.store([pid_m * BM, pid_n * BN], out.to(y_desc.dtype))


# Arrival counters of the split-programs path, one per output tile, all zero between calls
# (each tile's last program re-arms its own). One buffer per device, never reallocated, so
# that CUDA graphs captured against it stay valid. Shared by every call on the device: two
# split-program matmuls must not run concurrently on two streams (the engine uses one).
_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}
MAX_SPLIT_TILES = 1 << 16


def reserve_counters(device: torch.device) -> torch.Tensor:
    """The device's arrival counters, allocated (zeroed) on first use. Call it outside any
    CUDA-graph capture before the first split-programs matmul (GpuDeterministicOps does, when
    it prepares weights): inside a capture the zero fill would only be recorded."""
    key = (device.type, device.index)
    if key not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "matmul arrival counters first needed inside a CUDA-graph capture: call "
                "lockstep.ops.triton.matmul.reserve_counters(device) before capturing"
            )
        _COUNTERS[key] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: MatmulConfig | None = None,
    out_dtype: torch.dtype | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ w[N, K].T (+ bias [N]) -> [M, N] in out_dtype (default x's dtype; float32
    keeps the accumulator's bits, e.g. for logits). `config` overrides the tile table and
    `splits` the split table (tests and benchmarks only: `splits` changes the numerics)."""
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
    if k == 0:
        raise ValueError("matmul over an empty K axis")
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = config or pick_config(m, n, k)
    if SPLIT_ALIGN % cfg.bk:
        raise ValueError(f"BK {cfg.bk} must divide SPLIT_ALIGN {SPLIT_ALIGN}")
    split_len = split_length(k, split_count(k) if splits is None else splits)
    num_splits = triton.cdiv(k, split_len)
    tiles = triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn)
    has_bias = bias is not None
    b = bias if has_bias else y
    opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **pdl_launch(x.device, m)}
    tma = cfg.tma and not interpreting() and x.dtype != torch.float32
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        xa = TensorDescriptor.from_tensor(x, [cfg.bm, cfg.bk])
        wa = TensorDescriptor.from_tensor(w, [cfg.bn, cfg.bk])
        if cfg.persistent:
            y_desc = TensorDescriptor.from_tensor(y, [cfg.bm, cfg.bn])
            n_sms = num_sms(x.device)
            _matmul_persistent_kernel[(min(n_sms, tiles),)](
                xa, wa, y_desc, b, m, n, k, split_len, num_splits, n_sms, HAS_BIAS=has_bias,
                BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, WS=cfg.warp_specialize,
                FLATTEN=not cfg.warp_specialize, **opts,
            )  # fmt: skip
            return y
    else:
        xa, wa = x, w
    split_programs = cfg.split_programs and num_splits > 1 and tiles <= MAX_SPLIT_TILES
    if split_programs:
        ws = torch.empty((num_splits, m, n), dtype=torch.float32, device=x.device)
        counters = reserve_counters(x.device)
    else:
        ws = counters = y  # unused
    _matmul_kernel[(tiles * (num_splits if split_programs else 1),)](
        xa, wa, b, y, ws, counters, m, n, k, split_len, num_splits, x.stride(0), w.stride(0),
        y.stride(0), HAS_BIAS=has_bias, EVEN_K=k % cfg.bk == 0, TMA=tma,
        SPLIT_PROGRAMS=split_programs, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m,
        **opts,
    )  # fmt: skip
    return y


def grouped_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    config: MatmulConfig | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per group g: x[:, g] [M, K] @ w[g].T ([N, K]) -> y[:, g], for x [M, G, K] (K contiguous,
    any row and group strides: a view of a wider tensor is read in place) and w [G, N, K];
    y [M, G, N] contiguous, in out_dtype (default x's). One launch for every group (MLA's
    absorbed projections, heads as groups: lockstep/models/blocks/mla.py). Each group gets
    the tile config and the splits `matmul` picks for (M, N, K), and its tiles compute the
    same K blocks in the same order as `matmul(x[:, g], w[g])`: the same bits (pointer loads
    here; `matmul`'s TMA loads give the same bits, tests/kernels/test_ops_triton.py). Rows are
    never mixed between groups. `config`: tests only."""
    if x.dim() != 3 or w.dim() != 3 or x.shape[1] != w.shape[0] or x.shape[2] != w.shape[2]:
        raise ValueError(f"grouped_matmul wants x [M, G, K] and w [G, N, K]; got "
                         f"{tuple(x.shape)}, {tuple(w.shape)}")  # fmt: skip
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"grouped_matmul dtypes x={x.dtype} w={w.dtype}: expected equal "
                         "bf16/fp16/fp32")  # fmt: skip
    if x.stride(2) != 1 or w.stride(2) != 1:
        raise ValueError("grouped_matmul wants the K axis contiguous in x and w")
    m, groups, k = x.shape
    n = w.shape[1]
    if k == 0:
        raise ValueError("grouped_matmul over an empty K axis")
    y = torch.empty((m, groups, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or groups == 0:
        return y
    cfg = config or pick_config(m, n, k)
    split_len = split_length(k, split_count(k))
    num_splits = triton.cdiv(k, split_len)
    tiles = triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn)
    opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **pdl_launch(x.device, m)}
    _grouped_matmul_kernel[(tiles, groups)](
        x, w, y, m, n, k, split_len, num_splits, x.stride(0), x.stride(1), w.stride(1),
        w.stride(0), y.stride(0), y.stride(1), EVEN_K=k % cfg.bk == 0, BM=cfg.bm, BN=cfg.bn,
        BK=cfg.bk, GROUP_M=cfg.group_m, **opts,
    )  # fmt: skip
    return y
