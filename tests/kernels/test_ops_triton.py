"""The Triton backend against a float64 reference, and its position invariance, bit for bit.

Without CUDA the kernels run under the Triton interpreter (float32, small shapes); with CUDA the
same tests run in bfloat16 on the GPU at real head sizes and the production tile configs.
TRITON_INTERPRET must be set before triton is imported (jit decides at decoration time).
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest

from lockstep.ops.base import AttentionInput, AttentionMeta, LayerKV, build_attention_meta
from lockstep.ops.gpu_deterministic import GpuDeterministicOps
from lockstep.ops.triton import matmul as mm
from lockstep.ops.triton.attention import (
    DEFAULT_CONFIG,
    AttentionConfig,
    paged_attention,
)

GPU = torch.cuda.is_available()
# Padding rows of a tile divide 0 by 0 and subtract -inf from -inf inside tl.where branches
# that are discarded; numpy (the interpreter) warns about them. They are never stored.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _row_local_interpreter_dot() -> None:
    """The interpreter's tl.dot is one numpy matmul per block, whose rounding depends on the
    block's shape and a row's place in it (BLAS kernels), unlike the GPU's MMA. Replace it with
    a row-local dot (float64 products and sums, one rounding, then the fp32 accumulate), so that
    the bit-equality tests below test the kernels' logic: the order of K blocks, key blocks and
    splits stays visible, and the negative controls still bite. e4m3 operands (the FP8 GEMM)
    are widened through float16, which holds every e4m3 value: a 128-long e4m3 block dot is
    exact in float64. One patch for every test module that runs kernels in the interpreter
    (they import this function), so the last module collected cannot change another's dot."""
    from triton.runtime import interpreter

    def wide(t):
        if t.dtype.is_bf16():  # held as its bits (numpy has no bfloat16)
            return (t.data.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        if t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating():
            half = interpreter._convert_float(t.data, t.dtype, interpreter.tl.float16, None)
            return half.view(np.float16).astype(np.float64)
        return t.data.astype(np.float64)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ARG001
        prod = np.matmul(wide(a), wide(b))
        return interpreter.TensorHandle(prod.astype(d.data.dtype) + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


if not GPU:
    _row_local_interpreter_dot()
DEV = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float32
# Relative error bounds against float64 (bf16 operands vs exact fp32 interpreter math).
TOL = 2e-2 if GPU else 1e-5

# Attention shapes: the interpreter gets a small config so that splits and blocks are crossed
# with short sequences; the GPU runs the production config.
if GPU:
    HKV, GROUP, HD, SEQ = 8, 4, 128, 1300
    ATTN_CFG = DEFAULT_CONFIG
    # 2 stages: 128-key blocks with the dot row sum need 233,472 bytes of shared memory at
    # 3 (sm_90 has 232,448). Stages move loads, not bits.
    OTHER_BLOCK_CFG = AttentionConfig(block_n=128, split=DEFAULT_CONFIG.split, num_stages=2)
else:
    HKV, GROUP, HD, SEQ = 2, 2, 16, 70
    ATTN_CFG = AttentionConfig(block_n=16, split=32, rows=32, rows_split=16, num_warps=4)
    OTHER_BLOCK_CFG = AttentionConfig(block_n=32, split=32, rows=32, rows_split=16)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double()
    assert not torch.isnan(out).any()
    return float((out - ref).norm() / ref.norm())


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen(seed)) * scale).to(DEV, DTYPE)


@pytest.fixture(scope="module")
def ops() -> GpuDeterministicOps:
    return GpuDeterministicOps(ATTN_CFG)


# ---------------------------------------------------------------------------------- matmul

MM_SHAPES = [(4096, 4096), (6144, 4096)] if GPU else [(80, 96), (48, 64)]  # (N, K)
MM_MS = [1, 2, 3, 8, 17, 32, 64, 100, 128, 256, 300, 512] if GPU else [1, 2, 5, 16, 17, 33, 40]


@pytest.mark.parametrize("n,k", MM_SHAPES)
def test_matmul_matches_reference(n: int, k: int) -> None:
    x, w, bias = randn(64, k, seed=1), randn(n, k, seed=2, scale=k**-0.5), randn(n, seed=3)
    ref = x.double() @ w.double().T + bias.double()
    assert rel_err(mm.matmul(x, w, bias), ref) < TOL


@pytest.mark.parametrize("n,k", MM_SHAPES)
def test_matmul_rows_identical_for_every_m(n: int, k: int) -> None:
    """Through the table (GPU: across its buckets) and for each table config on its own."""
    x, w = randn(max(MM_MS), k, seed=4), randn(n, k, seed=5, scale=k**-0.5)
    # The interpreter's tl.dot is a numpy matmul whose row bits depend on the block shape, so
    # there the table's buckets can only be compared config by config; the MMA order on the
    # GPU makes tile shapes invisible, and that is checked through the table itself.
    configs = [None] if GPU else []
    configs += [cfg for *_, cfg in mm.TILE_TABLE]
    for cfg in configs:
        full = mm.matmul(x, w, config=cfg, out_dtype=torch.float32)
        for m in MM_MS:
            assert torch.equal(
                mm.matmul(x[:m], w, config=cfg, out_dtype=torch.float32), full[:m]
            ), (cfg, m)
            # Row m-1 placed first: a row's bits must not depend on its index either.
            assert torch.equal(
                mm.matmul(x[m - 1 : m], w, config=cfg, out_dtype=torch.float32), full[m - 1 : m]
            )


@pytest.mark.parametrize("n,k", MM_SHAPES)
def test_matmul_rows_identical_across_tile_shapes(n: int, k: int) -> None:
    """GPU: every table config gives the same rows. Interpreter: configs that share (BM, BK)
    (N tiling, warps, stages, grouping, TMA) give the same rows."""
    x, w = randn(40, k, seed=6), randn(n, k, seed=7, scale=k**-0.5)
    configs = [cfg for *_, cfg in mm.TILE_TABLE]
    if GPU:
        first = mm.matmul(x, w, config=configs[0], out_dtype=torch.float32)
        for cfg in configs[1:]:
            assert torch.equal(mm.matmul(x, w, config=cfg, out_dtype=torch.float32), first), cfg
        return
    for cfg in configs:
        base = mm.matmul(x, w, config=cfg, out_dtype=torch.float32)
        for bn, warps, group in ((16, 1, 1), (128, 8, 4)):
            var = mm.MatmulConfig(cfg.bm, bn, cfg.bk, warps, 2, group, not cfg.tma)
            assert torch.equal(mm.matmul(x, w, config=var, out_dtype=torch.float32), base), (
                cfg,
                var,
            )


def test_matmul_tables_are_consistent() -> None:
    """Every table BK divides the split alignment (no K block straddles two splits); both
    tables end with unbounded rows; one-program-per-split layouts are only picked where K is
    actually split (elsewhere they would be a silently different kernel than the table says)."""
    assert all(mm.SPLIT_ALIGN % cfg.bk == 0 for *_, cfg in mm.TILE_TABLE)
    assert mm.TILE_TABLE[-1][:3] == (mm._INF, mm._INF, mm._INF)
    assert mm.SPLIT_TABLE[-1][0] == mm._INF
    for m in (1, 8, 16, 17, 32, 33, 128, 129, 512, 513, 2048, 2049, 8192):
        for n in (896, 4096, 4097, 6144, 8192, 8193, 24576, 32768, 32769, 151936):
            for k in (576, 896, 2048, 4096, 8192, 8193, 12288, 18944, 29568):
                cfg = mm.pick_config(m, n, k)
                if cfg.split_programs:
                    assert mm.split_count(k) > 1, (m, n, k, cfg)


# (N, K): K crosses split points, and its last split and last K block are ragged
SPLIT_SHAPE = (4096, 12416) if GPU else (48, 640)
SPLIT_MS = [1, 5, 16, 33, 128, 300, 2048] if GPU else [1, 5, 16, 33]


@pytest.mark.parametrize("splits", [2, 3])
def test_matmul_split_k_rows_identical_for_every_m_and_layout(splits: int) -> None:
    """With K cut into splits, a row's bits do not depend on M, on the tile, or on whether the
    splits run in one program or in one program each (workspace + last-arrival fold), nor on
    the persistent kernel (GPU)."""
    n, k = SPLIT_SHAPE
    x, w = randn(max(SPLIT_MS), k, seed=20), randn(n, k, seed=21, scale=k**-0.5)
    bias = randn(n, seed=22)
    if GPU:
        layouts = [cfg for *_, cfg in mm.TILE_TABLE] + [
            mm.MatmulConfig(16, 32, 256, 4, 5, tma=True, split_programs=True),
            mm.MatmulConfig(128, 128, 64, 8, 4, tma=True, persistent=True),
            mm.MatmulConfig(64, 64, 128, 4, 3, split_programs=True),
        ]
    else:  # same BK (the interpreter's dot rounds per K block), every layout
        layouts = [
            mm.MatmulConfig(16, 32, 64, 4, 1, split_programs=True),
            mm.MatmulConfig(16, 16, 64, 4, 1),
            mm.MatmulConfig(32, 64, 64, 4, 1, group_m=1, split_programs=True),
        ]
    full = mm.matmul(x, w, bias, config=layouts[0], out_dtype=torch.float32, splits=splits)
    assert rel_err(full, x.double() @ w.double().T + bias.double()) < TOL
    for cfg in layouts:
        for m in SPLIT_MS:
            got = mm.matmul(x[:m], w, bias, config=cfg, out_dtype=torch.float32, splits=splits)
            assert torch.equal(got, full[:m]), (cfg, m)
        # A second call finds the arrival counters re-armed (graph replays rely on it too).
        again = mm.matmul(x[:7], w, bias, config=cfg, out_dtype=torch.float32, splits=splits)
        assert torch.equal(again, full[:7]), cfg


@pytest.mark.skipif(not GPU, reason="CUDA graphs need a GPU")
def test_matmul_split_programs_replay_in_cuda_graphs() -> None:
    """The last-arrival fold inside a captured graph: replays with new inputs equal eager
    calls bit for bit, and every arrival counter is re-armed (zero) afterwards."""
    n, k = SPLIT_SHAPE
    cfg = mm.MatmulConfig(16, 64, 256, 4, 4, tma=True, split_programs=True)
    w = randn(n, k, seed=25, scale=k**-0.5)
    static_x = randn(8, k, seed=26)
    mm.matmul(static_x, w, config=cfg, out_dtype=torch.float32, splits=3)  # compile, counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = mm.matmul(static_x, w, config=cfg, out_dtype=torch.float32, splits=3)
    for seed in (27, 28, 29):
        new = randn(8, k, seed=seed)
        static_x.copy_(new)
        graph.replay()
        assert torch.equal(y, mm.matmul(new, w, config=cfg, out_dtype=torch.float32, splits=3))
    assert int(mm.reserve_counters(w.device).count_nonzero()) == 0


def test_matmul_negative_control_split_points_are_visible() -> None:
    """The split tests can fail: another split count changes rows (the fold is not exact)."""
    n, k = SPLIT_SHAPE
    x, w = randn(8, k, seed=23), randn(n, k, seed=24, scale=k**-0.5)
    cfg = mm.MatmulConfig(16, 32, 64, 4, 1, split_programs=True)
    one = mm.matmul(x, w, config=cfg, out_dtype=torch.float32, splits=1)
    two = mm.matmul(x, w, config=cfg, out_dtype=torch.float32, splits=2)
    assert not torch.equal(one, two)


def test_matmul_negative_control_detects_a_changed_order() -> None:
    """The equality checks above can fail: a reduction order that depends on M (cuBLAS on the
    GPU) or on the K block (interpreter) changes rows."""
    if GPU:
        x, w = randn(2048, 4096, seed=8), randn(4096, 4096, seed=9, scale=4096**-0.5)
        full = torch.nn.functional.linear(x, w)
        differs = [
            m
            for m in (1, 16, 64, 256, 2048)
            if not torch.equal(torch.nn.functional.linear(x[:m], w), full[:m])
        ]
        assert differs, "cuBLAS rows never changed with M: the control lost its teeth"
    else:
        x, w = randn(16, 96, seed=8), randn(32, 96, seed=9)
        a = mm.matmul(x, w, config=mm.MatmulConfig(16, 32, 32, 4, 1))
        b = mm.matmul(x, w, config=mm.MatmulConfig(16, 32, 64, 4, 1))
        assert not torch.equal(a, b)


# ------------------------------------------------------------------- row-local small kernels


def test_norms_match_reference_and_are_row_invariant(ops: GpuDeterministicOps) -> None:
    h = 4096 if GPU else 96
    x, res, w = randn(37, h, seed=10), randn(37, h, seed=11), randn(h, seed=12)
    y = ops.rms_norm(x, w, 1e-6)
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert rel_err(y, ref) < TOL
    y2, r2 = ops.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(r2, (x.float() + res.float()).to(DTYPE))
    assert torch.equal(y2, ops.rms_norm(r2, w, 1e-6))
    assert torch.equal(ops.rms_norm(x[5:6], w, 1e-6), y[5:6])
    y3, r3 = ops.add_rms_norm(x[3:9], res[3:9], w, 1e-6)
    assert torch.equal(y3, y2[3:9]) and torch.equal(r3, r2[3:9])


def test_silu_mul(ops: GpuDeterministicOps) -> None:
    inter = 1536 if GPU else 40
    gu = randn(9, 2 * inter, seed=13)
    g, u = gu.double().chunk(2, dim=-1)
    assert rel_err(ops.silu_mul(gu), g * torch.sigmoid(g) * u) < TOL
    assert torch.equal(ops.silu_mul(gu[4:5]), ops.silu_mul(gu)[4:5])


def test_softcap(ops: GpuDeterministicOps) -> None:
    x = randn(5, 300, seed=15, scale=40.0).float()
    assert rel_err(ops.softcap(x, 30.0), torch.tanh(x.double() / 30.0) * 30.0) < 1e-6
    assert torch.equal(ops.softcap(x[2:3], 30.0), ops.softcap(x, 30.0)[2:3])


def test_gelu_tanh_mul(ops: GpuDeterministicOps) -> None:
    inter = 1536 if GPU else 40
    gu = randn(9, 2 * inter, seed=14, scale=3.0)
    g, u = gu.double().chunk(2, dim=-1)
    want = 0.5 * g * (1 + torch.tanh((2 / math.pi) ** 0.5 * (g + 0.044715 * g**3))) * u
    assert rel_err(ops.gelu_tanh_mul(gu), want) < TOL
    assert torch.equal(ops.gelu_tanh_mul(gu[4:5]), ops.gelu_tanh_mul(gu)[4:5])


def test_moe_matches_reference_and_ignores_each_experts_load(ops: GpuDeterministicOps) -> None:
    """`GpuDeterministicOps.moe` (Triton linears per expert over every row, sort routing)
    against the float64 reference, and a token's output bits beside 0 to ~100 near copies of
    itself (each of its experts loaded with them) equal to its output alone. Negative control
    (interpreter only, where the stock linear is torch's CPU GEMM, M-dependent on this
    project's machines): `GpuStockOps.moe` changes the token's bits."""
    from lockstep.ops.float64 import Float64Ops
    from lockstep.ops.gpu_stock import GpuStockOps
    from lockstep.ops.moe import MoeLayer, prepare_expert_weights

    experts, top_k, h, inter = (8, 2, 1024, 512) if GPU else (4, 2, 32, 48)
    raw = {
        "router": randn(experts, h, seed=30, scale=h**-0.5),
        "gate_up": randn(experts, 2 * inter, h, seed=31, scale=h**-0.5),
        "down": randn(experts, h, inter, seed=32, scale=inter**-0.5),
    }

    def layer(backend) -> MoeLayer:
        prep = backend.prepare_linear_weight
        return MoeLayer(prep(raw["router"]), prepare_expert_weights(prep, raw["gate_up"]),
                        prepare_expert_weights(prep, raw["down"]), top_k, True)  # fmt: skip

    x = randn(40, h, seed=33)
    out = ops.moe(x, layer(ops))
    assert out.dtype == DTYPE and out.shape == (40, h)
    assert rel_err(out, Float64Ops().moe(x, layer(Float64Ops()))) < TOL
    probe = x[7:8]
    loads = [1, 2, 5, 17, 100] if GPU else [1, 2, 5, 17]

    def changed_loads(backend) -> list[int]:
        prepared = layer(backend)
        alone = backend.moe(probe, prepared)
        changed = []
        for load in loads:
            mates = probe + 1e-3 * randn(load - 1, h, seed=34 + load)
            batch = torch.cat([x[:3], mates, probe, x[10:13]])
            if not torch.equal(backend.moe(batch, prepared)[3 + load - 1 :][:1], alone):
                changed.append(load)
        return changed

    assert changed_loads(ops) == []
    if not GPU:
        assert changed_loads(GpuStockOps()), "the stock MoE kept its bits: the check is blind"


@pytest.mark.parametrize("with_norm", [True, False])
def test_attention_input_matches_reference_and_is_per_token(
    ops: GpuDeterministicOps, with_norm: bool
) -> None:
    """The fused kernel (head norms, RoPE, cache writes) against the float64 composition
    (Float64Ops); v copied exactly into the slots given and k near the reference there;
    nothing written anywhere else (padding rows, slot -1, write nothing); each token's
    outputs equal those of the token computed alone, and a changed position changes them."""
    from lockstep.ops.float64 import Float64Ops

    hq, hkv, d, t = (8, 2, HD, 7) if GPU else (4, 2, HD, 7)
    qkv = randn(t, (hq + 2 * hkv) * d, seed=30)
    qn = randn(d, seed=31) if with_norm else None
    kn = randn(d, seed=32) if with_norm else None
    ang = (
        torch.arange(64, dtype=torch.float64)[:, None]
        * (1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)))[None, :]
    )
    cos, sin = ang.cos().float().to(DEV), ang.sin().float().to(DEV)
    pos = torch.tensor([5, 0, 63, 7, 7, 1, 40], dtype=torch.int64, device=DEV)
    slots = torch.tensor([3, 11, 0, 7, -1, 2, 9], dtype=torch.int64, device=DEV)
    real = (slots >= 0).cpu()
    guards = []
    layer = AttentionInput(hq, qn, kn, 1e-6, cos, sin)

    def run(rows, positions=pos):
        # The caches are rows 1..12 of zeroed buffers: a write through slot -1 would land in
        # guard row 0 (inside the allocation, where the checks below can see it).
        kbuf = torch.zeros(14, hkv, d, dtype=DTYPE, device=DEV)
        vbuf = torch.zeros_like(kbuf)
        kc, vc = kbuf[1:13], vbuf[1:13]
        q = ops.attention_input(qkv[rows], layer, positions[rows], slots[rows], LayerKV(kc, vc))
        guards.append(torch.cat((kbuf[[0, 13]], vbuf[[0, 13]])))
        return q, kc, vc

    q, kc, vc = run(slice(None))
    # float64 reference; its padding row writes to scratch slot 10, which the fused kernel
    # must leave untouched.
    ref_kc = torch.zeros(12, hkv, d, dtype=torch.float64)
    ref_vc = torch.zeros_like(ref_kc)
    ref_slots = torch.where(slots.cpu() >= 0, slots.cpu(), 10)
    cpu = lambda x: None if x is None else x.cpu()  # noqa: E731
    layer_cpu = AttentionInput(hq, cpu(qn), cpu(kn), 1e-6, cos.cpu(), sin.cpu())
    q_ref = Float64Ops().attention_input(qkv.cpu(), layer_cpu, pos.cpu(), ref_slots,
                                           LayerKV(ref_kc, ref_vc))  # fmt: skip
    used = slots[real.to(DEV)]
    assert rel_err(q, q_ref.to(DEV)) < TOL
    assert rel_err(kc[used], ref_kc[used.cpu()].to(DEV)) < TOL
    v_rows = qkv[real.to(DEV), (hq + hkv) * d :].reshape(-1, hkv, d)
    assert torch.equal(vc[used], v_rows)  # an exact copy
    untouched = [r for r in range(12) if r not in used.tolist()]
    assert kc[untouched].abs().sum() == 0 and vc[untouched].abs().sum() == 0
    for i in range(t):
        qi, kci, vci = run(slice(i, i + 1))
        assert torch.equal(qi, q[i : i + 1])
        if slots[i] >= 0:
            assert torch.equal(kci[slots[i]], kc[slots[i]])
            assert torch.equal(vci[slots[i]], vc[slots[i]])
    assert all(g.abs().sum() == 0 for g in guards)  # nothing written outside the caches
    # Control: the per-token comparisons see a change (another position rotates q and k).
    q_moved, kc_moved, _ = run(slice(None), positions=pos + 1)
    assert not torch.equal(q_moved, q) and not torch.equal(kc_moved, kc)


def test_log_softmax(ops: GpuDeterministicOps) -> None:
    v = 151936 if GPU else 5000  # crosses the fixed chunk several times
    logits = randn(6, v, seed=17, scale=4.0)
    logits[4, :4096] = float("-inf")  # a whole chunk masked out (its partial sum is 0)
    logits[5, 100:9000:3] = float("-inf")
    out = ops.log_softmax(logits)
    assert out.dtype == torch.float32
    ref = torch.log_softmax(logits.double(), dim=-1)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), finite)
    assert float((out.double() - ref)[finite].abs().max()) < 1e-4
    assert torch.equal(ops.log_softmax(logits[2:3]), out[2:3])
    assert torch.equal(ops.log_softmax(logits.flip(0))[3:4], out[2:3])
    # Negative control: a row built so that float32 addition order shows (one logit 0, 4095
    # at 0.75 ulp of 1 after exp, which round up when added to 1 one by one but not when
    # summed first): chunks of 64 and of 4096 group the sum differently and disagree, so
    # the equalities above would see an order that changed with the batch.
    from lockstep.ops.triton.log_softmax import log_softmax as raw

    tricky = torch.full((1, v), float("-inf"))
    tricky[0, 0] = 0.0
    tricky[0, 1:4096] = math.log(0.75 * 2.0**-23)
    tricky = tricky.to(DEV)
    assert not torch.equal(raw(tricky, chunk=64), raw(tricky))


def test_target_log_softmax_is_the_log_softmax_entry(ops: GpuDeterministicOps) -> None:
    """The training head's op (`TargetLogSoftmaxOps`): each row's target entry of
    `log_softmax`, bit for bit, and its logsumexp, without the [R, V] output."""
    v = 151936 if GPU else 5000
    logits = randn(7, v, seed=23, scale=4.0)
    logits[4, :4096] = float("-inf")
    logits[5, 100:9000:3] = float("-inf")
    targets = torch.tensor([0, v - 1, 4096, 17, 4097, 103, 2], device=logits.device)
    picked, lse = ops.target_log_softmax(logits, targets)
    full = ops.log_softmax(logits)
    assert picked.dtype == lse.dtype == torch.float32
    assert torch.equal(picked, full.gather(1, targets[:, None])[:, 0])
    ref = torch.logsumexp(logits.double(), dim=-1)
    assert float((lse.double() - ref).abs().max()) < 1e-4
    # Control: the neighbouring columns' entries are other values.
    other, _ = ops.target_log_softmax(logits, (targets + 1) % v)
    assert not torch.equal(other, picked)


# ------------------------------------------------------------------------------- attention


class Pool:
    """A paged KV cache with one sequence's keys scattered over random slots, plus random
    batch-mates sharing the pool."""

    def __init__(self, seed: int, length: int = SEQ, mates: int = 3, group: int = GROUP) -> None:
        rng = random.Random(seed)
        self.group = group
        self.mate_lens = [rng.randint(1, length + 40) for _ in range(mates)]
        total = length + sum(self.mate_lens) + 7
        perm = torch.randperm(total, generator=gen(seed)).to(torch.int32)
        self.slots = perm[:length].tolist()
        self.mate_slots, at = [], length
        for n in self.mate_lens:
            self.mate_slots.append(perm[at : at + n].tolist())
            at += n
        self.k = randn(total, HKV, HD, seed=seed + 1)
        self.v = randn(total, HKV, HD, seed=seed + 2)
        self.q = randn(length, HKV * group, HD, seed=seed + 3)
        self.mate_q = [randn(n, HKV * group, HD, seed=seed + 10 + i) for i, n in
                       enumerate(self.mate_lens)]  # fmt: skip
        self.scale = HD**-0.5

    def run(
        self,
        start: int,
        count: int,
        mates: list[tuple[int, int, int]] = (),
        cfg: AttentionConfig = ATTN_CFG,
        path: str | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """Rows start..start+count-1 of the sequence, beside mates (index, start, count)
        placed before it, within a sliding `window`; returns only this sequence's rows."""
        qs, counts, starts, tables = [], [], [], []
        for i, s, n in mates:
            qs.append(self.mate_q[i][s : s + n])
            counts.append(n)
            starts.append(s)
            tables.append(self.mate_slots[i])
        qs.append(self.q[start : start + count])
        counts.append(count)
        starts.append(start)
        tables.append(self.slots)
        meta: AttentionMeta = build_attention_meta(counts, starts, tables).to(DEV)
        # float32 output: every bit of the kernel's result is compared, not a bf16 rounding.
        out = paged_attention(
            torch.cat(qs), self.k, self.v, meta, self.scale, cfg, path, torch.float32, window
        )
        return out[sum(counts[:-1]) :]

    def reference(self, window: int | None = None) -> torch.Tensor:
        idx = torch.tensor(self.slots, device=DEV).long()
        k = self.k[idx].double().repeat_interleave(self.group, dim=1)
        v = self.v[idx].double().repeat_interleave(self.group, dim=1)
        s = torch.einsum("qhd,khd->hqk", self.q.double(), k) * self.scale
        n = len(self.slots)
        hidden = torch.ones(n, n, dtype=torch.bool, device=DEV).triu(1)
        if window is not None:  # keys more than window - 1 before the query
            hidden |= torch.ones_like(hidden).tril(-window)
        s = s.masked_fill(hidden, float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.fixture(scope="module")
def pool() -> Pool:
    return Pool(seed=100)


@pytest.fixture(scope="module")
def full(pool: Pool) -> torch.Tensor:
    return pool.run(0, SEQ, path="prefill")


def test_attention_matches_reference(pool: Pool, full: torch.Tensor) -> None:
    assert rel_err(full, pool.reference()) < TOL


@pytest.mark.parametrize("path", ["prefill", "fold", "split"])
def test_attention_random_chunkings_match_full_prefill(
    pool: Pool, full: torch.Tensor, path: str
) -> None:
    rng = random.Random(7)
    for _ in range(3):
        at = 0
        while at < SEQ:
            n = min(SEQ - at, rng.choice([1, 2, 3, 5, 16, 33, rng.randint(1, SEQ)]))
            assert torch.equal(pool.run(at, n, path=path), full[at : at + n]), (path, at, n)
            at += n


def test_attention_extend_at_every_prefix_offset(pool: Pool, full: torch.Tensor) -> None:
    """Radix-style hits: the uncached tail after a prefix of length p, for p at every residue
    modulo the key block and modulo the split (all p on the interpreter)."""
    if GPU:
        offsets = sorted({*range(0, 2 * ATTN_CFG.block_n + 1), *range(ATTN_CFG.split - 70,
                          ATTN_CFG.split + 70), *random.Random(3).sample(range(SEQ), 64)})  # fmt: skip
    else:
        offsets = list(range(SEQ))
    for p in offsets:
        n = min(SEQ - p, 1 + p % 19)
        path = ("prefill", "split", "fold")[p % 3]
        assert torch.equal(pool.run(p, n, path=path), full[p : p + n]), (p, n, path)


def test_attention_one_row_decode_matches_prefill(pool: Pool, full: torch.Tensor) -> None:
    """One-row decodes on the path the wrapper picks (fold within the first split, else the
    split path here) and on each decode path forced."""
    positions = range(SEQ) if not GPU else range(0, SEQ, 7)
    for p in positions:
        for path in (None, "fold", "split"):
            assert torch.equal(pool.run(p, 1, path=path), full[p : p + 1]), (p, path)


def test_attention_batch_mates_do_not_matter(pool: Pool, full: torch.Tensor) -> None:
    rng = random.Random(11)
    for trial in range(4):
        mates = []
        for i, n in enumerate(pool.mate_lens):
            s = rng.randrange(n)
            mates.append((i, s, rng.randint(1, n - s)))
        rng.shuffle(mates)
        p = rng.randrange(SEQ)
        n = rng.randint(1, SEQ - p)
        path = ("prefill", "split", "fold")[trial % 3]
        assert torch.equal(pool.run(p, n, mates, path=path), full[p : p + n]), (trial, p, n)


def test_attention_split_path_waves_fold_in_the_same_order(pool: Pool, full: torch.Tensor) -> None:
    """A workspace too small for more than one split per wave still gives the same bits."""
    tiny = AttentionConfig(**{**ATTN_CFG.__dict__, "workspace_bytes": 1})
    assert torch.equal(pool.run(SEQ - 5, 5, cfg=tiny, path="split"), full[SEQ - 5 :])


# A window that straddles key blocks and splits: 20 keys over 16-key blocks and 32-key splits
# (the interpreter's config), 600 over 64 and 512 (the GPU's).
WINDOW = 600 if GPU else 20


def test_sliding_window_matches_reference_under_every_schedule(
    pool: Pool, full: torch.Tensor
) -> None:
    """Sliding-window attention (Gemma 3's local layers): the float64 reference, and the bits
    of one full prefill under extends at every prefix offset (every path), one-row decodes
    and batch-mates. Negative control: rows that see more than the window differ from plain
    causal attention, the rows within it keep its bits."""
    want = pool.run(0, SEQ, path="prefill", window=WINDOW)
    assert rel_err(want, pool.reference(WINDOW)) < TOL
    assert torch.equal(want[:WINDOW], full[:WINDOW])
    assert not (want[WINDOW:] == full[WINDOW:]).flatten(1).all(1).any()
    rng = random.Random(13)
    # Starts at and around the window, key block and split edges, and where a row's window
    # starts at or just past a block edge (p - WINDOW + 1 near a multiple of the block).
    block, split = ATTN_CFG.block_n, ATTN_CFG.split
    edges = {WINDOW, block, 2 * block, split, 2 * split, block + WINDOW - 1, split + WINDOW - 1}
    offsets = sorted({e + d for e in edges for d in (-1, 0, 1) if 0 <= e + d < SEQ} | {0})
    for i, p in enumerate(offsets):
        n = min(SEQ - p, 1 + p % 23)
        path = ("prefill", "split", "fold")[i % 3]
        mates = [(0, 0, rng.randint(1, pool.mate_lens[0]))] if i % 2 else []
        got = pool.run(p, n, mates, path=path, window=WINDOW)
        assert torch.equal(got, want[p : p + n]), (p, n, path)
        decode = ("fold", "split")[i % 2]
        assert torch.equal(pool.run(p, 1, path=decode, window=WINDOW), want[p : p + 1]), p


class _NanFilledTorch:
    """torch for a kernel wrapper's module, with `empty` / `empty_like` of floating dtypes
    filled with NaN: a workspace element that a kernel reads before anything wrote it shows
    up in every bit it touches (on the GPU and in the interpreter alike). `filled` counts the
    buffers it filled, so a test can show the wrapper really allocated through it."""

    def __init__(self) -> None:
        self.filled = 0

    def __getattr__(self, name: str):
        return getattr(torch, name)

    def empty(self, shape, *, dtype, device) -> torch.Tensor:
        if not dtype.is_floating_point:
            return torch.empty(shape, dtype=dtype, device=device)
        self.filled += 1
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    def empty_like(self, x: torch.Tensor) -> torch.Tensor:
        return self.empty(x.shape, dtype=x.dtype, device=x.device)


def test_workspaces_are_written_before_they_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The split-K matmul's float32 workspace (one program per split, folded by the last to
    arrive) and log-softmax's per-chunk partials, started as NaN: the same bits as usual."""
    from lockstep.ops.triton import log_softmax as ls

    n, k = SPLIT_SHAPE
    x, w = randn(9, k, seed=23), randn(n, k, seed=24, scale=k**-0.5)
    cfg = mm.MatmulConfig(16, 32, 256 if GPU else 64, 4, 3 if GPU else 1, split_programs=True)
    logits = randn(3, 151936 if GPU else 5000, seed=25, scale=4.0)
    usual = (mm.matmul(x, w, config=cfg, out_dtype=torch.float32, splits=3), ls.log_softmax(logits))
    mm_torch, ls_torch = _NanFilledTorch(), _NanFilledTorch()
    monkeypatch.setattr(mm, "torch", mm_torch)
    monkeypatch.setattr(ls, "torch", ls_torch)
    nan_started = (
        mm.matmul(x, w, config=cfg, out_dtype=torch.float32, splits=3),
        ls.log_softmax(logits),
    )
    for a, b in zip(usual, nan_started, strict=True):
        assert not a.isnan().any() and torch.equal(a, b)
    # Not blind: output and workspace (matmul), output and both partials (log-softmax).
    assert (mm_torch.filled, ls_torch.filled) == (2, 3)


def test_attention_merge_shapes_give_the_same_bits(
    pool: Pool, full: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The merge folds each chunk of output columns in its own program (`merge_cols`) with
    its loads pipelined (`merge_stages`, capped per launch at the wave's partials rounded up
    to a power of two; the interpreter ignores stages, the GPU does not), in one wave, in
    waves of two partials (the last one part full) and in waves of one: every chunk folds
    the same (m, l) in the same order, so the split path keeps the prefill path's bits
    (decode and extends), also with 3 q heads per kv head (merge tiles of 4 rows over split
    tiles of 16 rows holding 5 positions). The wrapper's buffers start as NaN."""
    from lockstep.ops.triton import attention

    nan_torch = _NanFilledTorch()
    monkeypatch.setattr(attention, "torch", nan_torch)
    odd = Pool(seed=102, mates=2, group=3)
    # An extend starting 8 positions before the last split boundary: its first split tile
    # ends before the boundary, its last after it, so a merge tile spanning both would fold a
    # partial the first never wrote.
    across = SEQ - (SEQ - 1) // ATTN_CFG.split * ATTN_CFG.split + 8
    for p, want in ((pool, full), (odd, odd.run(0, SEQ, path="prefill"))):
        assert not want.isnan().any()
        hq = HKV * p.group
        for cols, stages in ((HD // 4, 2), (HD // 2, 8), (HD, 1)):
            for n in (1, 3, across):
                two_per_wave = 2 * n * hq * (HD + 2) * 4  # bytes of two splits' partials
                for ws in (ATTN_CFG.workspace_bytes, two_per_wave, 1):
                    shape = {"merge_cols": cols, "merge_stages": stages, "workspace_bytes": ws}
                    cfg = AttentionConfig(**{**ATTN_CFG.__dict__, **shape})
                    filled = nan_torch.filled
                    got = p.run(SEQ - n, n, cfg=cfg, path="split")
                    assert torch.equal(got, want[SEQ - n :]), (p.group, shape, n)
                    # Not blind: output and partials, plus the running state in waves.
                    assert nan_torch.filled - filled >= (7 if ws == 1 else 4), (shape, n)


def test_attention_many_splits_merge_in_order() -> None:
    """Splits of one key block over a longer sequence: more partials per row than the merge's
    pipeline has stages (8), so its load pipeline wraps; the split path still equals the
    prefill path's in-kernel merge (this config's own bits)."""
    length = 160 if not GPU else SEQ  # interpreter: 10 partials of 16 keys
    long_pool = Pool(seed=101, length=length)
    many = AttentionConfig(**{**ATTN_CFG.__dict__, "split": ATTN_CFG.block_n})
    rows = long_pool.run(0, length, cfg=many, path="prefill")
    for n in (1, 3):
        got = long_pool.run(length - n, n, cfg=many, path="split")
        assert torch.equal(got, rows[length - n :]), n
    assert not torch.equal(rows, long_pool.run(0, length, path="prefill")), "split not visible"


def test_attention_64_bit_gather_offsets_give_the_same_bits(
    pool: Pool, full: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Caches of 2**31+ elements gather with 64-bit offsets (a flag the wrapper sets from the
    cache's span; forced here, a cache that large does not fit a test): same bits, both paths."""
    from lockstep.ops.triton import attention

    assert not attention.needs_wide_offsets(pool.k)
    # The boundary, on shapes alone (meta tensors hold no memory): span 2**31 - 1 vs 2**31.
    assert not attention.needs_wide_offsets(torch.empty(2**21, 8, 128, device="meta"))
    assert attention.needs_wide_offsets(torch.empty(2**21 + 1, 8, 128, device="meta"))
    asked = []
    monkeypatch.setattr(attention, "needs_wide_offsets", lambda cache: asked.append(1) or True)
    for path in ("prefill", "fold", "split"):
        assert torch.equal(pool.run(SEQ - 3, 3, path=path), full[SEQ - 3 :]), path
    assert len(asked) == 3  # every launch took the forced 64-bit flag: the test is not blind


class _LaunchSpy:
    """Stands in for a @triton.jit kernel: records the named keyword arguments of every launch
    (constexprs and launch options), as booleans unless `raw`."""

    def __init__(self, kernel, names: tuple[str, ...], raw: bool = False) -> None:
        self.kernel, self.names, self.raw, self.seen = kernel, names, raw, set()

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            values = (kwargs[n] for n in self.names)
            self.seen.add(tuple(values) if self.raw else tuple(bool(v) for v in values))
            return launch(*args, **kwargs)

        return run


def test_attention_slot_ids_loaded_a_block_ahead_give_the_same_bits(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`slots_ahead` / `slots_ahead_split` (both on in production) load the next
    key block's slot ids early: the same values reach the same arithmetic, so every row
    keeps its bits, on both paths, on or off, at every chunk start tried (blocks wholly
    visible, partly visible, a split's last). Splits of four key blocks (the production
    split has eight), so the unmasked loop runs past its second block; a spy checks that
    both settings reach both kernels' launches."""
    from lockstep.ops.triton import attention

    spy = _LaunchSpy(attention._attn_fwd, ("WRITE_PARTIALS", "SLOTS_AHEAD"))
    monkeypatch.setattr(attention, "_attn_fwd", spy)
    base = ATTN_CFG if GPU else replace(ATTN_CFG, split=4 * ATTN_CFG.block_n)
    assert base.slots_ahead and base.slots_ahead_split  # production
    ahead, plain = base, replace(base, slots_ahead=False, slots_ahead_split=False)
    want = pool.run(0, SEQ, cfg=plain, path="prefill")
    assert torch.equal(pool.run(0, SEQ, cfg=ahead, path="prefill"), want)
    for p in range(0, SEQ, 1 if not GPU else 13):
        n = min(SEQ - p, 1 + p % 5)
        for cfg in (ahead, plain):
            for path in ("prefill", "fold", "split"):
                got = pool.run(p, n, cfg=cfg, path=path)
                assert torch.equal(got, want[p : p + n]), (p, path, cfg.slots_ahead)
    assert spy.seen == {(False, True), (True, True), (False, False), (True, False)}, spy.seen


def test_split_slots_ahead_only_while_every_program_is_resident(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA the option applies up to `slots_ahead_programs_per_sm` programs per SM (the
    table: 3, what its double buffers fit), never when the config turns it off."""
    from lockstep.ops.triton import attention

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(attention, "num_sms", lambda device: 132)
    cuda = torch.device("cuda", 0)
    on = AttentionConfig()
    assert on.slots_ahead_split and on.slots_ahead_programs_per_sm == 3
    assert attention.split_slots_ahead(on, 3 * 132, cuda)
    assert not attention.split_slots_ahead(on, 3 * 132 + 1, cuda)
    wider = AttentionConfig(slots_ahead_programs_per_sm=8)
    assert attention.split_slots_ahead(wider, 8 * 132, cuda)
    assert not attention.split_slots_ahead(wider, 8 * 132 + 1, cuda)
    off = AttentionConfig(slots_ahead_split=False)
    assert not attention.split_slots_ahead(off, 1, cuda)


def test_decode_path_folds_in_kernel_when_the_programs_fill_the_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decode-shaped calls fold their splits in-kernel when every sequence fits one split,
    or on CUDA when the fold's programs number `fold_programs_per_sm` per SM (1.5 in the
    table); otherwise they take the split path. The interpreter keeps the split path for
    more than one split."""
    from lockstep.ops.triton import attention

    cfg = AttentionConfig()
    assert cfg.fold_programs_per_sm == 1.5
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert attention.decode_path(cfg, 1, cfg.split, cpu) == "fold"
    assert attention.decode_path(cfg, 10**6, cfg.split + 1, cpu) == "split"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(attention, "num_sms", lambda device: 132)
    assert attention.decode_path(cfg, 8, cfg.split, cuda) == "fold"  # batch 1, one split
    assert attention.decode_path(cfg, 8, cfg.split + 1, cuda) == "split"  # batch 1
    assert attention.decode_path(cfg, 197, 32768, cuda) == "split"  # just below 1.5 x 132
    assert attention.decode_path(cfg, 198, 32768, cuda) == "fold"  # 1.5 x 132
    assert attention.decode_path(cfg, 256, 1024, cuda) == "fold"  # batch 32
    never = AttentionConfig(fold_programs_per_sm=math.inf)
    assert attention.decode_path(never, 10**6, 1024, cuda) == "split"
    with pytest.raises(ValueError, match="fold_programs_per_sm"):
        AttentionConfig(fold_programs_per_sm=0)


def test_unforced_decode_calls_take_the_path_decode_path_picks(
    pool: Pool, full: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wrapper follows `decode_path` with the fold's program count (decode tiles x
    sequences x kv heads, batch-mates included): a one-row decode within the first split
    folds in-kernel on DECODE tiles (rows_split, num_warps_split, num_stages_split; no
    partials written), one past it takes the split path (one-sequence calls never fill the
    GPU's SMs), and every call gives the prefill's bits."""
    from lockstep.ops.triton import attention

    names = ("WRITE_PARTIALS", "ROWS", "num_warps", "num_stages")
    spy = _LaunchSpy(attention._attn_fwd, names, raw=True)
    monkeypatch.setattr(attention, "_attn_fwd", spy)
    asked = []
    rule = attention.decode_path
    monkeypatch.setattr(attention, "decode_path", lambda c, programs, max_kv, device: (
        asked.append((programs, max_kv)) or rule(c, programs, max_kv, device)))  # fmt: skip
    cfg = ATTN_CFG
    decode_tiles = (0, cfg.rows_split, cfg.num_warps_split, cfg.num_stages_split)
    early, late = cfg.split - 1, SEQ - 1
    assert late >= cfg.split
    assert torch.equal(pool.run(early, 1), full[early : early + 1])
    assert spy.seen == {decode_tiles}, spy.seen
    assert asked == [(HKV * math.ceil(GROUP / cfg.rows_split), early + 1)], asked
    assert torch.equal(pool.run(late, 1), full[late:])
    assert spy.seen == {decode_tiles, (1, *decode_tiles[1:])}, spy.seen
    # Batch-mates, one of 9 queries (short chunks up to 16 here): 2 decode tiles per
    # sequence (9 x G rows > 16), times 3 sequences x Hkv.
    asked.clear()
    wide = AttentionConfig(**{**cfg.__dict__, "split_path_max_q": 16})
    first = next(i for i, n in enumerate(pool.mate_lens) if n >= 9)
    mates = [(first, 0, 9), ((first + 1) % len(pool.mate_lens), 0, 1)]
    assert torch.equal(pool.run(late, 1, mates, cfg=wide), full[late:])
    tiles = math.ceil(9 * GROUP / cfg.rows_split)
    assert tiles > 1 and asked == [(3 * HKV * tiles, SEQ)], asked


def test_attention_fold_and_split_paths_with_other_group_sizes() -> None:
    """3 and 7 q heads per kv head: a 16-row decode tile ends inside a position's heads, and
    extends of up to 4 queries span two tiles. Every decode path gives the prefill's bits."""
    for seed, group in ((104, 3), (105, 7)):
        p = Pool(seed=seed, mates=1, group=group)
        want = p.run(0, SEQ, path="prefill")
        for start in range(0, SEQ, 1 if not GPU else 37):
            n = min(SEQ - start, 1 + start % 4)
            for path in ("fold", "split"):
                got = p.run(start, n, path=path)
                assert torch.equal(got, want[start : start + n]), (group, start, n, path)


def test_attention_negative_control_other_key_block_differs(pool: Pool, full: torch.Tensor) -> None:
    other = pool.run(0, SEQ, cfg=OTHER_BLOCK_CFG, path="prefill")
    assert rel_err(other, pool.reference()) < TOL
    assert not torch.equal(other, full), "a different key block gave the same bits"


@pytest.mark.skipif(not GPU, reason="the interpreter has no warps or MMA layouts")
def test_attention_decode_tiles_on_any_warp_count_match_prefill(
    pool: Pool, full: torch.Tensor
) -> None:
    """The row sum of p is a dot (`row_sum_mma`), so decode tiles whose warps
    split a key block (mma.sync, 16 rows) give the prefill tiles' bits (wgmma, 128 rows on 8
    warps)."""
    for warps in (1, 2, 4, 8):
        cfg = AttentionConfig(**{**ATTN_CFG.__dict__, "num_warps_split": warps})
        for p in (0, 63, 64, 511, 512, 700, SEQ - 1):
            for path in ("fold", "split"):
                got = pool.run(p, 1, cfg=cfg, path=path)
                assert torch.equal(got, full[p : p + 1]), (warps, p, path)


@pytest.mark.parametrize("path", ["fold", "split"])
def test_attention_negative_control_other_split_differs(pool: Pool, path: str) -> None:
    """The split size is part of the numerics: decode tiles over splits twice the table's
    differ from the table's prefill on some rows, on both decode paths (so the equalities
    above are not vacuous)."""
    want = pool.run(0, SEQ, path="prefill")
    bad = AttentionConfig(**{**ATTN_CFG.__dict__, "split": 2 * ATTN_CFG.split})
    rows = [pool.run(p, 1, cfg=bad, path=path) for p in range(0, SEQ, 3)]
    assert not torch.equal(torch.cat(rows), want[0:SEQ:3])


def test_gpu_kernels_sweep_names_the_table() -> None:
    """The bench's sweep rows named as the table are the table, and the table's prefill row
    comes first: the bits table compares every decode config of the table's split with it."""
    from bench.gpu_kernels import SWEEP_ATTN_DECODE, SWEEP_ATTN_PREFILL

    assert SWEEP_ATTN_DECODE["r16n64w2s3mma"] == DEFAULT_CONFIG
    assert next(iter(SWEEP_ATTN_PREFILL.values())) == DEFAULT_CONFIG


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="profiles CUDA-graph replays")
def test_graph_span_counts_the_kernels_not_the_launch() -> None:
    """The decode table's span column: each replay's kernels found among the flushes (two
    per replay here), and a span that the replay's own time bounds from above."""
    from bench.gpu_kernels import graph_ms, graph_span_ms

    a = torch.zeros(1 << 20, device="cuda")
    b, c = torch.empty_like(a), torch.empty_like(a)

    def two_kernels() -> None:  # kernels, not copies (a same-dtype copy_ is a memcpy node)
        torch.add(a, 1.0, out=b)
        torch.mul(b, 2.0, out=c)

    span, replay = graph_span_ms(two_kernels), graph_ms(two_kernels)
    assert 0 < span < replay, (span, replay)


# ------------------------------------------------------------- the decoder, end to end (GPU)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="the bf16 decoder on the Triton backend needs CUDA")
@pytest.mark.parametrize("mode", ["deterministic", "reference"])
def test_decoder_on_gpu_any_schedule_matches_cold_prefill(mode: str) -> None:
    """The property suite's check (tests/support/invariance_harness.py) on CUDA in bfloat16: every
    position's logits and K/V under random prefix hits, chunkings, decode steps and batch-mates
    equal one cold prefill bitwise. Reference mode (cuBLAS, SDPA) is the negative control."""
    from lockstep.config import EngineConfig
    from lockstep.engine.engine import Engine
    from tests.support.invariance_harness import compute, mismatches, random_plan, reference

    engine = Engine(
        EngineConfig(model="random:tiny", device="cuda", dtype="bfloat16", mode=mode,
                     kv_tokens=8192)
    )  # fmt: skip
    failures = []
    for seed in range(12):
        rng = random.Random(seed)
        n = rng.randint(1, 600)
        tokens = [rng.randrange(engine.decoder.spec.vocab_size) for _ in range(n)]
        plan = random_plan(rng, n, 3)
        problems = mismatches(reference(engine, tokens), compute(engine, tokens, plan, rng))
        if problems:
            failures.append(f"seed={seed} n={n} {plan.describe()}: {problems[0]}")
        engine.check_integrity()
    if mode == "deterministic":
        assert not failures, "; ".join(failures)
    else:
        assert failures, "reference mode matched every schedule: the property lost its teeth"


class _KV:
    """A private paged KV store [layers, slots, Hkv, D] (KVStorage protocol)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v
        self.routed_experts = None

    def k_cache(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.v[layer]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("mode", ["deterministic", "reference"])
def test_decode_cuda_graphs_match_eager(mode: str) -> None:
    """Decode steps replayed from CUDA graphs (padded to batch and context buckets, captured
    on first use, replayed after) give the eager step's logits and K/V: bit for bit in
    deterministic mode, within rounding in reference mode (cuBLAS rows change with M)."""
    from lockstep.config import EngineConfig
    from lockstep.engine.cuda_graphs import DecodeGraphRunner
    from lockstep.engine.engine import Engine
    from lockstep.models.forward_batch import ForwardBatch

    engine = Engine(
        EngineConfig(model="random:tiny", device="cuda", dtype="bfloat16", mode=mode,
                     kv_tokens=512)
    )  # fmt: skip
    dec, spec = engine.decoder, engine.decoder.spec
    n_slots = 12000
    shape = (spec.num_layers, n_slots, spec.num_kv_heads, spec.head_dim)
    k0 = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    kv_eager, kv_graph = _KV(k0, torch.zeros_like(k0)), _KV(k0.clone(), torch.zeros_like(k0))
    runner = DecodeGraphRunner(dec, kv_graph, max_batch=16, max_context=1024,
                               batch_buckets=(4, 16), context_buckets=(256,))  # fmt: skip
    rng = random.Random(5)
    perm = torch.randperm(n_slots, generator=gen(5))
    # Short and long contexts, so that steps land in both context buckets (256 and 1024).
    lens = [rng.randint(2, 200) for _ in range(8)] + [rng.randint(300, 900) for _ in range(8)]
    tables = [perm[sum(lens[:i]) + 20 * i :][: lens[i] + 20] for i in range(16)]
    tokens = [[rng.randrange(spec.vocab_size) for _ in range(n + 20)] for n in lens]

    def batch_of(seqs: list[int], starts: list[int], counts: list[int]) -> ForwardBatch:
        ids, pos, out = [], [], []
        for s, st, c in zip(seqs, starts, counts, strict=True):
            ids += tokens[s][st : st + c]
            pos += list(range(st, st + c))
            out += tables[s][st : st + c].tolist()
        return ForwardBatch(
            token_ids=torch.tensor(ids), positions=torch.tensor(pos), out_slots=torch.tensor(out),
            meta=build_attention_meta(counts, starts, [tables[s] for s in seqs]),
            logit_rows=torch.arange(len(seqs)),
        )  # fmt: skip

    every = list(range(16))
    prefill = batch_of(every, [0] * 16, [n - 1 for n in lens])
    for kv in (kv_eager, kv_graph):
        dec.forward(prefill.to("cuda"), kv)
    at = [n - 1 for n in lens]
    short = list(range(8))
    plans = [rng.sample(short, 3), rng.sample(every, 4), every, rng.sample(every, 11),
             rng.sample(short, 3), [12], every]  # fmt: skip
    for step, seqs in enumerate(plans):
        batch = batch_of(seqs, [at[s] for s in seqs], [1] * len(seqs))
        eager = dec.forward(batch.to("cuda"), kv_eager)
        assert runner.can_run(batch)
        graph = runner.run(batch)
        if mode == "deterministic":
            assert torch.equal(graph, eager), f"step {step}: logits differ"
            assert torch.equal(kv_graph.k, kv_eager.k) and torch.equal(kv_graph.v, kv_eager.v)
        else:
            assert rel_err(graph, eager.double()) < 2e-2
        for s in seqs:
            at[s] += 1
    assert runner.num_graphs == 3  # (4, 256), (4, 1024), (16, 1024); the rest replayed
