"""DeepSeek-V2 and DeepSeek-V2-Lite (DeepseekV2ForCausalLM, model_type deepseek_v2): multi-head
latent attention (a q LoRA or one q_proj), softmax routing, greedy or group-limited, RoPE dims
always interleaved (transformers rotates them as complex pairs). Shared config reading:
families/deepseek.py."""

from __future__ import annotations

from typing import Any

from lockstep.models.families.base import Family
from lockstep.models.families.deepseek import deepseek_spec, first_k_dense, tensor_name
from lockstep.models.spec import ModelSpec


def spec(config: dict[str, Any], where: str) -> ModelSpec:
    return deepseek_spec(config, where, "deepseek_v2", softmax=True, interleave=True,
                         sparse=first_k_dense(config))  # fmt: skip


FAMILY = Family("deepseek_v2", ("deepseek_v2",), ("DeepseekV2ForCausalLM",), spec, tensor_name)
