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

Qwen3-Next stores the same rows as two projections grouped by key head (`grouped`, the
`LinearAttentionSpec.grouped_projections` flag), r = Hv / Hk value heads per key head:

    linear_attn.in_proj_qkvz.weight  [2 Hk Dk + 2 Hv Dv, H]  per key head: q, k, r v, r z
    linear_attn.in_proj_ba.weight    [2 Hv, H]               per key head: r b, r a

`ungroup_projections` reorders them into the four projections above (transformers'
`fix_query_key_value_ordering`, applied to weight rows instead of outputs).

Prepared: the four input projections fused (rows q | k | v | z | b | a), the convolution
[channels, K] and the small vectors in float32, out_proj row-parallel over the value heads.
A tensor-parallel rank keeps the rows of its key and value heads of each input projection,
their convolution channels, A_log and dt_bias (`ShardPlan.linear_key_heads`,
`linear_value_heads`; lockstep/parallel/sharding.py), and the norm whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from lockstep.models.blocks.base import BuildContext, CacheBytes, LayoutEntry, PrepareContext, Step
from lockstep.models.blocks.prepare import fused_linear, prepare_common
from lockstep.models.linear_attention import (
    LinearLayout,
    LinearStatePool,
    LinearWeights,
    gated_deltanet,
    pooled_rows,
)
from lockstep.ops.base import DenseOps, GatedOutputOps, LinearAttentionOps, PooledRows

if TYPE_CHECKING:
    from lockstep.models.forward_batch import ForwardBatch
    from lockstep.models.spec import LinearAttentionSpec, ModelSpec
    from lockstep.ops.base import Ops
    from lockstep.parallel.sharding import ShardPlan

# Canonical leaf -> prepared field and kind ("linear" fields are fused below; "value_heads":
# float32, a rank's value heads).
_SMALL = (("conv1d.weight", "conv", "conv"), ("A_log", "a_log", "value_heads"),
          ("dt_bias", "dt_bias", "value_heads"), ("norm.weight", "norm", "norm"))  # fmt: skip


@dataclass
class GatedDeltaNetWeights(LinearWeights):
    """`LinearWeights`, the layer's index among the model's linear-attention layers (its slot
    in each sequence's `LinearState`) and the gated norm's epsilon."""

    state_index: int
    eps: float


@dataclass(frozen=True)
class LinearStep:
    """What the Gated DeltaNet layers of one step share (`LinearSteps.begin`): the state
    layout, each sequence's row count on the host (read once per step; None when the engine
    laid the rows out pooled itself) and, where the backend runs the layers pooled, where the
    sequences sit in the pool."""

    layout: LinearLayout
    rows: list[int] | None
    pooled: PooledRows | None
    pool: LinearStatePool | None


@dataclass(frozen=True)
class LinearSteps:
    """The step hook of Gated DeltaNet (blocks/base.py's `StepHook`): each step reads the
    sequences' row counts once and pools them where the backend can (`pooled_rows`); after
    the last layer every sequence's `LinearState` advances past its rows."""

    layout: LinearLayout

    def begin(self, ops: Ops, batch: ForwardBatch) -> LinearStep:
        # The layout the step's states were made with (the decoder's `linear_layout`, which
        # tests may narrow), else the spec's.
        layout = self.layout
        if batch.linear_states:
            layout = batch.linear_states[0].layout
        elif batch.state_pool is not None:
            layout = batch.state_pool.layout
        pooled, pool, rows = batch.pooled, batch.state_pool, None
        if pooled is None and batch.linear_states is not None:
            rows = batch.meta.cu_q.diff().tolist()
            pooled = pooled_rows(ops, batch.linear_states, rows, layout)
            pool = batch.linear_states[0].pool if pooled is not None else None
        return LinearStep(layout, rows, pooled, pool)

    def end(self, began: LinearStep, batch: ForwardBatch) -> None:
        if batch.linear_states is not None and began.rows is not None:
            for state, n in zip(batch.linear_states, began.rows, strict=True):
                state.advance(n)


def ungroup_projections(
    lin: LinearAttentionSpec, qkvz: torch.Tensor, ba: torch.Tensor
) -> list[torch.Tensor]:
    """Qwen3-Next's grouped input projections (module docstring) as the four projections
    [q | k | v, z, b, a], each in head order; rows are moved, never changed."""
    r = lin.num_value_heads // lin.num_key_heads
    kd, vd = lin.key_head_dim, r * lin.value_head_dim
    groups = qkvz.reshape(lin.num_key_heads, 2 * kd + 2 * vd, -1)
    q, k, v, z = groups.split([kd, kd, vd, vd], dim=1)
    b, a = ba.reshape(lin.num_key_heads, 2 * r, -1).split([r, r], dim=1)
    flat = [t.reshape(-1, qkvz.shape[-1]) for t in (q, k, v, z, b, a)]
    return [torch.cat(flat[:3]), *flat[3:]]


def shard_inputs(plan: ShardPlan, lin: LinearAttentionSpec, parts: list[torch.Tensor]
                 ) -> list[torch.Tensor]:  # fmt: skip
    """This rank's rows of the four input projections [q | k | v, z, b, a]: the q and k rows
    of its key heads, the v and z rows of its value heads, its value heads' b and a."""
    if plan.tp == 1:
        return parts
    qkv, z, b, a = parts
    return [qkv_channels(plan, lin, qkv), *_value_rows(plan, lin, [z, b, a])]


def qkv_channels(plan: ShardPlan, lin: LinearAttentionSpec, t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a tensor laid out by the convolution's channels q | k | v (the
    projection's rows, or the convolution's weight): q and k of its key heads, v of its
    value heads, in that order."""
    if plan.tp == 1:
        return t
    kd = lin.num_key_heads * lin.key_head_dim
    (k0, k1), (v0, v1) = plan.linear_key_heads, plan.linear_value_heads
    dk, dv = lin.key_head_dim, lin.value_head_dim
    return torch.cat([t[k0 * dk : k1 * dk], t[kd + k0 * dk : kd + k1 * dk],
                      t[2 * kd + v0 * dv : 2 * kd + v1 * dv]])  # fmt: skip


def _value_rows(
    plan: ShardPlan, lin: LinearAttentionSpec, parts: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Each part's rows of this rank's value heads (a part holds value_heads x n rows)."""
    v0, v1 = plan.linear_value_heads
    out = []
    for t in parts:
        per = t.shape[0] // lin.num_value_heads
        out.append(t[v0 * per : v1 * per])
    return out


@dataclass(frozen=True)
class GatedDeltaNet:
    """Gated DeltaNet over `ModelSpec.linear`'s shapes; `grouped`: Qwen3-Next's two grouped
    input projections instead of four."""

    grouped: bool = False

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

    def step_hook(self, spec: ModelSpec, device: torch.device) -> LinearSteps:
        return LinearSteps(LinearLayout.of(spec, device))

    def _inputs(self) -> tuple[str, ...]:
        if self.grouped:
            return ("in_proj_qkvz.weight", "in_proj_ba.weight")
        return ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")

    def weight_names(self, spec: ModelSpec) -> list[str]:
        leaves = (*self._inputs(), "conv1d.weight", "A_log", "dt_bias", "norm.weight",
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
            "in_proj_qkvz.weight": (lin.conv_dim + lin.value_dim, h),
            "in_proj_ba.weight": (2 * lin.num_value_heads, h),
            "conv1d.weight": (lin.conv_dim, 1, lin.conv_kernel),
            "A_log": (lin.num_value_heads,),
            "dt_bias": (lin.num_value_heads,),
            "norm.weight": (lin.value_head_dim,),
            "out_proj.weight": (h, lin.value_dim),
        }[name.removeprefix("linear_attn.")]

    def layout(self, spec: ModelSpec, layer: int, role: str) -> list[LayoutEntry]:
        g, t = f"model.layers.{layer}.linear_attn.", f"layers.{layer}.{role}."
        ins = [g + leaf for leaf in self._inputs()]
        entries = [LayoutEntry(t + "in_proj", "qkvz_ba" if self.grouped else "in_proj", ins)]
        entries += [LayoutEntry(t + field, kind, [g + leaf]) for leaf, field, kind in _SMALL]
        entries.append(LayoutEntry(t + "out_proj", "row_linear", [g + "out_proj.weight"]))
        return entries

    def prepare(
        self, entry: LayoutEntry, parts: list[torch.Tensor], context: PrepareContext
    ) -> Any:
        """Common kinds (blocks/prepare.py), "in_proj" (the four input projections fused),
        "qkvz_ba" (Qwen3-Next's grouped inputs reordered to q | k | v | z | b | a,
        `ungroup_projections`, then fused as one linear), "conv" (float32 [channels,
        kernel]) and "value_heads" (float32 [value heads]), each of this rank's heads."""
        if entry.kind not in ("in_proj", "qkvz_ba", "conv", "value_heads"):
            return prepare_common(entry, parts, context)
        lin, plan = context.spec.linear, context.parallel.plan
        assert lin is not None
        if entry.kind == "conv":
            weight = qkv_channels(plan, lin, parts[0]).to(context.device, torch.float32)
            return weight.reshape(weight.shape[0], -1).contiguous()
        if entry.kind == "value_heads":
            (rows,) = _value_rows(plan, lin, parts)
            return rows.to(device=context.device, dtype=torch.float32)
        if entry.kind == "qkvz_ba":
            parts = ungroup_projections(lin, parts[0], parts[1])
        return fused_linear(shard_inputs(plan, lin, parts), context)

    def build(self, parts: dict[str, Any], context: BuildContext) -> GatedDeltaNetWeights:
        return GatedDeltaNetWeights(
            **parts, state_index=context.cache_index, eps=context.spec.rms_norm_eps
        )

    def forward(
        self, ops: Ops, x: torch.Tensor, w: GatedDeltaNetWeights, step: Step
    ) -> torch.Tensor:
        s: LinearStep = step.mixer_steps[GatedDeltaNet]
        return gated_deltanet(ops, x, w, w.state_index, step.batch, s.layout, w.eps, s.rows,
                              s.pooled, s.pool, step.parallel)  # fmt: skip
