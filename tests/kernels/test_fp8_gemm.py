"""The FP8 Triton kernels (lockstep/ops/triton/fp8_gemm.py) against the numeric specification
(lockstep/ops/fp8.py), and their position invariance, bit for bit.

Without CUDA the kernels run under the Triton interpreter on small shapes (indexing, masking,
K tails, bias, strided 3-D input, the quantization's bits); the `gpu` tests run the production
tables on Qwen3-8B projection shapes: every row of a call of M rows equals the same row inside
calls of every other M from 1 to 8192, in bf16 and fp16, two seeds, with bias, strided 3-D
input and CUDA-graph replay; with controls that show the comparison can fail.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from lockstep.ops import fp8 as spec
from lockstep.ops.triton import fp8_gemm as f8
from tests.support.fp8_block_dots import block_dots_reference, tolerance

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
gpu = pytest.mark.skipif(not GPU, reason="needs CUDA")


if not GPU:
    # The interpreter's tl.dot on e4m3 is a float16 numpy matmul whose rounding depends on the
    # block's shape (BLAS); the shared row-local dot is exact per 128-long e4m3 block, rounded
    # once to fp32 like one block of the GPU's fp32 result.
    from test_ops_triton import _row_local_interpreter_dot

    _row_local_interpreter_dot()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _weight(n: int, k: int, scheme: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * k**-0.5
    wq, ws, ins = spec.quantize_weight(w, scheme)
    bias = torch.randn(n, generator=g)
    move = (lambda t: None if t is None else t.to(DEV))  # fmt: skip
    return move(wq), move(ws), move(ins), move(bias)


def _x(m: int, k: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * 2).to(DEV, dtype)


# ----------------------------------------------------------------------------- quantization


def _edge_values() -> torch.Tensor:
    """Every e4m3 value, the midpoints between neighbours (ties: round to even) and one fp32
    ulp either side of them, values past 448 (saturate; 464 is the tie that a non-saturating
    cast rounds to NaN), fp32 subnormals and zeros of both signs."""
    codes = torch.arange(256, dtype=torch.uint8).view(spec.E4M3).float()
    grid = codes[torch.isfinite(codes)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    big = torch.tensor([447.9, 448.0, 456.0, 464.0, 470.0, 480.0, 1e6, 3e38])
    tiny = torch.tensor([1e-40, 2**-10, 2**-11, 3 * 2**-11, 2**-7 - 2**-12, 0.0, -0.0])
    vals = torch.cat([grid, near, big, -big, tiny, -tiny])
    return torch.nn.functional.pad(vals, (0, -len(vals) % 128)).view(-1, 128)


def test_e4m3_rounding_matches_torch_on_every_code_and_tie() -> None:
    x = _edge_values().to(DEV)
    one = torch.ones((), device=DEV)
    q, sx = f8.quantize_activation(x, "tensor", one)
    want = spec.quantize_static(x.cpu(), one.cpu())
    assert torch.equal(_bits(q).cpu(), _bits(want))
    assert torch.equal(sx.cpu(), one.reshape(1).cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme", ["block", "channel", "tensor"])
def test_quantization_bits_equal_the_spec(scheme: str, dtype: torch.dtype) -> None:
    """Groups with zeros only, huge and tiny magnitudes, a 44-column last group (K = 300)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 300, generator=g) * torch.logspace(-9, 4, 300)
    x[1, :128] = 0.0
    x[2, 7] = 6e4
    x = x.to(DEV, dtype)
    ins = torch.tensor(0.02, device=DEV) if scheme == "tensor" else None
    q, sx = f8.quantize_activation(x, scheme, ins)
    if scheme == "tensor":
        want_q, want_s = spec.quantize_static(x.cpu(), ins.cpu()), ins.reshape(1).cpu()
    else:
        want_q, want_s = spec.quantize_rows(x.cpu(), 128 if scheme == "block" else 300)
    assert torch.equal(_bits(q).cpu(), _bits(want_q))
    assert torch.equal(sx.cpu(), want_s)


def test_quantization_reads_strided_3d_input() -> None:
    """A [B, T, K] view with a batch stride, a row stride and a column stride that are not
    those of a contiguous tensor: the same bits as its contiguous copy."""
    base = _x(3 * 11 * 2, 2 * 200, seed=4).view(3, 11, 2, 400)
    x = base[:, 2:9, 1, ::2]  # [3, 7, 200], strides (8800, 800, 2)
    assert x.stride() == (8800, 800, 2)
    for scheme in ("block", "channel"):
        q, sx = f8.quantize_activation(x, scheme)
        q2, sx2 = f8.quantize_activation(x.reshape(21, 200).contiguous(), scheme)
        assert torch.equal(_bits(q), _bits(q2)) and torch.equal(sx, sx2)


# ------------------------------------------------------------------------------------ GEMM

SMALL_SHAPES = [(72, 300), (96, 80), (130, 256)]  # (N, K): N and K tails, K < 128, exact K
SCHEMES = ["block", "tensor", "channel"]


@pytest.mark.parametrize("n,k", SMALL_SHAPES)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_fp8_linear_matches_the_float64_reference(scheme: str, n: int, k: int) -> None:
    """fp32, bf16 and fp16 activations (outputs of the same dtype) within the kernel's fp32
    roundings of the block-sum reference (tests/support/fp8_block_dots.py: exact block dots in the
    interpreter, cuBLAS's on the GPU)."""
    wq, ws, ins, bias = _weight(n, k, scheme, seed=n + k)
    x = _x(20, k, seed=1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        y = f8.fp8_linear(x.to(dtype), wq, ws, scheme, ins, bias)
        assert y.dtype == dtype
        ref, size = block_dots_reference(x.to(dtype), wq, ws, scheme, ins, bias)
        excess = (y.double() - ref).abs() - tolerance(size, ref, k, dtype)
        assert excess.max() <= 0, (dtype, excess.max().item())
    if scheme == "block":  # a tile spanning two rows of weight-scale blocks: the same bits
        wide = f8.Fp8GemmConfig(64, 256, 4, 2)
        y = f8.fp8_linear(x, wq, ws, scheme, ins, bias, torch.float32)
        assert torch.equal(f8.fp8_linear(x, wq, ws, scheme, ins, bias, torch.float32, wide), y)


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.cpu()


def _configs() -> list[f8.Fp8GemmConfig]:
    table = list(dict.fromkeys(cfg for *_, cfg in f8.TILE_TABLE))
    if GPU:
        return table
    # The interpreter: the table's tile shapes are too slow at these sizes; small tiles cover
    # the same indexing (row/col clamps, K masks, grouping).
    return [f8.Fp8GemmConfig(16, 32, 4, 1, group_m=2), f8.Fp8GemmConfig(32, 64, 4, 1)]


MS = [1, 2, 5, 16, 17, 33, 40]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_rows_identical_for_every_m_and_config(scheme: str) -> None:
    """Row bits (fp32 out) of a call of M rows = the same rows of the 40-row call, for every
    config; a row alone = the same row in place m - 1 of the batch (a few m). N = 136: two
    rows of 128 x 128 weight-scale blocks."""
    n, k = 136, 300
    wq, ws, ins, bias = _weight(n, k, scheme, seed=5)
    x = _x(max(MS), k, seed=6)
    full = f8.fp8_linear(x, wq, ws, scheme, ins, bias, out_dtype=torch.float32)
    for cfg in _configs():
        for m in MS:
            got = f8.fp8_linear(x[:m], wq, ws, scheme, ins, bias, torch.float32, cfg)
            assert torch.equal(got, full[:m]), (cfg, m)
            if m not in (1, 17, 40):
                continue
            alone = f8.fp8_linear(x[m - 1 : m], wq, ws, scheme, ins, bias, torch.float32, cfg)
            assert torch.equal(alone, full[m - 1 : m]), (cfg, m)


def test_batch_wide_activation_scale_is_not_row_local() -> None:
    """Negative control for the comparison above: a dynamic per-TENSOR activation scale (the
    max over the batch, the scheme the loaders refuse) makes a row's bits depend on its
    batch-mates, and the same check catches it."""
    n, k = 96, 300
    wq, ws, _, bias = _weight(n, k, "tensor", seed=7)
    x = _x(max(MS), k, seed=8)
    x[5] *= 40.0  # a batch-mate with a larger range than row 0

    def batch_scaled(rows: torch.Tensor) -> torch.Tensor:
        scale = (rows.abs().amax() / spec.E4M3_MAX).reshape(())
        return f8.fp8_linear(rows, wq, ws, "tensor", scale, bias, out_dtype=torch.float32)

    full = batch_scaled(x)
    assert not torch.equal(batch_scaled(x[:1]), full[:1])


def test_fp8_linear_strided_3d_input_equals_2d() -> None:
    wq, ws, _, bias = _weight(80, 160, "block", seed=9)
    base = _x(2 * 9, 2 * 160, seed=10).view(2, 9, 320)
    x = base[:, 1:8, ::2]  # [2, 7, 160], strides (2880, 320, 2)
    y = f8.fp8_linear(x, wq, ws, "block", None, bias, out_dtype=torch.float32)
    y2 = f8.fp8_linear(x.reshape(14, 160).contiguous(), wq, ws, "block", None, bias,
                       out_dtype=torch.float32)  # fmt: skip
    assert y.shape == (2, 7, 80)
    assert torch.equal(y.reshape(14, 80), y2)


def test_the_spec_entry_point_runs_this_kernel() -> None:
    """`lockstep.ops.fp8.fp8_linear` (what the GPU backend calls) is this module's kernel:
    the same bits, keyword arguments as the interface fixes them, x's dtype out."""
    wq, ws, ins, bias = _weight(64, 160, "tensor", seed=13)
    x = _x(3, 160, seed=14, dtype=torch.bfloat16)
    y = spec.fp8_linear(x, wq, ws, "tensor", input_scale=ins, bias=bias)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, f8.fp8_linear(x, wq, ws, "tensor", ins, bias))


def test_table_uses_one_mma_flavour_and_ends_unbounded() -> None:
    """Every table BM is a multiple of 64 (wgmma on Hopper: the module docstring's reason) and
    the last row catches every shape."""
    assert all(cfg.bm % 64 == 0 for *_, cfg in f8.TILE_TABLE)
    assert f8.TILE_TABLE[-1][:3] == (f8._INF, f8._INF, f8._INF)
    assert f8.pick_config(10**9, 10**9, 10**9) is f8.TILE_TABLE[-1][3]


def test_wrapper_refuses_bad_arguments_with_one_line() -> None:
    wq, ws, ins, _ = _weight(64, 128, "tensor", seed=11)
    x = _x(2, 128, seed=12)
    cases = [
        (lambda: f8.fp8_linear(x, wq, ws, "per-tensor-dynamic"), "scheme"),
        (lambda: f8.fp8_linear(x, wq, ws, "tensor"), "input_scale"),
        (lambda: f8.fp8_linear(x, wq, ws, "channel", ins), "input_scale"),
        (lambda: f8.fp8_linear(x, wq, ws[:10], "channel"), "weight_scale"),
        (lambda: f8.fp8_linear(x, wq, ws, "block"), "weight_scale"),
        (lambda: f8.fp8_linear(x.long(), wq, ws, "channel"), "dtype"),
        (lambda: f8.fp8_linear(x[None, None], wq, ws, "channel"), "3-D"),
        (lambda: f8.fp8_linear(x, wq.float(), ws, "channel"), "float8"),
        (lambda: f8.fp8_linear(x, wq, ws, "channel", bias=ws[:3]), "bias"),
    ]
    for call, word in cases:
        with pytest.raises(ValueError, match=word) as err:
            call()
        assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------ GPU (H200)

# Qwen3-8B projections (N, K) and a K tail shorter than one block.
GPU_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
              "down": (4096, 12288), "k80": (384, 80)}  # fmt: skip
GPU_MS = [1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 513,
          1023, 1024, 1025, 4096, 8192]  # fmt: skip


def _gpu_weight(n: int, k: int, scheme: str, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * k**-0.5
    wq, ws, ins = spec.quantize_weight(w, scheme)
    bias = torch.randn(n, device="cuda", generator=g)
    return wq, ws, None if ins is None else ins.cuda(), bias


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_rows_identical_for_every_m(dtype: torch.dtype, seed: int) -> None:
    """For each scheme and shape: rows (fp32 out) of calls of every M in GPU_MS equal the same
    rows of the 8192-row call; the input is a strided 3-D view (rows of a wider tensor); the
    call's own dtype output is the cast of those bits. Also a row at another index."""
    big = max(GPU_MS)
    for name, (n, k) in GPU_SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(100 + seed)
        store = torch.randn(2, big // 2, k + 64, device="cuda", generator=g).to(dtype)
        x3 = store[:, :, 32 : 32 + k]  # [2, 4096, K] with a row stride of K + 64
        x = x3.reshape(big, k)  # copies: the 2-D rows of the same values
        for scheme in SCHEMES:
            wq, ws, ins, bias = _gpu_weight(n, k, scheme, seed)
            full = f8.fp8_linear(x3, wq, ws, scheme, ins, bias, out_dtype=torch.float32)
            full = full.reshape(big, n)
            for m in GPU_MS:
                got = f8.fp8_linear(x[:m], wq, ws, scheme, ins, bias, out_dtype=torch.float32)
                assert torch.equal(got, full[:m]), (name, scheme, m)
            rolled = f8.fp8_linear(x[:300].roll(7, 0), wq, ws, scheme, ins, bias, torch.float32)
            assert torch.equal(rolled, full[:300].roll(7, 0)), (name, scheme)
            native = f8.fp8_linear(x[:129], wq, ws, scheme, ins, bias)
            assert native.dtype == dtype and torch.equal(native, full[:129].to(dtype))
        del store, x, x3, full
        torch.cuda.empty_cache()


@gpu
@pytest.mark.gpu
def test_gpu_table_configs_agree() -> None:
    """Every config of the table (and its pointer-load variant) gives the same bits: the table
    may pick any of them for any M."""
    for name, (n, k) in GPU_SHAPES.items():
        x = torch.randn(300, k, device="cuda", dtype=torch.bfloat16)
        for scheme in SCHEMES:
            wq, ws, ins, bias = _gpu_weight(n, k, scheme, seed=2)
            first = None
            for cfg in _configs():
                for variant in (cfg, f8.Fp8GemmConfig(cfg.bm, cfg.bn, cfg.num_warps, 3, tma=False)):
                    y = f8.fp8_linear(x, wq, ws, scheme, ins, bias, torch.float32, variant)
                    first = y if first is None else first
                    assert torch.equal(y, first), (name, scheme, variant)


@gpu
@pytest.mark.gpu
def test_gpu_matches_the_reference_and_quantizes_like_the_spec() -> None:
    """The quantization's bits are the spec's; the GEMM equals the block sum with cuBLAS's
    block dots (tests/support/fp8_block_dots.py) within its fp32 roundings, for fp32, bf16 and fp16
    outputs; that reference is within 2**-6 of the products' magnitude of the exact float64
    one (a gross check of the reference itself). The exact reference's error is printed."""
    errors = {}
    for name, (n, k) in GPU_SHAPES.items():
        for dtype in (torch.bfloat16, torch.float16):
            x = (torch.randn(64, k, device="cuda") * 3).to(dtype)
            for scheme in SCHEMES:
                wq, ws, ins, bias = _gpu_weight(n, k, scheme, seed=3)
                q, sx = f8.quantize_activation(x, scheme, ins)
                if scheme == "tensor":
                    want_q = spec.quantize_static(x.cpu(), ins.cpu())
                else:
                    want_q, want_s = spec.quantize_rows(x.cpu(), 128 if scheme == "block" else k)
                    assert torch.equal(sx.cpu(), want_s), (name, scheme)
                assert torch.equal(_bits(q).cpu(), _bits(want_q)), (name, scheme)
                ref, size = block_dots_reference(x, wq, ws, scheme, ins, bias)
                for out in (torch.float32, dtype):
                    y = f8.fp8_linear(x, wq, ws, scheme, ins, bias, out_dtype=out)
                    excess = (y.double() - ref).abs() - tolerance(size, ref, k, out)
                    assert excess.max() <= 0, (name, scheme, dtype, out, excess.max().item())
                exact = spec.fp8_linear_reference(x, wq, ws, scheme, ins, bias)
                rel = float(((ref - exact).abs() / size).max())
                errors[(name, scheme, str(dtype)[6:])] = f"{rel:.2e}"
                assert rel < 2.0**-6, (name, scheme, rel)
    print("cuBLAS block dots vs exact, max |error| / magnitude:", errors)


@gpu
@pytest.mark.gpu
def test_gpu_cuda_graph_replay_equals_eager() -> None:
    """Quantization and GEMM captured in a CUDA graph: a replay on new inputs gives the eager
    bits, for a decode-sized and a prefill-sized call (different table rows)."""
    for m in (3, 300):
        for scheme in SCHEMES:
            n, k = GPU_SHAPES["qkv"]
            wq, ws, ins, bias = _gpu_weight(n, k, scheme, seed=4)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            f8.fp8_linear(x, wq, ws, scheme, ins, bias)  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = f8.fp8_linear(x, wq, ws, scheme, ins, bias)
            x.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, f8.fp8_linear(x, wq, ws, scheme, ins, bias)), (m, scheme)


@gpu
@pytest.mark.gpu
def test_gpu_controls_batch_scale_and_stock_path_vary_with_m() -> None:
    """Negative controls on the GPU: the reference mode's "block" path (dequantized bf16 operands
    through cuBLAS, `GpuStockOps.fp8_linear`) gives row 0 more than one set of bits over the M
    sweep on a Qwen3-8B shape, where our kernel gives one; and a batch-wide dynamic activation
    scale changes row 0 with its batch-mates. torch._scaled_mm's variants are printed: it kept
    one per shape at these M on the H200 (docs/results.md), so it is no control here."""
    variants = {}
    for name in ("o", "down"):
        n, k = GPU_SHAPES[name]
        wq, ws, _, _ = _gpu_weight(n, k, "block", seed=5)
        x = torch.randn(max(GPU_MS), k, device="cuda", dtype=torch.bfloat16)
        what = spec.dequantize_weight("block", wq, ws).to(torch.bfloat16)
        stock, ours, smm = set(), set(), set()
        q, sx = f8.quantize_activation(x, "channel")
        wq_c, ws_c, _, _ = _gpu_weight(n, k, "channel", seed=5)
        for m in GPU_MS:
            xhat = spec.dequantized_activation(x[:m], "block", None).to(torch.bfloat16)
            stock.add(_bits(torch.nn.functional.linear(xhat, what)[:1]).cpu().numpy().tobytes())
            ours.add(_bits(f8.fp8_linear(x[:m], wq, ws, "block")[:1]).cpu().numpy().tobytes())
            y = torch._scaled_mm(q[:m], wq_c.T, scale_a=sx[:m], scale_b=ws_c.view(1, n),
                                 out_dtype=torch.bfloat16)  # fmt: skip
            smm.add(_bits(y[:1]).cpu().numpy().tobytes())
        assert len(ours) == 1, name
        variants[name] = {"stock_block": len(stock), "scaled_mm_rowwise": len(smm)}
    print("row-0 variants over M:", variants)
    assert max(v["stock_block"] for v in variants.values()) > 1, variants

    n, k = GPU_SHAPES["o"]
    wq, ws, _, bias = _gpu_weight(n, k, "tensor", seed=6)
    x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    x[5] *= 40.0

    def batch_scaled(rows: torch.Tensor) -> torch.Tensor:
        scale = (rows.float().abs().amax() / spec.E4M3_MAX).reshape(())
        return f8.fp8_linear(rows, wq, ws, "tensor", scale, bias, out_dtype=torch.float32)

    assert not torch.equal(batch_scaled(x[:1]), batch_scaled(x)[:1])
