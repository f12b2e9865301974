"""A model's layers as blocks: each layer's `LayerPlan` (its mixer and MLP) chosen from the
spec's fields, and the canonical tensors (lockstep/models/spec.py) a model of that plan has,
with their shapes: the names and shapes every loader checks and the decoder loads."""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, NamedTuple

from lockstep.models.blocks.attention import Attention
from lockstep.models.blocks.base import Block, Mixer
from lockstep.models.blocks.gated_deltanet import GatedDeltaNet
from lockstep.models.blocks.mla import LatentAttention
from lockstep.models.blocks.mlp import DenseMlp
from lockstep.models.blocks.moe import MoeMlp

if TYPE_CHECKING:
    from lockstep.models.spec import ModelSpec


class LayerPlan(NamedTuple):
    """One decoder layer: its mixer (attention, latent attention or linear attention) and its
    MLP."""

    mixer: Mixer
    mlp: Block


@lru_cache(maxsize=64)
def plan_layers(spec: ModelSpec) -> tuple[LayerPlan, ...]:
    """Each layer's mixer and MLP, from the spec's fields (`ModelSpec.layer_plans`)."""

    # Cached by spec (frozen, hashable): weight names and shapes ask for every tensor.
    def attention(layer: int) -> Attention | LatentAttention:
        if spec.mla is not None:
            return LatentAttention(q_lora=spec.mla.q_lora_rank is not None)
        return Attention(bias=spec.qkv_bias, qk_norm=spec.qk_norm, output_gate=spec.output_gate,
                         window=spec.window(layer))  # fmt: skip

    linear = GatedDeltaNet(grouped=spec.linear is not None and spec.linear.grouped_projections)
    moe = spec.moe
    shared = "" if moe is None or not moe.shared_expert_size else "gated"
    if shared and moe is not None and not moe.shared_expert_gated:
        shared = "ungated"
    experts = MoeMlp(shared=shared, deepseek_routing=moe is not None and moe.deepseek_routing)
    dense = DenseMlp(activation=spec.mlp_activation)
    return tuple(
        LayerPlan(
            linear if spec.is_linear(i) else attention(i),
            experts if spec.is_sparse(i) else dense,
        )
        for i in range(spec.num_layers)
    )


def expected_weight_names(spec: ModelSpec) -> list[str]:
    """Every canonical tensor name (spec.py) a model of this spec has, in layer order: each
    layer's norms and its blocks' tensors (lockstep/models/blocks), FP8 scales after their
    weight."""
    names = ["model.embed_tokens.weight"]
    for i, plan in enumerate(spec.layer_plans):
        prefix = f"model.layers.{i}."
        norms = dict(spec.norm_names())
        names.append(prefix + norms["input_norm"])
        names += [prefix + n for n in plan.mixer.weight_names(spec)]
        names += [prefix + norms[f] for f in ("mixer_norm", "post_norm") if f in norms]
        names += [prefix + n for n in plan.mlp.weight_names(spec)]
        if "mlp_norm" in norms:
            names.append(prefix + norms["mlp_norm"])
    if spec.fp8 is not None:
        names = [extra for name in names for extra in _with_fp8_scales(spec, name)]
    names.append("model.norm.weight")
    if not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def _with_fp8_scales(spec: ModelSpec, name: str) -> list[str]:
    """`name`, followed by its scale tensors when it is the weight of an FP8 linear."""
    module = name.removesuffix(".weight")
    if name == module or not spec.is_fp8_linear(module):
        return [name]
    assert spec.fp8 is not None
    extra = [module + ".input_scale"] if spec.fp8.scheme == "tensor" else []
    return [name, module + ".weight_scale", *extra]


def expected_weight_shape(spec: ModelSpec, name: str) -> tuple[int, ...]:
    """The shape of canonical tensor `name` (one of `expected_weight_names(spec)`)."""
    if name.endswith((".weight_scale", ".input_scale")):
        assert spec.fp8 is not None, name
        if name.endswith(".input_scale") or spec.fp8.scheme == "tensor":
            return ()
        n, k = expected_weight_shape(spec, name.removesuffix("_scale"))
        return (-(-n // 128), -(-k // 128)) if spec.fp8.scheme == "block" else (n,)
    h = spec.hidden_size
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (spec.vocab_size, h)
    if name == "model.norm.weight":
        return (h,)
    layer, leaf = name.removeprefix("model.layers.").split(".", 1)
    if leaf in (n for _, n in spec.norm_names()):
        return (h,)
    plan = spec.layer_plans[int(layer)]
    block = plan.mixer if leaf.startswith(plan.mixer.prefix + ".") else plan.mlp
    return block.weight_shape(spec, leaf)
