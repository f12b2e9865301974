"""DeepSeek-V3's block-FP8 format on CUDA, through the engine: `random:tiny-deepseek-v3-fp8`
(MLA's q_a | kv_a, q_b and o, the dense and shared MLPs and the routed experts in FP8,
kv_b_proj dequantized at load; the Triton FP8 GEMM and FP8 MoE kernels) and
`random:deepseek-v2-lite-fp8` (DeepSeek-V2-Lite's shapes, 64 experts of width 1408), bf16:

  * what loads: e4m3 weights on the device, the absorbed kv_b in bf16, the router unquantized;
  * random schedules (batch-mates, chunks, prefix hits, decode steps) equal a cold prefill
    bit for bit, with the bf16 and the FP8 latent cache; reference mode must fail the same check;
  * sampled generations' logprobs equal scoring the generated text (decode vs rescoring),
    with CUDA graphs and eagerly.

Each test builds its own engines and frees them after it (27 FP8 layers of V2-Lite each). The
CPU twin of these checks, with the float64 emulation, is tests/contract/test_deepseek_fp8.py.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from tests.support.invariance_harness import generation_scoring_mismatches, schedule_failures

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CASES = int(os.environ.get("LOCKSTEP_GPU_CASES", "12"))
MODELS = ["random:tiny-deepseek-v3-fp8", "random:deepseek-v2-lite-fp8"]


@pytest.fixture(autouse=True)
def _free_engines():
    """Engines of a test are garbage once it ends: collect them before the next test builds
    its own, so two V2-Lite copies never share the GPU."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _engine(model: str, mode: str = "deterministic", **options):
    from lockstep.config import EngineConfig
    from lockstep.engine.engine import Engine

    settings = dict(model=model, mode=mode, device="cuda", dtype="bfloat16", kv_tokens=32768,
                    max_model_len=4096, cuda_graphs=False) | options  # fmt: skip
    return Engine(EngineConfig(**settings))


@pytest.fixture(scope="module", params=MODELS)
def model(request) -> str:
    return request.param


def test_what_loads_in_fp8(model) -> None:
    from lockstep.ops.fp8 import Fp8Weight

    decoder = _engine(model).decoder
    sparse = decoder.spec.moe.sparse_layers[0]
    attn, mlp = decoder.layers[sparse].mixer, decoder.layers[sparse].mlp
    for linear in (attn.a, attn.o, mlp.shared_gate_up, mlp.shared_down):
        assert isinstance(linear, Fp8Weight) and linear.weight.dtype == torch.float8_e4m3fn
    assert attn.w_uk.dtype == attn.w_uv.dtype == torch.bfloat16
    assert mlp.layer.fp8 and mlp.router.dtype != torch.float8_e4m3fn


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_random_schedules_match_cold_prefill(model, kv_dtype: str) -> None:
    failures = schedule_failures(_engine(model, kv_dtype=kv_dtype), CASES)
    assert not failures, "; ".join(failures)


def test_negative_control_reference_mode_fails_the_property(model) -> None:
    failures = schedule_failures(_engine(model, mode="reference"), CASES, wide_mates=True)
    assert failures, "reference mode matched every schedule: the property lost its teeth"


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_generation_logprobs_equal_scoring(model, cuda_graphs: bool) -> None:
    """Sampled generations of 3 prompts side by side: their logprobs equal scoring the
    prompt + generated text in one prefill, bit for bit."""
    from lockstep.engine.sampling_params import SamplingParams

    engine = _engine(model, cuda_graphs=cuda_graphs, max_running=16)
    prompts = [list(range(5, 5 + n)) for n in (3, 40, 300)]
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
    assert not generation_scoring_mismatches(engine, prompts, params)
