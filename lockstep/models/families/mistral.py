"""Mistral (MistralForCausalLM, model_type mistral) and Ministral (MinistralForCausalLM,
model_type ministral): Llama's layers (no biases, SwiGLU, an explicit head_dim where the
config sets one) with, where the config sets `sliding_window`, attention limited to each
query's last `sliding_window` keys (transformers' mask: query p sees keys p - window + 1 ..
p), in every layer (Mistral) or in the layers `layer_types` names "sliding_attention"
(Ministral; "full_attention" layers see every earlier key). Without a window (Mistral v0.2
and later, `sliding_window` null) every layer is full attention.

Sliding layers keep every key in the KV pool (the window is a mask of the attention op, as
Gemma 3's: lockstep/models/blocks/attention.py). RoPE scaling beside a window is refused:
the sliding layers' RoPE tables are unscaled (`SlidingWindowSpec.rope_theta`).
"""

from __future__ import annotations

from typing import Any

from lockstep.errors import ModelLoadError
from lockstep.models.families.base import Family, decoder_spec, rope, sliding_window
from lockstep.models.spec import ATTENTION_TYPES, ModelSpec, SlidingWindowSpec


def _sliding(config: dict[str, Any], where: str) -> SlidingWindowSpec | None:
    window = sliding_window(config)
    if window is None:
        return None
    theta, scaling = rope(config, where)
    if scaling is not None:
        raise ModelLoadError(f"{where}: rope_type 'llama3' with sliding_window={window} is not "
                             "supported; supported: default RoPE with a window")  # fmt: skip
    layers = int(config.get("num_hidden_layers", 0))  # missing: decoder_spec says so
    types = config.get("layer_types") or ["sliding_attention"] * layers
    if not isinstance(types, list) or len(types) != layers:
        raise ModelLoadError(f"{where}: layer_types={types!r} must name one of {ATTENTION_TYPES} "
                             f"for each of the {layers} layers")  # fmt: skip
    try:  # refuses a layer type other than ATTENTION_TYPES
        return SlidingWindowSpec(window, tuple(types), theta)
    except ValueError as exc:
        raise ModelLoadError(f"{where}: {exc}") from None


def spec(config: dict[str, Any], where: str) -> ModelSpec:
    return decoder_spec(config, where, "mistral", sliding=_sliding(config, where))


FAMILY = Family(
    "mistral", ("mistral", "ministral"), ("MistralForCausalLM", "MinistralForCausalLM"), spec
)
