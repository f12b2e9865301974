"""Qwen3.5-MoE, the hybrid mixture of experts: Qwen3.5's layers (Gated DeltaNet, gated full
attention every few layers, norms stored as w - 1) with routed experts and a sigmoid-gated
shared expert in every layer (Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text), and the text
model of the multimodal checkpoints (Qwen3_5MoeForConditionalGeneration, model_type
qwen3_5_moe, its `text_config`; tensors and their omissions as Qwen3.5's, families/qwen3_5.py).

transformers' Qwen3_5MoeTextConfig has no dense MLP: every layer is sparse and the router
always renormalizes over the top k (it deletes intermediate_size, decoder_sparse_step,
mlp_only_layers and norm_topk_prob), so those keys are fixed here whatever a config says.
"""

from __future__ import annotations

from typing import Any

from lockstep.errors import ModelLoadError
from lockstep.models.families import qwen3_5
from lockstep.models.families.base import Family, decoder_spec
from lockstep.models.moe import hf_moe_spec
from lockstep.models.spec import ModelSpec


def spec(config: dict[str, Any], where: str) -> ModelSpec:
    if config.get("model_type") == "qwen3_5_moe":
        config = qwen3_5.text_config(config, where, "qwen3_5_moe_text")
    if not config.get("shared_expert_intermediate_size"):
        raise ModelLoadError(f"{where}: shared_expert_intermediate_size is missing or 0; a "
                             "Qwen3.5-MoE config needs its shared expert's width")  # fmt: skip
    config = {
        **config,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
        # No layer is dense; the shared expert is the widest MLP a token always runs (the
        # step workspace, lockstep/engine/memory.py, sizes its activations by this width).
        "intermediate_size": config["shared_expert_intermediate_size"],
    }  # fmt: skip
    linear = lambda layers: qwen3_5.linear_spec(config, layers, where)  # noqa: E731
    moe = lambda layers: hf_moe_spec(config, layers, where)  # noqa: E731
    return decoder_spec(
        config, where, "qwen3_5_moe", linear=linear, moe=moe, **qwen3_5.HYBRID_FLAGS
    )


FAMILY = Family(
    "qwen3_5_moe",
    ("qwen3_5_moe_text", "qwen3_5_moe"),
    ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    spec,
    qwen3_5.tensor_name,
    mtp_tensor_name=qwen3_5.mtp_tensor_name,
    mtp_example=qwen3_5.MTP_EXAMPLE,
)
