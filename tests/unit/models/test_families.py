"""The family registry (lockstep/models/families): a config finds its family by model_type or,
without one, by its architectures; anything else is refused in one line naming the supported
model types."""

from __future__ import annotations

import pytest

from lockstep.errors import ModelLoadError
from lockstep.models.families import SUPPORTED_MODEL_TYPES, family_of


def test_unknown_model_type_is_refused_in_one_line_listing_the_supported_ones() -> None:
    config = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"]}
    with pytest.raises(ModelLoadError) as err:
        family_of(config, "x/config.json")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("x/config.json: model_type 'gpt_oss' is not supported")
    assert ", ".join(SUPPORTED_MODEL_TYPES) in message and "GptOssForCausalLM" in message


@pytest.mark.parametrize(
    ("config", "family"),
    [
        ({"model_type": "qwen3_5"}, "qwen3_5"),
        ({"model_type": "qwen3_5_text"}, "qwen3_5"),
        ({"model_type": "gemma3_text"}, "gemma3"),
        ({"model_type": "gemma3"}, "gemma3"),
        ({"architectures": ["Qwen2ForCausalLM"]}, "qwen2"),
        ({"architectures": ["GptOssForCausalLM", "LlamaForCausalLM"]}, "llama"),
        ({"architectures": ["MistralForCausalLM"]}, "mistral"),
        ({"model_type": "ministral"}, "mistral"),
    ],
)
def test_family_by_model_type_else_architectures(config: dict, family: str) -> None:
    assert family_of(config, "config.json").name == family


def test_a_model_type_wins_over_architectures() -> None:
    """A config whose model_type is unknown is refused even if an architecture is known: the
    model_type names the config's keys, which another family would misread."""
    with pytest.raises(ModelLoadError, match="model_type 'gpt_oss' is not supported"):
        family_of({"model_type": "gpt_oss", "architectures": ["LlamaForCausalLM"]}, "c")


_SHAPES = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 1}  # fmt: skip


@pytest.mark.parametrize(
    ("model_type", "keys"),
    [
        ("llama", {"sliding_window": 4096}),
        ("qwen2", {"sliding_window": 4096, "use_sliding_window": True}),
        ("qwen3", {"sliding_window": 4096}),  # use_sliding_window absent: the window holds
    ],
)
def test_a_window_the_family_cannot_apply_is_refused_never_ignored(model_type, keys) -> None:
    config = {"model_type": model_type, **_SHAPES, **keys}
    with pytest.raises(ModelLoadError) as err:
        family_of(config, "c").spec(config, "c")
    message = str(err.value)
    assert "\n" not in message and f"sliding_window=4096 is not supported for model_type " \
        f"'{model_type}'" in message  # fmt: skip


def test_a_window_switched_off_is_no_window() -> None:
    """Qwen2's and Qwen3's configs carry a window beside use_sliding_window false: full
    attention, as transformers runs them (the control of the refusal above)."""
    config = {"model_type": "qwen2", **_SHAPES, "sliding_window": 4096,
              "use_sliding_window": False}  # fmt: skip
    spec = family_of(config, "c").spec(config, "c")
    assert spec.sliding is None and all(spec.window(i) is None for i in range(2))


def test_a_fused_tensor_must_hold_exactly_its_parts(tmp_path) -> None:
    """Phi-3's qkv_proj is read as q, k and v by rows (`Family.parts`): a config that counts
    fewer KV heads than the checkpoint holds is refused in one line naming the tensor, not
    read with rows left over; control: the folder as written loads."""
    import json

    from lockstep.models.resolver import resolve_model
    from tests.support.tiny_hf import save_tiny

    save_tiny("phi3", tmp_path, num_attention_heads=2, num_key_value_heads=2)
    assert resolve_model(str(tmp_path)).spec.num_kv_heads == 2
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 1}))
    with pytest.raises(ModelLoadError) as err:
        resolve_model(str(tmp_path))
    message = str(err.value)
    assert "\n" not in message
    assert "tensor 'model.layers.0.self_attn.qkv_proj.weight' has shape [384, 128]" in message
    assert "expected 256 rows (q_proj, k_proj, v_proj)" in message
