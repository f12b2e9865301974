"""FP8 checkpoint formats on the GPU (bfloat16 activations): the tiny folders of the CPU suites
(tests/support/tiny_fp8.py, tiny_fp8_kv.py) with the checkpoints' static KV cache scales and
with per-channel and per-tensor FP8 experts, through the deterministic Triton backend: random
schedules (batch-mates, prefix hits, chunks, decode steps, eager and CUDA-graph decode) give
the bits of one cold prefill, the logits stay near the float64 emulation, and reference mode fails
the property (the control). Runs only where CUDA is present; CI runs the same checks on the
CPU (test_fp8_kv_scales.py, test_fp8_moe.py) and the kernels under the interpreter."""

from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path

import pytest
import torch

from tests.support.invariance_harness import compute, mismatches, random_plan, reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("transformers")

CASES = int(os.environ.get("LOCKSTEP_GPU_CASES", "30"))


def _engine(model: str, mode: str = "deterministic", **options):
    from lockstep.config import EngineConfig
    from lockstep.engine.engine import Engine

    settings = dict(model=model, mode=mode, device="cuda", dtype="bfloat16", kv_tokens=32768,
                    max_model_len=512, cuda_graphs=False) | options  # fmt: skip
    return Engine(EngineConfig(**settings))


def _failures(engine, cases: int, wide_mates: bool = False) -> list[str]:
    out = []
    for seed in range(cases):
        rng = random.Random(seed)
        n = rng.randint(1, 200)
        tokens = [rng.randrange(engine.decoder.spec.vocab_size) for _ in range(n)]
        plan = random_plan(rng, n, max_mates=4, allow_prefix=not wide_mates)
        if wide_mates:
            plan.mates_per_step = [[rng.randint(8, 64) for _ in range(4)] for _ in plan.chunks]
        problems = mismatches(reference(engine, tokens), compute(engine, tokens, plan, rng))
        if problems:
            out.append(f"seed={seed} n={n} {plan.describe()}: " + "; ".join(problems[:2]))
    engine.check_integrity()
    return out


@pytest.fixture(scope="module", params=["modelopt", "compressed-tensors"])
def kv_folder(request, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    from tests.support.tiny_fp8_kv import write_kv_scaled_folder

    path = tmp_path_factory.mktemp(f"gpu-kv-{request.param}")
    model, scales = write_kv_scaled_folder(path, request.param)
    return path, model, scales, request.param


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_kv_scaled_cache_random_schedules_match_cold_prefill(kv_folder, cuda_graphs: bool):
    engine = _engine(str(kv_folder[0]), kv_dtype="fp8_e4m3", cuda_graphs=cuda_graphs)
    assert engine.decoder.layers[0].mixer.kv_scales != (1.0, 1.0)
    failures = _failures(engine, CASES)
    assert not failures, "; ".join(failures)


def test_kv_scaled_cache_logits_are_near_the_float64_emulation(kv_folder) -> None:
    """bf16 activations against the float64 emulation of the scaled FP8 cache, judged against
    the bf16 floor of the same model (tests/support/kv_scale_accuracy.py says why a fixed
    fraction of the unscaled error cannot judge it); the control: the same folder at scale
    1.0 is beyond the floor. The interpreter runs the same check in CI
    (tests/kernels/test_kv_scales_logits_triton.py)."""

    from lockstep.models.decoder import Decoder
    from lockstep.models.resolver import resolve_model
    from lockstep.ops import get_ops
    from tests.support.kv_scale_accuracy import kv_scale_errors, prompts

    path, model, scales, fmt = kv_folder
    loaded = resolve_model(str(path))
    ops = get_ops("cuda", "deterministic")

    def load(spec, kv_dtype: torch.dtype) -> Decoder:
        return Decoder.load(dataclasses.replace(loaded, spec=spec), ops, torch.bfloat16, "cuda",
                            kv_dtype=kv_dtype)  # fmt: skip

    kv_scale_errors(load, loaded, model, path, fmt, scales, prompts(6)).check()


def test_negative_control_fast_mode_breaks_the_kv_scaled_suite(kv_folder) -> None:
    engine = _engine(str(kv_folder[0]), mode="reference", kv_dtype="fp8_e4m3")
    assert _failures(engine, 10, wide_mates=True), "reference mode matched every schedule"


@pytest.fixture(scope="module", params=["modelopt", "compressed-tensors"])
def moe_folder(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.tiny_fp8 import write_fp8_folder

    path = tmp_path_factory.mktemp(f"gpu-moe-{request.param}")
    write_fp8_folder(path, request.param, family="qwen3_moe")
    return path


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_row_scaled_fp8_moe_random_schedules_match_cold_prefill(moe_folder, kv_dtype: str):
    """Per-tensor and per-channel FP8 experts on the grouped Triton FP8 GEMM."""
    engine = _engine(str(moe_folder), kv_dtype=kv_dtype)
    assert engine.decoder.layers[0].mlp.layer.fp8_scheme in ("tensor", "channel")
    failures = _failures(engine, CASES)
    assert not failures, "; ".join(failures)


def test_negative_control_fast_mode_breaks_row_scaled_fp8_moe(moe_folder) -> None:
    assert _failures(_engine(str(moe_folder), mode="reference"), 10, wide_mates=True)


@pytest.fixture(scope="module", params=["-fp8-static", "-fp8-channel"])
def small_30b_row_scaled(request):
    """`random:qwen3-30b-a3b-fp8-static` / `-fp8-channel` cut to 2 sparse layers: the real
    expert shapes (128 experts of 768 on hidden 2048, top 8) in each new scheme."""
    from lockstep.models.presets import PRESETS

    name = "qwen3-30b-a3b-2l" + request.param
    full = PRESETS["qwen3-30b-a3b" + request.param]
    moe = dataclasses.replace(full.spec.moe, sparse_layers=(0, 1))
    PRESETS[name] = dataclasses.replace(
        full, spec=dataclasses.replace(full.spec, num_layers=2, moe=moe)
    )
    yield "random:" + name
    del PRESETS[name]


def test_row_scaled_fp8_moe_at_30b_shapes_matches_cold_prefill(small_30b_row_scaled) -> None:
    engine = _engine(small_30b_row_scaled, kv_dtype="fp8_e4m3", max_model_len=4096)
    failures = _failures(engine, CASES)
    assert not failures, "; ".join(failures)
