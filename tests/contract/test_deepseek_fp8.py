"""DeepSeek-V3's own block-FP8 checkpoints on the CPU: a tiny DeepseekV3ForCausalLM written by
transformers (a q LoRA, sigmoid routing within the best 2 of 4 expert groups, a non-zero
correction bias, YaRN, interleaved RoPE dims, a dense first layer, one shared expert) and
quantized as DeepSeek-V3's release is (tests/support/tiny_fp8.py: e4m3 weights with
`weight_scale_inv` per 128 x 128 block, its quantization_config), with widths the blocks tile.

It loads with MLA's q_a | kv_a, q_b and o, the dense MLP, the shared expert and the routed
experts in FP8 and kv_b_proj dequantized; its logprobs equal a float64 emulation of that
arithmetic (transformers' model with each projection replaced by an emulation written in the
test support, not with Lockstep's code) within 1e-5, which the unquantized model and the
folder with swapped kv_b scales miss. It keeps the contract (random schedules equal one cold
prefill, decode equals scoring) with a bf16 cache and an FP8 latent cache; reference mode fails the
same checks. The multi-token-prediction layer's FP8 tensors are skipped; what cannot run is
refused in one line.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

from safetensors.torch import load_file  # noqa: E402

from lockstep.config import EngineConfig  # noqa: E402
from lockstep.engine.engine import Engine  # noqa: E402
from lockstep.engine.sampling_params import SamplingParams  # noqa: E402
from lockstep.errors import ModelLoadError  # noqa: E402
from lockstep.models.decoder import Decoder  # noqa: E402
from lockstep.models.presets import PRESETS, RandomWeights  # noqa: E402
from lockstep.models.resolver import resolve_model  # noqa: E402
from lockstep.ops import get_ops  # noqa: E402
from lockstep.ops.fp8 import Fp8Weight  # noqa: E402
from tests.support.invariance_harness import (  # noqa: E402
    generation_scoring_mismatches,
    schedule_failures,
)
from tests.support.tiny_fp8 import (  # noqa: E402
    edit_tensors,
    float64_reference,
    set_quantization_config,
    write_fp8_folder,
)
from tests.support.tiny_hf import check_serve_passes_every_scenario  # noqa: E402

VOCAB = 300  # the tiny folder's
TOKENS = [5, 17, 200, 33, 91, 7, 150, 64, 2, 250, 11, 99, 42, 8, 120, 77, 3, 260, 19, 54]
TOLERANCE = 1e-5  # float32 engine vs float64 emulation, on logprobs (measured ~1e-6)
ATTN = "model.layers.1.self_attn."


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp("deepseek-fp8")
    model = write_fp8_folder(path, "fp8-block", family="deepseek_v3")
    return path, model


@pytest.fixture(scope="module")
def references(folder) -> dict[str, torch.Tensor]:
    """Logprobs of TOKENS in float64: "plain", the unquantized model; "emulation", the FP8
    emulation (`float64_reference` turns the model into it in place, so plain comes first)."""
    path, model = folder
    model.config._experts_implementation = "eager"  # torch's grouped_mm takes no float64
    tokens = torch.tensor([TOKENS])
    with torch.no_grad():
        plain = model.to(torch.float64)(tokens).logits[0]
        emulation = float64_reference(model, path, "fp8-block")(tokens).logits[0]
    return {"plain": torch.log_softmax(plain, -1), "emulation": torch.log_softmax(emulation, -1)}


@pytest.fixture(scope="module")
def want(references) -> torch.Tensor:
    return references["emulation"]


def _logprobs(path: Path, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    decoder = Decoder.load(resolve_model(str(path)), get_ops("cpu", "deterministic"), dtype, "cpu")
    return torch.log_softmax(decoder.logits_for_sequence(TOKENS).double(), -1)


def _copy(folder: Path, to: Path) -> Path:
    return Path(shutil.copytree(folder, to))


def _engine(model: str | Path, mode: str = "deterministic", **options) -> Engine:
    options = {"kv_tokens": 2048, "dtype": "float32", **options}
    return Engine(EngineConfig(model=str(model), mode=mode, device="cpu", **options))


# ---------------------------------------------------------------- what loads, and its values


def test_loads_the_release_format_with_fp8_projections(folder) -> None:
    """What runs in FP8 (the fused q_a | kv_a with 1 + 2 row blocks over 2 K blocks, q_b, o,
    the dense and shared MLPs, the experts) and what does not (kv_b dequantized into the
    absorbed per-head matrices, the router, the correction bias)."""
    path, _ = folder
    loaded = resolve_model(str(path))
    assert loaded.spec.fp8 is not None and loaded.spec.fp8.scheme == "block"
    decoder = Decoder.load(loaded, get_ops("cpu", "deterministic"), torch.float32, "cpu")
    attn, dense, sparse = decoder.layers[1].mixer, decoder.layers[0].mlp, decoder.layers[1].mlp
    for linear in (attn.a, attn.q_b, attn.o, dense.gate_up, dense.down, sparse.shared_gate_up,
                   sparse.shared_down):  # fmt: skip
        assert isinstance(linear, Fp8Weight), linear
    assert tuple(attn.a.weight_scale.shape) == (3, 2)  # q_a 128 rows | kv_a 128 + 64 rows
    assert attn.w_uk.dtype == attn.w_uv.dtype == torch.float32  # dequantized kv_b
    assert sparse.layer.fp8 and sparse.router.dtype == torch.float32
    assert sparse.correction_bias is not None and sparse.correction_bias.abs().sum() > 0


def test_logprobs_match_the_float64_emulation(folder, references) -> None:
    """Within TOLERANCE in float32; the unquantized model (the control) misses by far more."""
    got = _logprobs(folder[0])
    assert (got - references["emulation"]).abs().max().item() <= TOLERANCE
    assert (got - references["plain"]).abs().max().item() > 1e-3


def test_negative_control_swapped_kv_b_scales_miss(folder, want, tmp_path: Path) -> None:
    """kv_b's two row blocks' scales swapped in one layer (the weights as they are): the
    logprobs leave the emulation's tolerance, so the comparison sees kv_b's dequantization."""
    path = _copy(folder[0], tmp_path / "swapped")
    scale = load_file(path / "model.safetensors")[ATTN + "kv_b_proj.weight_scale_inv"]
    assert scale.shape[0] == 2 and not torch.equal(scale[0], scale[1])
    edit_tensors(path, **{(ATTN + "kv_b_proj.weight_scale_inv").replace(".", "/"): scale.flip(0)})
    assert (_logprobs(path) - want).abs().max().item() > 1e-3


# ---------------------------------------------------------------- position invariance


@pytest.mark.parametrize(
    ("dtype", "kv_dtype", "cache"),
    [("bfloat16", "auto", torch.bfloat16), ("float32", "fp8_e4m3", torch.float8_e4m3fn)],
)  # fmt: skip
def test_any_schedule_matches_cold_prefill(
    folder, dtype: str, kv_dtype: str, cache: torch.dtype
) -> None:
    """Random schedules with batch-mates and radix hits equal one cold prefill bitwise, with
    the bf16 latent cache (a bf16 engine) and the FP8 one; generation's logprobs equal
    scoring the generated text."""
    engine = _engine(folder[0], dtype=dtype, kv_dtype=kv_dtype)
    assert engine.pool.k_cache(0).dtype == cache
    failures = schedule_failures(engine, 8, lengths=(8, 48), max_mates=3)
    assert not failures, failures
    rng = random.Random(2)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 37)]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    assert not generation_scoring_mismatches(engine, prompts, params)
    engine.check_integrity()


def test_negative_control_reference_mode_breaks_the_contract(folder) -> None:
    """The same schedules in reference mode (dequantized oneDNN GEMMs, SDPA, transformers'
    routing) differ from the cold prefill: the check is not blind."""
    assert schedule_failures(_engine(folder[0], mode="reference"), 8, lengths=(8, 48), max_mates=3)


def test_random_preset_runs_in_fp8() -> None:
    """random:tiny-deepseek-v3-fp8 (the GPU tests' model) quantizes the MLA projections and
    experts, not the router or the correction bias, and loads."""
    spec = PRESETS["tiny-deepseek-v3-fp8"].spec
    assert spec.is_fp8_linear("model.layers.1.self_attn.kv_b_proj")
    assert spec.is_fp8_linear("model.layers.1.mlp.shared_experts.up_proj")
    assert not spec.is_fp8_linear("model.layers.1.mlp.gate")
    assert PRESETS["deepseek-v3-fp8"].spec.is_fp8_linear("model.layers.5.self_attn.q_a_proj")
    engine = _engine("random:tiny-deepseek-v3-fp8")
    assert isinstance(engine.decoder.layers[1].mixer.q_b, Fp8Weight)
    assert torch.isfinite(engine.decoder.logits_for_sequence(TOKENS)).all()


@pytest.mark.slow
def test_lockstep_check_serve_passes_every_scenario(tmp_path: Path) -> None:
    """`lockstep check --serve --model <tiny FP8 DeepSeek-V3 folder>` passes every scenario."""

    def write(family: str, folder: Path, **overrides) -> None:
        write_fp8_folder(folder, "fp8-block", family=family, **overrides)

    check_serve_passes_every_scenario("deepseek_v3", tmp_path, write)


# ---------------------------------------------------------------- skipped and refused


def _mtp_tensors(layer: int) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's multi-token-prediction tensors at `layer`, FP8 ones with their scales:
    eh_proj (no decoder projection), an expert, and (as an FP8 tensor Lockstep would refuse
    inside the model) the router."""
    p = f"model/layers/{layer}/"

    def e4m3() -> torch.Tensor:
        return torch.full((128, 256), 0.5).to(torch.float8_e4m3fn)

    return {
        p + "eh_proj/weight": e4m3(), p + "eh_proj/weight_scale_inv": torch.ones(1, 2),
        p + "mlp/experts/0/up_proj/weight": e4m3(),
        p + "mlp/experts/0/up_proj/weight_scale_inv": torch.ones(1, 2),
        p + "mlp/gate/weight": torch.full((8, 256), 0.5).to(torch.float8_e4m3fn),
        p + "shared_head/head/weight": torch.zeros(VOCAB, 256),
    }  # fmt: skip


def test_multi_token_prediction_layer_is_skipped_before_fp8_checks(
    folder, want, tmp_path: Path
) -> None:
    """The FP8 tensors of layer num_hidden_layers (DeepSeek-V3's model.layers.61) are not
    loaded and not checked: the logprobs are the folder's. The control: one of them, the FP8
    router, inside the model (layer 1) is refused, so only the skip lets them load."""
    path = _copy(folder[0], tmp_path / "mtp")
    edit_tensors(path, **_mtp_tensors(2))
    assert torch.equal(_logprobs(path), _logprobs(folder[0]))
    router = {"model/layers/1/mlp/gate/weight": _mtp_tensors(2)["model/layers/2/mlp/gate/weight"]}
    edit_tensors(path, **router)
    with pytest.raises(ModelLoadError, match="a MoE router, which must stay unquantized"):
        resolve_model(str(path))


def _refusal(call) -> str:
    with pytest.raises(ModelLoadError) as err:
        call()
    message = str(err.value)
    assert "\n" not in message
    return message


def test_unsupported_block_size_and_static_activations_are_refused(folder, tmp_path) -> None:
    path = _copy(folder[0], tmp_path / "config")
    set_quantization_config(path, weight_block_size=[64, 64])
    assert "weight_block_size=[64, 64] is not supported; supported: [128, 128]" in _refusal(
        lambda: resolve_model(str(path))
    )
    set_quantization_config(path, weight_block_size=[128, 128], activation_scheme="static")
    assert "activation_scheme='static' is not supported; block-wise FP8 is dynamic" in _refusal(
        lambda: resolve_model(str(path))
    )


def test_missing_kv_b_scale_is_refused(folder, tmp_path: Path) -> None:
    path = _copy(folder[0], tmp_path / "no-scale")
    edit_tensors(path, **{(ATTN + "kv_b_proj.weight_scale_inv").replace(".", "/"): None})
    message = _refusal(lambda: resolve_model(str(path)))
    assert f"tensor {ATTN}kv_b_proj.weight_scale_inv is missing" in message


def _load_random(spec) -> None:
    """Decoder.load of random weights quantized for `spec` (a variation of a preset's)."""
    loaded = resolve_model("random:tiny-deepseek-v3-fp8")
    loaded = dataclasses.replace(loaded, spec=spec, weights=RandomWeights(spec, 0))
    Decoder.load(loaded, get_ops("cpu", "deterministic"), torch.float32, "cpu")


def test_rope_rows_crossing_a_scale_block_are_refused() -> None:
    """With 96 no-RoPE dims a head's 64 RoPE rows (96..159) cross row 128: reordering the
    interleaved dims would move rows off their block's scale. Without rope_interleave nothing
    moves, and the same shapes load (the control)."""
    spec = PRESETS["tiny-deepseek-v3-fp8"].spec
    assert spec.mla is not None
    mla = dataclasses.replace(spec.mla, qk_nope_head_dim=96)
    message = _refusal(lambda: _load_random(dataclasses.replace(spec, mla=mla)))
    assert "q_b_proj.weight: its interleaved RoPE rows cross a 128-row FP8 scale block" in message
    flat = dataclasses.replace(mla, rope_interleave=False)
    _load_random(dataclasses.replace(spec, mla=flat))


def test_uneven_fused_rows_are_refused() -> None:
    """tiny-deepseek-v3's q LoRA of 48 rows cannot fuse with kv_a by 128-row scale blocks."""
    spec = dataclasses.replace(PRESETS["tiny-deepseek-v3"].spec, fp8=PRESETS[
        "tiny-deepseek-v3-fp8"].spec.fp8)  # fmt: skip
    message = _refusal(lambda: _load_random(spec))
    assert "q_a_proj.weight has 48 rows, not a multiple of 128" in message
