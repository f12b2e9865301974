"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3 attention, routed experts in the sparse layers
(the config keys: lockstep/models/moe.py)."""

from __future__ import annotations

from typing import Any

from lockstep.models.families.base import Family, decoder_spec
from lockstep.models.moe import hf_moe_spec
from lockstep.models.spec import ModelSpec


def spec(config: dict[str, Any], where: str) -> ModelSpec:
    moe = lambda layers: hf_moe_spec(config, layers, where)  # noqa: E731
    return decoder_spec(config, where, "qwen3_moe", qk_norm=True, moe=moe)


FAMILY = Family("qwen3_moe", ("qwen3_moe",), ("Qwen3MoeForCausalLM",), spec)
