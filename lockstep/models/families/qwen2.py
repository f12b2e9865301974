"""Qwen2 (Qwen2ForCausalLM): biases on q/k/v."""

from __future__ import annotations

from typing import Any

from lockstep.models.families.base import Family, decoder_spec
from lockstep.models.spec import ModelSpec


def spec(config: dict[str, Any], where: str) -> ModelSpec:
    return decoder_spec(config, where, "qwen2", attention_bias=True, qkv_bias=True)


FAMILY = Family("qwen2", ("qwen2",), ("Qwen2ForCausalLM",), spec)
