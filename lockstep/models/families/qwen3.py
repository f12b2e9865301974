"""Qwen3 (Qwen3ForCausalLM): per-head q/k RMSNorm, an explicit head_dim."""

from __future__ import annotations

from typing import Any

from lockstep.models.families.base import Family, decoder_spec
from lockstep.models.spec import ModelSpec


def spec(config: dict[str, Any], where: str) -> ModelSpec:
    return decoder_spec(config, where, "qwen3", qk_norm=True)


FAMILY = Family("qwen3", ("qwen3",), ("Qwen3ForCausalLM",), spec)
