"""FP8 on the GPU (bfloat16 activations): the deterministic backend's FP8 linear against the
spec's block sum (with cuBLAS's block dots: tests/support/fp8_block_dots.py) and across M, and the
property suite on the FP8 presets with the FP8 KV cache off and on. Runs only where CUDA is present; CI runs the same properties on the CPU
(test_fp8_invariance.py) and the KV kernels under the interpreter (test_kv_fp8_triton.py).
The kernel's own sweep (every M 1-8192, strides, CUDA graphs) is in its test file."""

from __future__ import annotations

import os
import random

import pytest
import torch

from lockstep.ops import fp8
from tests.support.fp8_block_dots import block_dots_reference, tolerance
from tests.support.invariance_harness import compute, mismatches, random_plan, reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CASES = int(os.environ.get("LOCKSTEP_GPU_CASES", "30"))
# Qwen3-8B projections (N, K): fused qkv, o, fused gate_up, down; and a K with a partial block.
SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (256, 80)]
M_SWEEP = [1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000]


def _weight(n: int, k: int, scheme: str, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, generator=g, device="cuda") / k**0.5
    q, scale, input_scale = fp8.quantize_weight(w, scheme)
    return q, scale, None if input_scale is None else input_scale.cuda()


@pytest.mark.parametrize("scheme", fp8.SCHEMES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_fp8_linear_matches_spec_and_is_m_invariant(scheme: str, n: int, k: int) -> None:
    from lockstep.ops.gpu_deterministic import GpuDeterministicOps

    ops = GpuDeterministicOps()
    q, scale, input_scale = _weight(n, k, scheme, seed=n + k)
    w = ops.prepare_fp8_linear(scheme, q, scale, input_scale)
    bias = torch.randn(n, device="cuda") * 0.1
    x = torch.randn(max(M_SWEEP), k, device="cuda", dtype=torch.bfloat16)
    full = ops.fp8_linear(x, w, bias)
    ref, size = block_dots_reference(x, q, scale, scheme, input_scale, bias)
    assert ((full.double() - ref).abs() <= tolerance(size, ref, k, x.dtype)).all()
    for m in M_SWEEP:
        assert torch.equal(ops.fp8_linear(x[:m], w, bias), full[:m]), m
        assert torch.equal(ops.fp8_linear(x[m - 1 : m], w, bias), full[m - 1 : m]), m


def _engine(model: str, mode: str = "deterministic", **options):
    from lockstep.config import EngineConfig
    from lockstep.engine.engine import Engine

    return Engine(EngineConfig(model=model, mode=mode, device="cuda", dtype="bfloat16",
                               kv_tokens=32768, max_model_len=8192, cuda_graphs=False,
                               **options))  # fmt: skip


@pytest.mark.parametrize(
    ("model", "kv_dtype"),
    [("random:qwen3-8b-fp8", "auto"), ("random:qwen3-8b-fp8", "fp8_e4m3"),
     ("random:qwen3-8b-fp8-static", "fp8_e4m3"), ("random:qwen3-8b", "fp8_e4m3")],
)  # fmt: skip
def test_fp8_random_schedules_match_cold_prefill(model: str, kv_dtype: str) -> None:
    engine = _engine(model, kv_dtype=kv_dtype)
    for seed in range(CASES):
        rng = random.Random(seed)
        n = rng.randint(1, 700)
        tokens = [rng.randrange(engine.decoder.spec.vocab_size) for _ in range(n)]
        plan = random_plan(rng, n, max_mates=4)
        problems = mismatches(reference(engine, tokens), compute(engine, tokens, plan, rng))
        assert not problems, f"seed={seed} n={n} {plan.describe()}: " + "; ".join(problems)
    engine.check_integrity()


def test_negative_control_reference_fp8_breaks_batch_invariance() -> None:
    engine = _engine("random:qwen3-8b-fp8-static", mode="reference")
    failures = 0
    for seed in range(10):
        rng = random.Random(seed)
        n = rng.randint(16, 200)
        tokens = [rng.randrange(engine.decoder.spec.vocab_size) for _ in range(n)]
        plan = random_plan(rng, n, max_mates=4, allow_prefix=False)
        plan.mates_per_step = [[rng.randint(8, 64) for _ in range(4)] for _ in plan.chunks]
        failures += bool(mismatches(reference(engine, tokens), compute(engine, tokens, plan, rng)))
    assert failures > 0
