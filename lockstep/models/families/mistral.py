"""Mistral (MistralForCausalLM, model_type mistral) and Ministral (MinistralForCausalLM,
model_type ministral): Llama's layers (no biases, SwiGLU, an explicit head_dim where the
config sets one) with, where the config sets `sliding_window`, attention limited to each
query's last `sliding_window` keys (transformers' mask: query p sees keys p - window + 1 ..
p), in every layer (Mistral) or in the layers `layer_types` names "sliding_attention"
(Ministral; "full_attention" layers see every earlier key). Without a window (Mistral v0.2
and later, `sliding_window` null) every layer is full attention. Every layer rotates by the
model's RoPE, scaled or not (`families/base.py`'s `sliding_spec`).

Sliding layers keep every key in the KV pool (the window is a mask of the attention op, as
Gemma 3's: lockstep/models/blocks/attention.py).
"""

from __future__ import annotations

from typing import Any

from lockstep.models.families.base import Family, decoder_spec, sliding_spec
from lockstep.models.spec import ModelSpec


def spec(config: dict[str, Any], where: str) -> ModelSpec:
    return decoder_spec(config, where, "mistral", sliding=sliding_spec(config, where))


FAMILY = Family(
    "mistral", ("mistral", "ministral"), ("MistralForCausalLM", "MinistralForCausalLM"), spec
)
