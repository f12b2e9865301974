"""The Gated DeltaNet mixer of hybrid models (Qwen3.5): linear attention whose per-sequence
state replaces K/V (the layer's math and state: lockstep/models/linear_attention.py).

Canonical tensors (after "model.layers.{i}.", H hidden; Hk, Dk key heads and dim, Hv, Dv
value heads and dim, K the convolution width):

    linear_attn.in_proj_qkv.weight  [2 Hk Dk + Hv Dv, H]  (q | k | v)
    linear_attn.in_proj_z.weight    [Hv Dv, H]  (output gate)
    linear_attn.in_proj_b.weight    [Hv, H]     (beta = sigmoid(b))
    linear_attn.in_proj_a.weight    [Hv, H]     (decay)
    linear_attn.conv1d.weight       [2 Hk Dk + Hv Dv, 1, K]
    linear_attn.A_log               [Hv]
    linear_attn.dt_bias             [Hv]
    linear_attn.norm.weight         [Dv]  (gated RMSNorm, plain weight)
    linear_attn.out_proj.weight     [H, Hv Dv]

Prepared: the four input projections fused (rows q | k | v | z | b | a), the convolution
[channels, K] and the small vectors in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from lockstep.models.blocks.base import BuildContext, CacheBytes, LayoutEntry, Step
from lockstep.models.linear_attention import LinearWeights, gated_deltanet
from lockstep.ops.base import DenseOps, GatedOutputOps, LinearAttentionOps

if TYPE_CHECKING:
    from lockstep.models.spec import ModelSpec
    from lockstep.ops.base import Ops

# Canonical leaf -> prepared field and kind ("linear" fields are fused below).
_SMALL = (("conv1d.weight", "conv", "conv"), ("A_log", "a_log", "norm"),
          ("dt_bias", "dt_bias", "norm"), ("norm.weight", "norm", "norm"))  # fmt: skip


@dataclass
class GatedDeltaNetWeights(LinearWeights):
    """`LinearWeights`, the layer's index among the model's linear-attention layers (its slot
    in each sequence's `LinearState`) and the gated norm's epsilon."""

    state_index: int
    eps: float


@dataclass(frozen=True)
class GatedDeltaNet:
    """Gated DeltaNet over `ModelSpec.linear`'s shapes."""

    prefix: ClassVar[str] = "linear_attn"
    cache: ClassVar[str] = "state"  # a LinearState per sequence
    requires: ClassVar[tuple[type, ...]] = (DenseOps, LinearAttentionOps, GatedOutputOps)

    def cache_bytes(self, spec: ModelSpec, kv_heads: int, kv_dtype: torch.dtype) -> CacheBytes:
        """Nothing per token in the KV pool; each radix snapshot holds this layer's float32
        convolution window and recurrent state (`LinearLayout.snapshot_bytes`, per layer)."""
        lin = spec.linear
        assert lin is not None
        window = (lin.conv_kernel - 1) * lin.conv_dim
        state = lin.num_value_heads * lin.key_head_dim * lin.value_head_dim
        return CacheBytes(per_token=0, per_snapshot=4 * (window + state))

    def weight_names(self, spec: ModelSpec) -> list[str]:
        leaves = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight",
                  "in_proj_a.weight", "conv1d.weight", "A_log", "dt_bias", "norm.weight",
                  "out_proj.weight")  # fmt: skip
        return ["linear_attn." + leaf for leaf in leaves]

    def weight_shape(self, spec: ModelSpec, name: str) -> tuple[int, ...]:
        lin, h = spec.linear, spec.hidden_size
        assert lin is not None
        return {
            "in_proj_qkv.weight": (lin.conv_dim, h),
            "in_proj_z.weight": (lin.value_dim, h),
            "in_proj_b.weight": (lin.num_value_heads, h),
            "in_proj_a.weight": (lin.num_value_heads, h),
            "conv1d.weight": (lin.conv_dim, 1, lin.conv_kernel),
            "A_log": (lin.num_value_heads,),
            "dt_bias": (lin.num_value_heads,),
            "norm.weight": (lin.value_head_dim,),
            "out_proj.weight": (h, lin.value_dim),
        }[name.removeprefix("linear_attn.")]

    def layout(self, spec: ModelSpec, layer: int, role: str) -> list[LayoutEntry]:
        g, t = f"model.layers.{layer}.linear_attn.", f"layers.{layer}.{role}."
        ins = [g + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")]
        entries = [LayoutEntry(t + "in_proj", "linear", ins)]
        entries += [LayoutEntry(t + field, kind, [g + leaf]) for leaf, field, kind in _SMALL]
        entries.append(LayoutEntry(t + "out_proj", "linear", [g + "out_proj.weight"]))
        return entries

    def build(self, parts: dict[str, Any], context: BuildContext) -> GatedDeltaNetWeights:
        return GatedDeltaNetWeights(
            **parts, state_index=context.cache_index, eps=context.spec.rms_norm_eps
        )

    def forward(
        self, ops: Ops, x: torch.Tensor, w: GatedDeltaNetWeights, step: Step
    ) -> torch.Tensor:
        assert step.linear_layout is not None
        return gated_deltanet(ops, x, w, w.state_index, step.batch, step.linear_layout,
                              w.eps, step.rows)  # fmt: skip
