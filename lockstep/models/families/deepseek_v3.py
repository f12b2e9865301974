"""DeepSeek-V3 / R1, Kimi-K2 and Moonlight (DeepseekV3ForCausalLM, model_type deepseek_v3 or
kimi_k2): multi-head latent attention with a q LoRA, sigmoid routing with a correction bias
over groups of experts, RoPE dims interleaved where `rope_interleave` (default true) says.
Shared config reading: families/deepseek.py."""

from __future__ import annotations

from typing import Any

from lockstep.models.families.base import Family
from lockstep.models.families.deepseek import (
    MTP_EXAMPLE,
    deepseek_spec,
    first_k_dense,
    mtp_tensor_name,
    tensor_name,
)
from lockstep.models.spec import ModelSpec


def spec(config: dict[str, Any], where: str) -> ModelSpec:
    interleave = bool(config.get("rope_interleave", True))
    return deepseek_spec(config, where, "deepseek_v3", softmax=False, interleave=interleave,
                         sparse=first_k_dense(config))  # fmt: skip


# deepseek_v32 / DeepseekV32ForCausalLM are claimed only to be refused with the reason
# (families/deepseek.py: its sparse attention), not as an unknown model type.
FAMILY = Family("deepseek_v3", ("deepseek_v3", "kimi_k2", "deepseek_v32"),
                ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"), spec, tensor_name,
                mtp_tensor_name=mtp_tensor_name, mtp_example=MTP_EXAMPLE)  # fmt: skip
