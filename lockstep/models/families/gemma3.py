"""Gemma 3 (Gemma3ForCausalLM, model_type gemma3_text), and the text model of the multimodal
checkpoints (Gemma3ForConditionalGeneration, model_type gemma3, its `text_config`).

What Gemma changes in the decoder, each a `ModelSpec` field: sliding-window attention layers
interleaved with global ones (`layer_types`, `sliding_window`; the local layers' RoPE base is
rope_parameters["sliding_attention"], or rope_local_base_freq in older configs; the global
layers' may carry linear scaling), a GeGLU MLP (gelu_pytorch_tanh), four RMSNorms per layer
stored as w - 1, q/k norms, embeddings times sqrt(hidden_size), scores scaled by
query_pre_attn_scalar ** -0.5, tied embeddings, and final logit soft-capping where the config
sets final_logit_softcapping (no released Gemma 3 does; attention soft-capping is refused).

A multimodal checkpoint stores the text model as `model.language_model.*` (transformers 5)
or `language_model.model.*` (earlier writers), both read as `model.*`; its vision tower and
projector are left out (text only is served). Its config.json lists only the text_config
keys that differ from Gemma3TextConfig's defaults, so those defaults fill the rest.
"""

from __future__ import annotations

from typing import Any

from lockstep.errors import ModelLoadError
from lockstep.models.families.base import Family, decoder_spec
from lockstep.models.spec import ModelSpec, SlidingWindowSpec

# transformers' Gemma3TextConfig defaults, for the keys a hub config may leave out.
_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256, "sliding_window": 4096,
}  # fmt: skip
_GLOBAL_THETA, _LOCAL_THETA, _PATTERN = 1_000_000.0, 10_000.0, 6
_DROPPED = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
            "multi_modal_projector.")  # fmt: skip
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))  # fmt: skip


def _text_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The text model's config with Gemma3TextConfig's defaults filled in."""
    if config.get("model_type") == "gemma3":
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ModelLoadError(f"{where}: model_type 'gemma3' without a text_config object")
        tie = text.get("tie_word_embeddings", config.get("tie_word_embeddings", True))
        config = {**text, "tie_word_embeddings": tie}
    return {**_TEXT_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}


def _refuse(config: dict[str, Any], where: str) -> None:
    """What Gemma 3 configs may set that this decoder does not do: refused in one line each."""
    act = config.get("hidden_activation") or config.get("hidden_act")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"{where}: hidden_activation={act!r} is not supported; "
                             "supported: gelu_pytorch_tanh")  # fmt: skip
    if config.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(
            f"{where}: attn_logit_softcapping={config['attn_logit_softcapping']!r} is not "
            "supported; supported: null (as every Gemma 3 checkpoint sets it)"
        )
    if config.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{where}: use_bidirectional_attention=True is not supported; "
                             "supported: causal attention")  # fmt: skip


def _rope(config: dict[str, Any], where: str) -> tuple[float, float, float]:
    """(global theta, linear factor of the global layers, local theta) from transformers 5's
    rope_parameters per layer type, or from rope_theta, rope_scaling and rope_local_base_freq."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
    else:  # the older flat keys
        full = {"rope_theta": config.get("rope_theta", _GLOBAL_THETA),
                **(config.get("rope_scaling") or params)}  # fmt: skip
        local = {"rope_theta": config.get("rope_local_base_freq", _LOCAL_THETA)}
    for name, part in (("full_attention", full), ("sliding_attention", local)):
        kind = part.get("rope_type", part.get("type", "default"))
        if kind not in ("default", "linear") or (kind == "linear" and name != "full_attention"):
            raise ModelLoadError(f"{where}: {name} rope_type {kind!r} is not supported; "
                                 "supported: default, linear (full attention)")  # fmt: skip
    linear = full.get("rope_type", full.get("type")) == "linear"
    factor = float(full.get("factor", 1.0)) if linear else 1.0
    return (float(full.get("rope_theta", _GLOBAL_THETA)), factor,
            float(local.get("rope_theta", _LOCAL_THETA)))  # fmt: skip


def spec(config: dict[str, Any], where: str) -> ModelSpec:
    config = _text_config(config, where)
    _refuse(config, where)
    theta, factor, local_theta = _rope(config, where)
    layers = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None:  # transformers' default: every sliding_window_pattern-th layer global
        pattern = int(config.get("sliding_window_pattern", _PATTERN))
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(layers)]  # fmt: skip
    if not isinstance(types, list):
        raise ModelLoadError(f"{where}: layer_types={types!r} is not a list")
    try:
        sliding = SlidingWindowSpec(int(config["sliding_window"]), tuple(types), local_theta)
    except ValueError as exc:
        raise ModelLoadError(f"{where}: {exc}") from None
    # The keys read above, which decoder_spec would read as a Llama's.
    read = ("rope_parameters", "rope_scaling", "hidden_act", "hidden_activation")
    plain = {k: v for k, v in config.items() if k not in read}
    plain["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    return decoder_spec(
        plain, where, "gemma3", qk_norm=True, sliding=sliding, mlp_activation="gelu_tanh",
        sandwich_norms=True, embed_scale=True, norm_style="offset",
        attention_scale=float(config["query_pre_attn_scalar"]) ** -0.5,
        rope_linear_factor=factor, final_logit_softcap=_optional_float(config, "final_logit_softcapping"),
    )  # fmt: skip


def _optional_float(config: dict[str, Any], key: str) -> float | None:
    value = config.get(key)
    return None if value is None else float(value)


def tensor_name(key: str) -> str | None:
    if key.startswith(_DROPPED):
        return None
    for prefix, canonical in _TEXT_PREFIXES:
        if key.startswith(prefix):
            return canonical + key[len(prefix) :]
    return key


FAMILY = Family(
    "gemma3",
    ("gemma3_text", "gemma3"),
    ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
    spec,
    tensor_name,
)
