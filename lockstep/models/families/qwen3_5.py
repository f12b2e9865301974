"""Qwen3.5, the hybrid: Gated DeltaNet layers with gated full attention every few layers
(Qwen3_5ForCausalLM, model_type qwen3_5_text), and the text model of the multimodal
checkpoints (Qwen3_5ForConditionalGeneration, model_type qwen3_5, its `text_config`).

A multimodal checkpoint stores the text model as `model.language_model.*` (read as `model.*`);
its vision tower (`model.visual.*`: text only is served) and multi-token-prediction head
(`mtp.*`, which transformers does not load either) are left out of the served model; the MTP
head drafts with `speculative="mtp"` (`mtp_tensor_name`, lockstep/models/mtp.py). Its multimodal RoPE
(`mrope_section`) gives text tokens the same position on all three axes, which is plain RoPE
on the rotated dims: text-only serving needs nothing more.
"""

from __future__ import annotations

from typing import Any

from lockstep.errors import ModelLoadError
from lockstep.models.families.base import Family, decoder_spec
from lockstep.models.spec import LinearAttentionSpec, ModelSpec

_LANGUAGE_MODEL = "model.language_model."
# The layer variants Qwen3.5 and the hybrid MoE families share: a quarter of each head
# rotated unless the config says otherwise, q/k norm, norms stored as w - 1, gated attention.
HYBRID_FLAGS: dict[str, Any] = dict(
    rotary_default=0.25, qk_norm=True, norm_style="offset", output_gate=True
)


def text_config(config: dict[str, Any], where: str, text_type: str = "qwen3_5_text") -> dict:
    """A multimodal config's text model, as a `text_type` config (Qwen3.5-MoE's wrapper too)."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(
            f"{where}: model_type {config.get('model_type')!r} without a text_config object"
        )
    tie = text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    return {**text, "model_type": text_type, "tie_word_embeddings": tie}


def linear_spec(
    config: dict[str, Any], layers: int, where: str, grouped: bool = False
) -> LinearAttentionSpec:
    """The Gated DeltaNet layers (layer_types, or transformers' default pattern from
    full_attention_interval); `grouped`: Qwen3-Next's grouped input projections."""
    types = config.get("layer_types")
    if types is None:
        interval = int(config.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention"
                 for i in range(layers)]  # fmt: skip
    if not isinstance(types, list):
        raise ModelLoadError(f"{where}: layer_types={types!r} is not a list")
    return LinearAttentionSpec(
        layer_types=tuple(types),
        num_key_heads=int(config.get("linear_num_key_heads", 16)),
        num_value_heads=int(config.get("linear_num_value_heads", 32)),
        key_head_dim=int(config.get("linear_key_head_dim", 128)),
        value_head_dim=int(config.get("linear_value_head_dim", 128)),
        conv_kernel=int(config.get("linear_conv_kernel_dim", 4)),
        grouped_projections=grouped,
    )


def spec(config: dict[str, Any], where: str) -> ModelSpec:
    if config.get("model_type") == "qwen3_5":
        config = text_config(config, where)
    linear = lambda layers: linear_spec(config, layers, where)  # noqa: E731
    return decoder_spec(config, where, "qwen3_5", linear=linear, **HYBRID_FLAGS)


def tensor_name(key: str) -> str | None:
    if key.startswith(("model.visual.", "mtp.")):
        return None
    if key.startswith(_LANGUAGE_MODEL):
        return "model." + key[len(_LANGUAGE_MODEL) :]
    return key


# The MTP head's own tensors and their names in the MTP drafter's model (lockstep/models/
# mtp.py); its layer is `mtp.layers.0.*`, its embedding and LM head the model's.
_MTP_OWN = {
    "mtp.fc.weight": "mtp.eh_proj.weight",
    "mtp.pre_fc_norm_embedding.weight": "mtp.enorm.weight",
    "mtp.pre_fc_norm_hidden.weight": "mtp.hnorm.weight",
    "mtp.norm.weight": "model.norm.weight",
}
MTP_EXAMPLE = "mtp.fc.weight"


def mtp_tensor_name(key: str, num_layers: int) -> str | None:
    """A checkpoint tensor's name in the MTP drafter's model (families/base.py, `Family`), for
    Qwen3.5, Qwen3.5-MoE and Qwen3-Next alike; None for the rest."""
    if key in _MTP_OWN:
        return _MTP_OWN[key]
    if key.startswith("mtp.layers.0."):
        return "model.layers.0." + key.removeprefix("mtp.layers.0.")
    name = tensor_name(key)
    return name if name in ("model.embed_tokens.weight", "lm_head.weight") else None


FAMILY = Family(
    "qwen3_5",
    ("qwen3_5_text", "qwen3_5"),
    ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
    spec,
    tensor_name,
    mtp_tensor_name=mtp_tensor_name,
    mtp_example=MTP_EXAMPLE,
)
