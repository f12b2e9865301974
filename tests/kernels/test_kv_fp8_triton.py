"""The Triton kernels with an FP8 (e4m3, scale 1.0) KV cache, under the interpreter on the CPU
(float32 and bfloat16 activations) or on a GPU (bfloat16).

The contract (lockstep/ops/fp8.py, "FP8 KV cache"): the fused attention-input kernel writes
e4m3_sat of exactly the value it would write to a cache of the activation dtype, and attention
over an FP8 cache computes the same bits as attention over a cache holding those values
widened; so the FP8 cache adds nothing to the attention arithmetic but the rounding at write.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from lockstep.ops.base import AttentionInput, LayerKV, build_attention_meta  # noqa: E402
from lockstep.ops.fp8 import E4M3, dequantize_kv, e4m3_sat, quantize_kv  # noqa: E402
from lockstep.ops.gpu_deterministic import GpuDeterministicOps  # noqa: E402
from lockstep.ops.triton.attention import (  # noqa: E402
    DEFAULT_CONFIG,
    AttentionConfig,
    paged_attention,
)

GPU = torch.cuda.is_available()
if not GPU:  # a row-local tl.dot for the interpreter (test_ops_triton.py says why)
    from test_ops_triton import _row_local_interpreter_dot

    _row_local_interpreter_dot()
# Padding rows divide 0 by 0 in discarded branches; numpy (the interpreter) warns about them.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
DEV = "cuda" if GPU else "cpu"
# bfloat16 queries read the cache through the scaled bit-move widening (`attention.widen_kv`),
# float32 ones through an exact conversion: the interpreter runs both.
DTYPES = [torch.bfloat16] if GPU else [torch.float32, torch.bfloat16]
HKV, GROUP, HD = 2, 2, 64 if GPU else 32
CFG = DEFAULT_CONFIG if GPU else AttentionConfig(block_n=16, split=32, rows=32, num_warps=4)


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def dtype(request) -> torch.dtype:
    return request.param


def _randn(*shape: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)


def test_attention_input_writes_e4m3_of_the_cache_value(dtype: torch.dtype) -> None:
    ops = GpuDeterministicOps()
    t, hq = 5, HKV * GROUP
    # Values beyond +-448 saturate; small ones land in e4m3's subnormals.
    qkv = _randn(t, (hq + 2 * HKV) * HD, seed=1, dtype=dtype, scale=3.0)
    qkv[0, -HD:] = 1000.0
    qkv[1, -HD:] = 1e-3
    ang = torch.arange(16, dtype=torch.float64)[:, None] * torch.linspace(0, 1, HD // 2)[None]
    layer = AttentionInput(hq, None, None, 1e-6, ang.cos().float().to(DEV),
                           ang.sin().float().to(DEV))  # fmt: skip
    pos = torch.tensor([3, 0, 15, 7, 1], device=DEV)
    slots = torch.tensor([4, 1, 0, 6, 2], device=DEV)

    def caches(cache_dtype: torch.dtype) -> LayerKV:
        return LayerKV(torch.zeros(8, HKV, HD, dtype=cache_dtype, device=DEV),
                       torch.zeros(8, HKV, HD, dtype=cache_dtype, device=DEV))  # fmt: skip

    wide, fp8 = caches(dtype), caches(E4M3)
    q_wide = ops.attention_input(qkv, layer, pos, slots, wide)
    q_fp8 = ops.attention_input(qkv, layer, pos, slots, fp8)
    assert torch.equal(q_wide, q_fp8)
    for got, want in ((fp8.k, wide.k), (fp8.v, wide.v)):
        assert torch.equal(got.view(torch.uint8), e4m3_sat(want.float()).view(torch.uint8))
    assert fp8.v.float().abs().max().item() == 448.0  # saturated, not NaN
    assert not torch.equal(fp8.k.float(), wide.k.float())  # the rounding is real (control)


@pytest.mark.parametrize("path", ["prefill", "fold", "split"])
def test_attention_over_fp8_cache_equals_the_widened_cache(path: str, dtype: torch.dtype) -> None:
    n, total = 70, 90
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(3)).tolist()
    slots = perm[:n]
    k8 = e4m3_sat(_randn(total, HKV, HD, seed=4, dtype=dtype).float())
    v8 = e4m3_sat(_randn(total, HKV, HD, seed=5, dtype=dtype).float())
    q = _randn(n, HKV * GROUP, HD, seed=6, dtype=dtype)
    scale = HD**-0.5

    def run(k: torch.Tensor, v: torch.Tensor, start: int, count: int) -> torch.Tensor:
        meta = build_attention_meta([count], [start], [slots]).to(DEV)
        return paged_attention(q[start : start + count], k, v, meta, scale, CFG, path,
                               torch.float32)  # fmt: skip

    k_wide, v_wide = k8.to(dtype), v8.to(dtype)
    full = run(k8, v8, 0, n)
    assert torch.equal(full, run(k_wide, v_wide, 0, n))
    for start, count in ((0, 1), (17, 1), (33, 20), (69, 1)):  # extends and decode rows
        assert torch.equal(run(k8, v8, start, count), full[start : start + count])
    # Control: the cache before rounding gives other bits.
    assert not torch.equal(run(k_wide + 1e-2, v_wide, 0, n), full)


def test_decode_rows_over_several_splits_equal_the_prefill_tiles(dtype: torch.dtype) -> None:
    """One query per sequence over contexts of several splits: the decode tiles (fold and
    split paths) give the prefill tiles' bits over an FP8 cache, as over the widened one.
    On the GPU this is the layout `attention.widen_kv` keeps (the decode tiles' dots over a
    plainly widened e4m3 cache permuted the K order inside each MMA and differed in every
    row); tests/kernels/test_kernel_compile_sm90.py checks that layout in CI."""
    split = CFG.split
    lens = [2 * split + 1, 2 * split + 37, 3 * split - 5, 3 * split + 40, split + 3]
    total = sum(lens) + 8
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(7)).tolist()
    tables, at = [], 0
    for n in lens:
        tables.append(perm[at : at + n])
        at += n
    k8 = e4m3_sat(_randn(total, HKV, HD, seed=8, dtype=dtype, scale=2.0).float())
    v8 = e4m3_sat(_randn(total, HKV, HD, seed=9, dtype=dtype, scale=2.0).float())
    q = _randn(len(lens), HKV * GROUP, HD, seed=10, dtype=dtype)
    meta = build_attention_meta([1] * len(lens), [n - 1 for n in lens], tables).to(DEV)

    def run(k: torch.Tensor, v: torch.Tensor, path: str) -> torch.Tensor:
        return paged_attention(q, k, v, meta, HD**-0.5, CFG, path, torch.float32)

    prefill = run(k8, v8, "prefill")
    assert torch.equal(prefill, run(k8.to(dtype), v8.to(dtype), "prefill"))
    for path in ("fold", "split"):
        assert torch.equal(run(k8, v8, path), prefill), path


def test_attention_input_writes_the_cache_value_over_the_layers_scale(dtype: torch.dtype) -> None:
    """With a checkpoint's KV scales the kernel writes `quantize_kv(value, scale)` bit for bit
    (one correctly rounded division, then e4m3), so a value of 1000 at scale 4 is stored as
    250's e4m3 and not clipped; the torch write path (`write_kv`, partial rotary models)
    writes the same bytes."""
    ops = GpuDeterministicOps()
    t, hq = 5, HKV * GROUP
    qkv = _randn(t, (hq + 2 * HKV) * HD, seed=11, dtype=dtype, scale=300.0)
    qkv[0, -HD:] = 1000.0
    ang = torch.arange(16, dtype=torch.float64)[:, None] * torch.linspace(0, 1, HD // 2)[None]
    layer = AttentionInput(hq, None, None, 1e-6, ang.cos().float().to(DEV),
                           ang.sin().float().to(DEV))  # fmt: skip
    pos = torch.tensor([3, 0, 15, 7, 1], device=DEV)
    slots = torch.tensor([4, 1, 0, 6, 2], device=DEV)
    k_scale, v_scale = 2.75, 3.0 / 7.0 * 10  # fp32-rounded below; one inexact division

    def caches(cache_dtype: torch.dtype, ks: float = 1.0, vs: float = 1.0) -> LayerKV:
        return LayerKV(torch.zeros(8, HKV, HD, dtype=cache_dtype, device=DEV),
                       torch.zeros(8, HKV, HD, dtype=cache_dtype, device=DEV), ks, vs)  # fmt: skip

    v_scale = float(torch.tensor(v_scale, dtype=torch.float32))
    wide, fp8 = caches(dtype), caches(E4M3, k_scale, v_scale)
    ops.attention_input(qkv, layer, pos, slots, wide)
    ops.attention_input(qkv, layer, pos, slots, fp8)
    for got, want, s in ((fp8.k, wide.k, k_scale), (fp8.v, wide.v, v_scale)):
        assert torch.equal(got.view(torch.uint8), quantize_kv(want, s).view(torch.uint8))
        torch_path = torch.zeros_like(got)
        ops.write_kv(torch_path, torch_path, want[slots], want[slots], slots, s, s)
        assert torch.equal(torch_path[slots].view(torch.uint8), got[slots].view(torch.uint8))
    assert fp8.v.float().abs().max().item() * v_scale > 448.0  # beyond 448 * 1.0, kept
    assert not torch.equal(fp8.v.view(torch.uint8), quantize_kv(wide.v).view(torch.uint8))


def test_scaled_fp8_cache_gives_one_set_of_bits_for_every_chunk(dtype: torch.dtype) -> None:
    """`GpuDeterministicOps.attention` over a cache with k/v scales: extends and decode rows
    (decode tiles) equal the full prefill's rows (prefill tiles), and the result is the
    attention over the dequantized cache (fp32(q) * scale) within the kernel's rounding;
    ignoring the scales (the control) is far from it."""
    n, total = 70, 90
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(12)).tolist()
    slots = perm[:n]
    k8 = e4m3_sat(_randn(total, HKV, HD, seed=13, dtype=dtype).float() * 8)
    v8 = e4m3_sat(_randn(total, HKV, HD, seed=14, dtype=dtype).float() * 8)
    q = _randn(n, HKV * GROUP, HD, seed=15, dtype=dtype)
    ks, vs = 0.0625, 37.5
    ops = GpuDeterministicOps(attention_config=CFG)

    def run(kv: LayerKV, start: int, count: int) -> torch.Tensor:
        meta = build_attention_meta([count], [start], [slots]).to(DEV)
        return ops.attention(q[start : start + count], kv, meta, HD**-0.5)

    full = run(LayerKV(k8, v8, ks, vs), 0, n)
    for start, count in ((0, 1), (17, 1), (33, 20), (69, 1)):
        assert torch.equal(run(LayerKV(k8, v8, ks, vs), start, count),
                           full[start : start + count])  # fmt: skip
    want = run(LayerKV(dequantize_kv(k8, ks).to(dtype), dequantize_kv(v8, vs).to(dtype)), 0, n)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(full.float(), want.float(), rtol=tol, atol=tol * vs)
    unscaled = run(LayerKV(k8, v8), 0, n).float()
    assert (unscaled - want.float()).abs().max().item() > 10 * tol * vs
