"""Qwen3-Next (Qwen3NextForCausalLM, model_type qwen3_next): the hybrid of Qwen3.5 (Gated
DeltaNet layers, gated full attention every few layers with partial rotary embeddings, norms
stored as w - 1) with Qwen3-MoE's sparse layers (`decoder_sparse_step`, `mlp_only_layers`,
`norm_topk_prob`: lockstep/models/moe.py) plus a sigmoid-gated shared expert, and Gated
DeltaNet input projections stored grouped by key head (`in_proj_qkvz`, `in_proj_ba`:
blocks/gated_deltanet.py). Its multi-token-prediction head (`mtp.*`) is not part of the
served model (transformers does not load it either); it drafts with `speculative="mtp"`.
"""

from __future__ import annotations

from typing import Any

from lockstep.models.families import qwen3_5
from lockstep.models.families.base import Family, decoder_spec
from lockstep.models.moe import hf_moe_spec
from lockstep.models.spec import ModelSpec


def spec(config: dict[str, Any], where: str) -> ModelSpec:
    linear = lambda layers: qwen3_5.linear_spec(config, layers, where, grouped=True)  # noqa: E731
    moe = lambda layers: hf_moe_spec(config, layers, where)  # noqa: E731
    return decoder_spec(config, where, "qwen3_next", linear=linear, moe=moe, **qwen3_5.HYBRID_FLAGS)


def tensor_name(key: str) -> str | None:
    return None if key.startswith("mtp.") else key


FAMILY = Family("qwen3_next", ("qwen3_next",), ("Qwen3NextForCausalLM",), spec, tensor_name,
                mtp_tensor_name=qwen3_5.mtp_tensor_name, mtp_example=qwen3_5.MTP_EXAMPLE)  # fmt: skip
