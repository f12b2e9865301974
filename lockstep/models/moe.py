"""Mixture-of-experts checkpoints: what a Hugging Face config's MoE keys mean, which MoE
features are refused, and transformers' in-memory layout of expert tensors.

Supported routing (Qwen3-MoE, `MoeSpec`): softmax over fp32 router logits, the top-k experts
(ties toward the lower id), optionally renormalized over the k; every expert a SwiGLU MLP; no
capacity limit. Qwen3-Next and Qwen3.5-MoE add a shared expert gated by a sigmoid
(`shared_expert_intermediate_size`, allowed for their model types only:
`GATED_SHARED_EXPERT_TYPES`). A family with the same routing (OLMoE, Mixtral) needs only its
config keys and tensor names mapped here and in the loader. The DeepSeek-architecture
families (`DEEPSEEK_TYPES`) read their own routing keys (families/deepseek.py: sigmoid or
softmax scores, a correction bias, expert groups, a routed scaling factor, ungated shared
experts); for every other model type those keys are refused at load, in one line naming the
config key.

Checkpoints name experts one tensor each (`model.layers.{i}.mlp.experts.{e}.gate_proj.weight`,
the canonical names, which `save_pretrained` writes). transformers 5 holds them in memory fused
per layer (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first, and `mlp.experts.down_proj`
[E, H, I]), so a trainer's `state_dict()` has those; `split_fused_experts` turns them into the
canonical tensors (views, no copy).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from lockstep.errors import ModelLoadError
from lockstep.models.spec import MoeSpec

SUPPORTED_ROUTING = (
    "Qwen3-MoE routing (softmax top-k, optional renormalization, no expert groups), with a "
    "sigmoid-gated shared expert in Qwen3-Next and Qwen3.5-MoE only; DeepSeek's routing in "
    "the deepseek_v2, deepseek_v3 and glm4_moe_lite model types"
)
# model_type values whose shared expert is the one blocks/moe.py runs (Qwen2MoeSparseMoeBlock's
# sigmoid-gated shared expert), so their `shared_expert_intermediate_size` is served.
GATED_SHARED_EXPERT_TYPES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
# model_type values whose routing (sigmoid or softmax scores, groups, correction bias, scaling)
# and ungated shared experts families/deepseek.py reads.
DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2", "deepseek_v32", "glm4_moe_lite")

# (config key, is the value unsupported?, what the key turns on). Keys of MoE families whose
# routing Lockstep does not implement; any of them set is refused whatever the model_type.
_UNSUPPORTED: tuple[tuple[str, Any, str], ...] = (
    ("shared_expert_intermediate_size", lambda v: bool(v), "a shared expert"),
    ("n_shared_experts", lambda v: bool(v), "a shared expert"),
    ("num_shared_experts", lambda v: bool(v), "a shared expert"),
    ("n_group", lambda v: v not in (None, 1), "grouped top-k routing"),
    ("topk_group", lambda v: v not in (None, 1), "grouped top-k routing"),
    ("topk_method", lambda v: v not in (None, "greedy"), "a top-k method other than greedy"),
    ("scoring_func", lambda v: v not in (None, "softmax"), "a router scoring function"),
    ("routed_scaling_factor", lambda v: v not in (None, 1, 1.0), "a routed scaling factor"),
)


def refuse_unsupported_moe(config: dict[str, Any], where: str) -> None:
    """Raise `ModelLoadError` (one line) if `config` turns on an MoE feature Lockstep lacks.
    The DeepSeek-architecture families read their own routing keys (families/deepseek.py)."""
    if config.get("model_type") in DEEPSEEK_TYPES:
        return
    gated_shared = config.get("model_type") in GATED_SHARED_EXPERT_TYPES
    for key, unsupported, feature in _UNSUPPORTED:
        if gated_shared and key == "shared_expert_intermediate_size":
            continue
        value = config.get(key)
        if unsupported(value):
            raise ModelLoadError(
                f"{where}: {key}={value!r} ({feature}) is not supported; supported: "
                f"{SUPPORTED_ROUTING}"
            )


def hf_moe_spec(config: dict[str, Any], num_layers: int, where: str) -> MoeSpec:
    """The routed experts of a Qwen3-MoE or Qwen3-Next config (and of a Qwen3.5-MoE one, whose
    family fills in its fixed keys). A layer is sparse when it is not in `mlp_only_layers` and
    (layer + 1) is a multiple of `decoder_sparse_step`, as in transformers. `num_experts` is
    saved as `num_local_experts` by transformers 5. `shared_expert_intermediate_size` (0 or
    absent: none) is the gated shared expert's width; `refuse_unsupported_moe` has already
    refused it for model types without one."""
    experts = config.get("num_experts", config.get("num_local_experts"))
    step = int(config.get("decoder_sparse_step", 1))
    if experts is None or step < 1:
        what = "num_experts is missing" if experts is None else f"decoder_sparse_step={step}"
        raise ModelLoadError(f"{where}: {what}; a qwen3_moe config needs num_experts >= 1 and "
                             "decoder_sparse_step >= 1")  # fmt: skip
    dense_only = {int(i) for i in config.get("mlp_only_layers") or []}
    renormalize = config.get("norm_topk_prob", False)
    if not isinstance(renormalize, bool):
        raise ModelLoadError(f"{where}: norm_topk_prob={renormalize!r} must be true or false")
    try:
        return MoeSpec(
            num_experts=int(experts),
            top_k=int(config["num_experts_per_tok"]),
            intermediate_size=int(config["moe_intermediate_size"]),
            renormalize=renormalize,
            sparse_layers=tuple(
                i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0
            ),
            shared_expert_size=int(config.get("shared_expert_intermediate_size") or 0),
        )
    except KeyError as exc:
        raise ModelLoadError(f"{where}: required key {exc.args[0]} is missing") from None
    except ValueError as exc:
        raise ModelLoadError(f"{where}: inconsistent experts: {exc}") from None


_FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")


def split_fused_experts(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` with transformers' fused expert tensors replaced by the canonical per-expert
    ones (views of them); every other (name, tensor) passes unchanged. Shapes are checked
    where the canonical tensors are (a fused tensor of the wrong shape gives wrongly shaped
    canonical tensors, which the strict load names)."""
    for name, tensor in weights:
        match = _FUSED.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        prefix, kind = match.groups()
        for e, expert in enumerate(tensor.unbind(0)):
            if kind == "down_proj":
                yield f"{prefix}.{e}.down_proj.weight", expert
            else:
                gate, up = expert.chunk(2, dim=0)
                yield f"{prefix}.{e}.gate_proj.weight", gate
                yield f"{prefix}.{e}.up_proj.weight", up
