"""Grouped-query attention over the paged K/V cache, with its variants: q/k/v biases (Qwen2),
per-head q/k RMSNorm (Qwen3), an output gate and partial rotary embeddings (Qwen3.5's full
attention layers), a sliding window (Gemma 3's local layers: a row at position p sees keys
p - window + 1 .. p; every key stays in the cache, the window is a mask of the attention op).

Canonical tensors (after "model.layers.{i}.", H hidden, Q = heads x head_dim, KV = kv heads x
head_dim; an output-gated q_proj holds each head's query rows followed by its gate rows):

    self_attn.{q,k,v,o}_proj.weight   [Q (2Q gated), H], [KV, H], [KV, H], [H, Q]
    self_attn.{q,k,v}_proj.bias       [Q], [KV], [KV]   (bias only)
    self_attn.{q,k}_norm.weight       [head_dim]        (qk_norm only)

Prepared: one fused qkv linear (rows q | k | v, then the gate rows when gated), its fused
bias, the norms (float32, plus one where the family stores w - 1) and o, row-parallel.
New K/V are written to the cache before attention (`Ops.attention_input`), so prefix keys and
new keys are read from one layout; a row's output depends only on keys 0..p of its sequence.
An FP8 cache is written and read at the checkpoint's static per-layer k/v scales
(`ModelSpec.kv_cache_scales`; lockstep/ops/fp8.py, "FP8 KV cache").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from lockstep.models.blocks.base import (
    BuildContext,
    CacheBytes,
    LayoutEntry,
    Linear,
    PrepareContext,
    Step,
    linear,
    linear_entry,
    row_linear_entry,
)
from lockstep.models.blocks.prepare import fused_linear, prepare_common, shard
from lockstep.ops.base import (
    AttentionInput,
    DenseOps,
    GatedOutputOps,
    LayerKV,
    PagedAttentionOps,
)
from lockstep.ops.fp8 import E4M3, Fp8Weight
from lockstep.parallel.layers import RowParallelWeight

if TYPE_CHECKING:
    from lockstep.models.spec import ModelSpec
    from lockstep.ops.base import Ops


@dataclass
class AttentionWeights:
    """One attention layer, prepared: `qkv` rows q | k | v (| gate), `o` row-parallel (or FP8),
    the per-layer inputs of `Ops.attention_input`, the layer's index among the K/V layers, the
    number of gate rows at the end of qkv (0 without an output gate) and the checkpoint's
    static (k, v) scales of an FP8 cache (1.0, 1.0 without them)."""

    qkv: Linear
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear | RowParallelWeight
    attention_input: AttentionInput
    kv_index: int
    gate_rows: int
    scale: float
    kv_scales: tuple[float, float] = (1.0, 1.0)


@dataclass(frozen=True)
class Attention:
    """Causal attention, with q/k/v `bias`, per-head `qk_norm`, a sigmoid `output_gate` and a
    sliding `window` (None: every earlier key)."""

    bias: bool = False
    qk_norm: bool = False
    output_gate: bool = False
    window: int | None = None

    prefix: ClassVar[str] = "self_attn"
    cache: ClassVar[str] = "kv"  # K/V per token in the KV pool

    @property
    def requires(self) -> tuple[type, ...]:
        gate = (GatedOutputOps,) if self.output_gate else ()
        return (DenseOps, PagedAttentionOps, *gate)

    def cache_bytes(self, spec: ModelSpec, kv_heads: int, kv_dtype: torch.dtype) -> CacheBytes:
        """K and V of every cached token; a sliding-window layer keeps every key too (its
        window is a mask), so it costs what a global layer costs."""
        return CacheBytes(per_token=2 * kv_heads * spec.head_dim * kv_dtype.itemsize)

    def step_hook(self, spec: ModelSpec, device: torch.device) -> None:
        """None: its cache is the KV pool, which needs no per-step work."""
        return None

    def weight_names(self, spec: ModelSpec) -> list[str]:
        names = [f"self_attn.{p}_proj.weight" for p in "qkvo"]
        if self.bias:
            names += [f"self_attn.{p}_proj.bias" for p in "qkv"]
        if self.qk_norm:
            names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        return names

    def weight_shape(self, spec: ModelSpec, name: str) -> tuple[int, ...]:
        h, q, kv = spec.hidden_size, spec.q_size, spec.kv_size
        return {
            "self_attn.q_proj.weight": (2 * q if self.output_gate else q, h),
            "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q),
            "self_attn.q_proj.bias": (q,),
            "self_attn.k_proj.bias": (kv,),
            "self_attn.v_proj.bias": (kv,),
            "self_attn.q_norm.weight": (spec.head_dim,),
            "self_attn.k_norm.weight": (spec.head_dim,),
        }[name]

    def layout(self, spec: ModelSpec, layer: int, role: str) -> list[LayoutEntry]:
        a, t = f"model.layers.{layer}.self_attn.", f"layers.{layer}.{role}."
        if self.output_gate:
            qkv = LayoutEntry(
                t + "qkv", "qkv_gate", [a + f"{x}_proj.weight" for x in "qkv"], "heads"
            )
        else:
            qkv = linear_entry(spec, t + "qkv", [a + f"{x}_proj" for x in "qkv"], "heads")
        entries = [qkv]
        if self.bias:
            entries.append(
                LayoutEntry(t + "qkv_bias", "bias", [a + f"{x}_proj.bias" for x in "qkv"], "heads")
            )
        if self.qk_norm:
            entries.append(LayoutEntry(t + "q_norm", spec.norm_kind, [a + "q_norm.weight"]))
            entries.append(LayoutEntry(t + "k_norm", spec.norm_kind, [a + "k_norm.weight"]))
        entries.append(row_linear_entry(spec, t + "o", a + "o_proj", "row_attention"))
        return entries

    def prepare(
        self, entry: LayoutEntry, parts: list[torch.Tensor], context: PrepareContext
    ) -> Any:
        """Common kinds (blocks/prepare.py), and "qkv_gate": q_proj's per-head query and gate
        rows separated, q | k | v | gate, then fused as one linear."""
        if entry.kind != "qkv_gate":
            return prepare_common(entry, parts, context)
        spec, plan = context.spec, context.parallel.plan
        q, k, v = parts
        q_gate = q.reshape(spec.num_heads, 2, spec.head_dim, -1)
        query, gate = (q_gate[:, i].reshape(spec.q_size, -1) for i in (0, 1))
        # Separated first (q_proj interleaves them by head), then this rank's heads of each.
        query, k, v = shard(plan, entry.shard, [query, k, v])
        gate = gate[plan.heads[0] * spec.head_dim : plan.heads[1] * spec.head_dim]
        return fused_linear([query, k, v, gate], context)

    def build(self, parts: dict[str, Any], context: BuildContext) -> AttentionWeights:
        spec, plan = context.spec, context.plan
        local_heads = plan.heads[1] - plan.heads[0]
        q_norm, k_norm = parts.get("q_norm"), parts.get("k_norm")
        return AttentionWeights(
            qkv=parts["qkv"], qkv_bias=parts.get("qkv_bias"), q_norm=q_norm, k_norm=k_norm,
            o=parts["o"],
            attention_input=AttentionInput(local_heads, q_norm, k_norm, spec.rms_norm_eps,
                                           context.rope_cos, context.rope_sin),
            kv_index=context.cache_index,
            gate_rows=local_heads * spec.head_dim if self.output_gate else 0,
            scale=spec.attention_scale or 1.0 / math.sqrt(spec.head_dim),
            kv_scales=kv_cache_scales(spec, context.cache_index),
        )  # fmt: skip

    def forward(self, ops: Ops, x: torch.Tensor, w: AttentionWeights, step: Step) -> torch.Tensor:
        """K/V written to the cache, then causal attention, the output gate and o_proj."""
        batch = step.batch
        qkv = linear(ops, x, w.qkv, w.qkv_bias)
        gate = None
        if w.gate_rows:
            gate = qkv[:, -w.gate_rows :].contiguous()
            qkv = qkv[:, : -w.gate_rows].contiguous()
        k_cache, v_cache = step.kv.k_cache(w.kv_index), step.kv.v_cache(w.kv_index)
        # The scales belong to an FP8 cache; a cache of the model dtype holds values as they are.
        scales = w.kv_scales if k_cache.dtype == E4M3 else (1.0, 1.0)
        layer_kv = LayerKV(k_cache, v_cache, *scales)
        q = ops.attention_input(qkv, w.attention_input, batch.positions, batch.out_slots, layer_kv)
        o = ops.attention(q, layer_kv, batch.meta, w.scale, self.window)
        o = o.reshape(batch.num_tokens, -1)
        if gate is not None:
            o = ops.gate_activation(o, gate, "sigmoid")
        if isinstance(w.o, Fp8Weight):
            return linear(ops, o, w.o)
        return step.parallel.row_linear(o, w.o, "attention")


def kv_cache_scales(spec: ModelSpec, cache_index: int) -> tuple[float, float]:
    """The (k, v) FP8 cache scales of the `cache_index`-th K/V layer: the checkpoint's
    (`ModelSpec.kv_cache_scales`), or (1.0, 1.0) without them."""
    scales = spec.kv_cache_scales
    if scales is None:
        return (1.0, 1.0)
    return (scales.k[cache_index], scales.v[cache_index])
