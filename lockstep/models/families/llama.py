"""Llama (LlamaForCausalLM): the plain decoder, Llama 3 RoPE scaling where the config sets it."""

from __future__ import annotations

from typing import Any

from lockstep.models.families.base import Family, decoder_spec
from lockstep.models.spec import ModelSpec


def spec(config: dict[str, Any], where: str) -> ModelSpec:
    return decoder_spec(config, where, "llama")


FAMILY = Family("llama", ("llama",), ("LlamaForCausalLM",), spec)
