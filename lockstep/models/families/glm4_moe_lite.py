"""GLM-4.7-Flash (Glm4MoeLiteForCausalLM, model_type glm4_moe_lite): DeepSeek-V3's attention
and routing (families/deepseek.py) with its dense layers named by `mlp_layer_types`
("dense" / "sparse" per layer; absent: layer 0 dense, the rest sparse, as transformers
defaults it)."""

from __future__ import annotations

from typing import Any

from lockstep.errors import ModelLoadError
from lockstep.models.families.base import Family
from lockstep.models.families.deepseek import deepseek_spec, tensor_name
from lockstep.models.spec import ModelSpec


def spec(config: dict[str, Any], where: str) -> ModelSpec:
    layers = int(config.get("num_hidden_layers", 0))
    types = config.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    if len(types) != layers or any(t not in ("dense", "sparse") for t in types):
        raise ModelLoadError(f"{where}: mlp_layer_types={types!r} must name 'dense' or 'sparse' "
                             f"for each of the {layers} layers")  # fmt: skip
    sparse = tuple(i for i, t in enumerate(types) if t == "sparse")
    interleave = bool(config.get("rope_interleave", True))
    return deepseek_spec(config, where, "glm4_moe_lite", softmax=False, interleave=interleave,
                         sparse=sparse)  # fmt: skip


FAMILY = Family("glm4_moe_lite", ("glm4_moe_lite",), ("Glm4MoeLiteForCausalLM",), spec,
                tensor_name)  # fmt: skip
