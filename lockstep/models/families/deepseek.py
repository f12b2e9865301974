"""The config reading the DeepSeek-architecture families share (families/deepseek_v2.py,
deepseek_v3.py, glm4_moe_lite.py): multi-head latent attention (`MlaSpec`, blocks/mla.py),
YaRN RoPE with its softmax mscale, and DeepSeek MoE routing (`MoeSpec`, lockstep/ops/moe.py).

The families differ only here: DeepSeek-V2 scores experts by softmax (greedy top-k, or the
best groups by their max first, "group_limited_greedy") and always interleaves its RoPE dims;
DeepSeek-V3 (Kimi-K2 and Moonlight ship its architecture) and GLM-4.7-Flash score by sigmoid,
choose by score + a correction bias within the best groups (the sum of each group's two best),
renormalize where `norm_topk_prob` says and interleave where `rope_interleave` says; GLM
names its dense layers in `mlp_layer_types` where the DeepSeeks count `first_k_dense_replace`.
Every family adds `n_shared_experts` ungated shared experts (one SwiGLU of their summed width).

Refused in one line: DeepSeek-V3.2's sparse attention (`index_topk`, `DeepseekV32`), a
`moe_layer_freq` other than 1, a partial rotary factor, widths the CPU latent-attention
kernel cannot take (multiples of 16), and the keys every family refuses (families/base.py).
The multi-token-prediction layer (`num_nextn_predict_layers`, tensors
`model.layers.{num_hidden_layers}.*`) is not part of the served model (the folder loader skips
its tensors); DeepSeek-V3's drafts with `speculative="mtp"` (`mtp_tensor_name`,
lockstep/models/mtp.py).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from lockstep.errors import ModelLoadError
from lockstep.models.families.base import decoder_spec
from lockstep.models.spec import MlaSpec, ModelSpec, MoeSpec, YarnScaling

logger = logging.getLogger(__name__)


def _mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope(config: dict[str, Any], where: str) -> tuple[float, YarnScaling | None, float]:
    """(theta, YaRN scaling or None, the factor on the scores' scale: YaRN's mscale squared
    where mscale_all_dim is set, as transformers' yarn_apply_mscale)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError(f"{where}: partial_rotary_factor is not supported for MLA models; "
                             "supported: 1 (every qk_rope_head_dim dim rotates)")  # fmt: skip
    if rope_type == "default":
        return theta, None, 1.0
    if rope_type != "yarn":
        raise ModelLoadError(
            f"{where}: rope_type {rope_type!r} is not supported; supported: default, yarn"
        )
    try:
        original = int(params["original_max_position_embeddings"])
        factor = params.get("factor") or int(config["max_position_embeddings"]) / original
    except KeyError as exc:
        raise ModelLoadError(f"{where}: yarn RoPE scaling lacks {exc.args[0]}") from None
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        else:
            attention_factor = _mscale(factor, 1.0)
    yarn = YarnScaling(
        factor=float(factor), original_max_position=original,
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        attention_factor=float(attention_factor), truncate=bool(params.get("truncate", True)),
    )  # fmt: skip
    softmax = _mscale(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0
    return theta, yarn, softmax


def _refuse(config: dict[str, Any], where: str) -> None:
    architectures = config.get("architectures") or []
    v32 = config.get("model_type") == "deepseek_v32" or "DeepseekV32ForCausalLM" in architectures
    if config.get("index_topk") or v32:
        raise ModelLoadError(
            f"{where}: DeepSeek-V3.2's sparse attention (index_topk, DeepseekV32) is not "
            "supported; supported: DeepSeek-V2/V3 multi-head latent attention"
        )
    if config.get("moe_layer_freq", 1) != 1:
        raise ModelLoadError(f"{where}: moe_layer_freq={config['moe_layer_freq']!r} is not "
                             "supported; supported: 1")  # fmt: skip
    rank, rope = int(config["kv_lora_rank"]), int(config["qk_rope_head_dim"])
    if rank % 16 or (rank + rope) % 16:
        raise ModelLoadError(
            f"{where}: kv_lora_rank={rank} with qk_rope_head_dim={rope}: the latent-attention "
            "kernels take a latent and a latent + RoPE width that are multiples of 16"
        )


def mla_spec(config: dict[str, Any], interleave: bool, softmax_mscale: float) -> MlaSpec:
    q_lora = config.get("q_lora_rank")
    nope, rope = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
    return MlaSpec(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(config["kv_lora_rank"]),
        qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=int(config["v_head_dim"]),
        rope_interleave=interleave, softmax_scale=(nope + rope) ** -0.5 * softmax_mscale,
    )  # fmt: skip


def moe_spec(config: dict[str, Any], sparse: tuple[int, ...], softmax: bool, where: str) -> MoeSpec:
    """The routed and shared experts; `softmax`: DeepSeek-V2's scoring (else sigmoid with a
    correction bias, DeepSeek-V3's)."""
    method = config.get("topk_method") or ("greedy" if softmax else "noaux_tc")
    methods = ("greedy", "group_limited_greedy") if softmax else ("noaux_tc",)
    scoring = config.get("scoring_func") or ("softmax" if softmax else "sigmoid")
    if method not in methods or scoring != ("softmax" if softmax else "sigmoid"):
        raise ModelLoadError(f"{where}: topk_method={method!r} with scoring_func={scoring!r} is "
                             f"not supported for {config.get('model_type')}; supported: "
                             f"{', '.join(methods)} with {'softmax' if softmax else 'sigmoid'}")  # fmt: skip
    renormalize = bool(config.get("norm_topk_prob", False))
    if softmax and renormalize:
        # transformers' DeepseekV2TopkRouter ignores the key; DeepSeek's own code honours it.
        raise ModelLoadError(f"{where}: norm_topk_prob=true with softmax routing is ambiguous "
                             "(transformers ignores it); supported: false")  # fmt: skip
    grouped = not softmax or method == "group_limited_greedy"
    width = int(config["moe_intermediate_size"])
    return MoeSpec(
        num_experts=int(config["n_routed_experts"]),
        top_k=int(config["num_experts_per_tok"]),
        intermediate_size=width,
        renormalize=renormalize,
        sparse_layers=sparse,
        shared_expert_size=width * int(config.get("n_shared_experts") or 0),
        shared_expert_gated=False,
        scoring=scoring,
        correction_bias=not softmax,
        groups=int(config.get("n_group") or 1) if grouped else 1,
        topk_groups=int(config.get("topk_group") or 1) if grouped else 1,
        group_score="max" if softmax else "top2_sum",
        routed_scaling=float(config.get("routed_scaling_factor") or 1.0),
    )


def deepseek_spec(
    config: dict[str, Any], where: str, family: str, softmax: bool, interleave: bool,
    sparse: tuple[int, ...],
) -> ModelSpec:  # fmt: skip
    """The spec of one of the families (module docstring). `sparse`: the MoE layers."""
    try:
        _refuse(config, where)
        theta, yarn, softmax_mscale = _rope(config, where)
        mla = mla_spec(config, interleave, softmax_mscale)
        moe = moe_spec(config, sparse, softmax, where)
    except KeyError as exc:
        raise ModelLoadError(f"{where}: required key {exc.args[0]} is missing") from None
    except ValueError as exc:
        raise ModelLoadError(f"{where}: inconsistent model shape: {exc}") from None
    if config.get("num_nextn_predict_layers"):
        logger.info("%s: the %d multi-token-prediction layer(s) run only as a drafter "
                    "(speculative='mtp')", where, config["num_nextn_predict_layers"])  # fmt: skip
    # RoPE rotates qk_rope_head_dim dims; the cache keeps one latent "head" per token.
    plain = {**config, "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
             "head_dim": mla.qk_rope_head_dim, "num_key_value_heads": 1}  # fmt: skip
    plain.pop("rope_scaling", None)
    plain.pop("partial_rotary_factor", None)
    return decoder_spec(plain, where, family, mla=mla, moe=moe, yarn=yarn)


def tensor_name(key: str) -> str | None:
    """Checkpoints store canonical names, the multi-token-prediction layers past the last
    decoder layer included; the folder loader skips those (it knows the layer count)."""
    return key


def first_k_dense(config: dict[str, Any]) -> tuple[int, ...]:
    """The sparse layers of a DeepSeek config: every layer from first_k_dense_replace on."""
    layers = int(config["num_hidden_layers"])
    return tuple(range(int(config.get("first_k_dense_replace") or 0), layers))


# The MTP layer's own tensors (after "model.layers.{num_hidden_layers}.") and their names in
# the MTP drafter's model (lockstep/models/mtp.py); its copy of the embedding is the model's.
_MTP_OWN = {
    "enorm.weight": "mtp.enorm.weight", "hnorm.weight": "mtp.hnorm.weight",
    "eh_proj.weight": "mtp.eh_proj.weight", "shared_head.norm.weight": "model.norm.weight",
    "shared_head.head.weight": "lm_head.weight", "embed_tokens.weight": None,
}  # fmt: skip
MTP_EXAMPLE = "model.layers.{num_hidden_layers}.eh_proj.weight"


def mtp_tensor_name(key: str, num_layers: int) -> str | None:
    """A checkpoint tensor's name in the MTP drafter's model (families/base.py, `Family`): the
    first MTP layer (`model.layers.{num_layers}.*`) as layer 0, its shared head as the LM head
    and final norm, and the model's embedding; None for everything else."""
    if key == "model.embed_tokens.weight":
        return key
    prefix = f"model.layers.{num_layers}."
    if not key.startswith(prefix):
        return None
    leaf = key[len(prefix) :]
    return _MTP_OWN[leaf] if leaf in _MTP_OWN else "model.layers.0." + leaf
