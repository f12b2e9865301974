"""Gemma 3 on the CPU: sliding-window layers interleaved with a global one, GeGLU, four norms per
layer, scaled embeddings, per-layer-type RoPE (lockstep/models/families/gemma3.py).

What every family shows (transformers within 1e-4 in both modes, random schedules, decode
versus scoring, preemption, bf16, a weight update, reference mode failing, `lockstep check
--serve`) and what every windowed family shows (the window control, radix hits whose uncached
tail straddles the window's edge, every chunk size around the window) is Gemma 3's row of
tests/contract/test_family_conformance.py. Here, what only Gemma 3 has, on a tiny
Gemma3ForCausalLM saved by transformers (its window of 8 keys shorter than every prompt):
the multimodal layouts, logit soft-capping, its refusals, and its cache's size.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.errors import ModelLoadError
from tests.support.tiny_hf import save_tiny

_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _engine(model: str, mode: str = "deterministic", **options) -> Engine:
    options = {"kv_tokens": 2048, "dtype": "float32", **options}
    return Engine(EngineConfig(model=model, mode=mode, device="cpu", **options))


# One torch thread for tiny shapes (tests/conftest.py): bits do not depend on the count.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    folder = tmp_path_factory.mktemp("gemma3")
    return folder, save_tiny("gemma3", folder)


@pytest.fixture(scope="module")
def gemma(hf_folder) -> Engine:
    return _engine(str(hf_folder[0]))


def _copy(folder: Path, to: Path, **config: object) -> Path:
    """`folder`'s files in `to`, with `config` keys replaced in its config.json."""
    for name in _FILES:
        (to / name).write_bytes((folder / name).read_bytes())
    changed = {**json.loads((folder / "config.json").read_text()), **config}
    (to / "config.json").write_text(json.dumps(changed))
    return to


# ---------------------------------------------------------------- Gemma 3's own layouts


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_multimodal_checkpoint_serves_its_text_model(
    tmp_path: Path, hf_folder, gemma: Engine, prefix: str
) -> None:
    """A Gemma3ForConditionalGeneration folder (model_type gemma3, text_config, the text
    tensors under transformers 5's or earlier writers' prefix, a vision tower and projector)
    loads as the text model and gives its bits."""
    from safetensors.torch import load_file, save_file

    folder, _ = hf_folder
    text = json.loads((folder / "config.json").read_text())
    config = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
              "text_config": text, "vision_config": {"model_type": "siglip_vision_model"}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {prefix + k.removeprefix("model."): v
               for k, v in load_file(folder / "model.safetensors").items()}  # fmt: skip
    vision = "model." if prefix.startswith("model.") else ""
    tensors[vision + "vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(4)
    tensors[vision + "multi_modal_projector.mm_input_projection_weight"] = torch.zeros(4, 4)
    save_file(tensors, tmp_path / "model.safetensors")
    for name in _FILES[2:]:
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    tokens = list(range(1, 30))
    want = gemma.decoder.logits_for_sequence(tokens)
    assert torch.equal(_engine(str(tmp_path)).decoder.logits_for_sequence(tokens), want)


def test_final_logit_softcapping_matches_transformers(tmp_path: Path, gemma: Engine) -> None:
    """final_logit_softcapping (set by no released Gemma 3, served all the same): a cap of 3
    matches transformers within 1e-4; control: the same weights uncapped give other logits."""
    model = save_tiny("gemma3", tmp_path, final_logit_softcapping=3.0)
    tokens = list(range(1, 30))
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0]
    got = _engine(str(tmp_path)).decoder.logits_for_sequence(tokens)
    assert (got - want).abs().max() < 1e-4, float((got - want).abs().max())
    assert (got - gemma.decoder.logits_for_sequence(tokens)).abs().max() > 0.1


@pytest.mark.parametrize(
    ("key", "value"),
    [("attn_logit_softcapping", 50.0), ("hidden_activation", "silu"),
     ("use_bidirectional_attention", True)],
)  # fmt: skip
def test_what_gemma_3_does_not_need_is_refused_in_one_line(
    hf_folder, tmp_path: Path, key: str, value: object
) -> None:
    folder, _ = hf_folder
    with pytest.raises(ModelLoadError) as err:
        _engine(str(_copy(folder, tmp_path, **{key: value})))
    message = str(err.value)
    assert "\n" not in message and f"{key}={value!r} is not supported" in message


# ---------------------------------------------------------------- the cache


def test_cache_bytes_per_token_are_the_blocks_sum() -> None:
    """Each mixer block declares its cache bytes (`Mixer.cache_bytes`) and the pool's budget
    sums them: Gemma 3's sliding layers keep every key, so random:gemma3-4b costs K and V of
    34 layers x 4 KV heads x 256 in bf16 per token, half that in e4m3; a hybrid's per token is
    its attention layers' K/V alone, its snapshots (their own pool) the size its state layout
    counts."""
    from lockstep.engine.memory import bytes_per_token, snapshot_bytes
    from lockstep.models.linear_attention import LinearLayout
    from lockstep.models.presets import PRESETS

    gemma = PRESETS["gemma3-4b"].spec
    assert bytes_per_token(gemma, 4, torch.bfloat16) == 2 * 34 * 4 * 256 * 2 == 139264
    assert bytes_per_token(gemma, 4, torch.float8_e4m3fn) == 139264 // 2
    assert snapshot_bytes(gemma) == 0
    hybrid = PRESETS["qwen3.5-9b"].spec
    layout = LinearLayout.of(hybrid, torch.device("cpu"))
    assert bytes_per_token(hybrid, 4, torch.bfloat16) == 2 * len(hybrid.kv_layers) * 4 * 256 * 2
    assert snapshot_bytes(hybrid) == layout.snapshot_bytes
