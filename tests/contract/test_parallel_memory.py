"""The models larger than one GPU: what each rank needs, and the settings that are refused.

* random:qwen3-235b-a22b and random:deepseek-v3-fp8 (real shapes) are refused on one H200
  (139 GiB free) with the arithmetic; the Qwen model names the smallest degree that fits, the
  DeepSeek one too, or on CUDA why it cannot be split yet (its FP8 weights). Controls: the degree named fits, and the per-rank
  arithmetic is checked against the parameters counted by hand.
* A tensor-parallel degree that does not divide the heads, an expert-parallel one that does
  not divide the experts: one line each, before any process starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lockstep import LLM
from lockstep.engine.engine import FP8_CUDA_TP
from lockstep.engine.memory import GIB, RankWeights, refuse_oversized_weights
from lockstep.errors import ConfigError
from lockstep.models.presets import PRESETS
from tests.support.tiny_hf import save_tiny

H200 = int(139 * GIB)


def _refusal(name: str, tp: int, ep: int = 1, dtype_bytes: int = 2) -> str:
    with pytest.raises(ConfigError) as info:
        refuse_oversized_weights(f"random:{name}", PRESETS[name].spec, dtype_bytes, tp, H200, ep)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_qwen3_235b_is_refused_below_the_degree_that_fits() -> None:
    spec = PRESETS["qwen3-235b-a22b"].spec
    assert round(spec.num_parameters / 1e9, 2) == 235.09
    assert spec.moe is not None and spec.moe.num_experts == 128
    one = _refusal("qwen3-235b-a22b", 1)
    assert "437.9 GiB per GPU (235.09 B parameters x 2 bytes / tp=1)" in one
    assert "139.0 GiB free; --tp 4 fits" in one
    two = _refusal("qwen3-235b-a22b", 2, ep=2)
    assert "per GPU (235.09 B parameters x 2 bytes: 235.04 B of them / tp=2, ep=2" in two
    assert "--tp 4 --ep 4 fits" in two
    # Controls: the degrees named fit.
    refuse_oversized_weights("random:qwen3-235b-a22b", spec, 2, 4, H200)
    refuse_oversized_weights("random:qwen3-235b-a22b", spec, 2, 8, H200, 8)


def test_rank_weights_arithmetic() -> None:
    """Experts, norms and routers counted by hand from Qwen3-235B-A22B's shapes."""
    spec = PRESETS["qwen3-235b-a22b"].spec
    need = RankWeights.of(spec, 2, 8, 8)
    h, layers = 4096, 94
    assert need.experts == layers * 128 * 3 * h * 1536
    assert need.replicated == layers * 128 * h + layers * 2 * h + h
    assert need.experts + need.sharded + need.replicated == spec.num_parameters
    expected = ((spec.num_parameters - need.replicated) / 8 + need.replicated) * 2
    assert need.bytes == expected
    assert need.describe().startswith(f"{expected / GIB:.1f} GiB per GPU")


def test_deepseek_v3_fp8_is_refused_on_one_gpu_with_why() -> None:
    message = _refusal("deepseek-v3-fp8", 1)
    assert "624.9 GiB per GPU (671.03 B parameters x 1 bytes / tp=1)" in message
    assert "--tp 8 fits (degrees that work: 1, 2, 4, 8)" in message
    # On CUDA its FP8 weights do not shard yet: the engine passes that reason.
    spec = PRESETS["deepseek-v3-fp8"].spec
    with pytest.raises(ConfigError, match="cannot be split over more GPUs: FP8 models shard"):
        refuse_oversized_weights("random:deepseek-v3-fp8", spec, 2, 1, H200, 1, FP8_CUDA_TP)
    # TP 8 / EP 8: a lower bound of 78 GiB a GPU, which fits.
    plan = RankWeights.of(spec, 2, 8, 8)
    assert 78 < plan.bytes / GIB < 79
    refuse_oversized_weights("random:deepseek-v3-fp8", spec, 2, 8, H200, 8)


@pytest.fixture(scope="module")
def six_experts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("six_experts")
    save_tiny("qwen3_moe", folder, num_experts=6, num_hidden_layers=2, mlp_only_layers=[])
    return folder


@pytest.mark.parametrize(
    ("model", "options", "message"),
    [
        ("random:qwen3-235b-a22b", {"tp": 3},
         "tp=3 is invalid for random:qwen3-235b-a22b (64 heads, 4 KV heads): it does not divide "
         "the 64 attention heads; degrees that work: 1, 2, 4, 8"),
        ("six_experts", {"tp": 4, "ep": 4},
         "ep=4 is invalid for {folder}: it does not divide the 6 routed experts; expected ep=1 "
         "or ep=2 (with --tp the same)"),
    ],
)  # fmt: skip
def test_degrees_that_do_not_divide_are_refused_in_one_line(
    model: str, options: dict, message: str, six_experts: Path
) -> None:
    if model == "six_experts":
        model = str(six_experts)
        message = message.format(folder=six_experts.name)
    with pytest.raises(ConfigError) as info:
        LLM(model, device="cpu", kv_tokens=64, **options)
    assert str(info.value) == message
