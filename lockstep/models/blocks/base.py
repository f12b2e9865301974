"""What every block (one part of a decoder layer: a mixer or an MLP) provides, and the helpers
blocks share.

A block is a small frozen dataclass holding only its variant flags (bias or not, q/k norm or
not, ...); the model's shapes come from the `ModelSpec` passed to each method. It owns:

    prefix                  its canonical names' part after "model.layers.{i}." ("self_attn")
    weight_names(spec)      its canonical tensors, relative to "model.layers.{i}.", in load order
    weight_shape(spec, n)   the shape of one of them
    layout(spec, i, role)   how those tensors become prepared weights: `LayoutEntry`s whose
                            target is "layers.{i}.{role}.{field}", with their preparation kind
                            and shard rule
    prepare(entry, parts, context)  one entry's prepared weight from its source tensors: the
                            block's own kinds, the common ones through blocks/prepare.py
    build(parts, context)   the layer's weights object from its prepared fields (by field name)
    forward(ops, x, w, step)  x [T, hidden] -> [T, hidden], this layer's part of one step
    requires                the op capabilities (lockstep/ops/base.py) its forward calls
    cache                   mixers only: "kv" (K/V per token, in the KV pool) or "state" (a
                            linear-attention state per sequence); `BuildContext.cache_index`
                            counts the layers before it with the same kind
    cache_bytes(spec, kv_heads, kv_dtype)  mixers only: the bytes that cache takes
                            (`CacheBytes`), which lockstep/engine/memory.py sums over layers
    step_hook(spec, device)  mixers only: a `StepHook` for a mixer whose layers share
                            per-step state beyond the KV pool (Gated DeltaNet's sequence
                            states), else None; the decoder calls it around each step

A block's forward must keep the contract of docs/design.md by itself: each
output row depends only on its own row and its own sequence's earlier tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from lockstep.errors import ModelLoadError
from lockstep.ops.fp8 import Fp8Weight

if TYPE_CHECKING:
    from lockstep.models.forward_batch import ForwardBatch
    from lockstep.models.spec import ModelSpec
    from lockstep.ops.base import Ops
    from lockstep.parallel.layers import TensorParallel
    from lockstep.parallel.sharding import ShardPlan

Linear = torch.Tensor | Fp8Weight  # a prepared linear weight, plain or FP8


SHARDS = ("whole", "heads", "intermediate", "shared", "vocab")


class LayoutEntry(NamedTuple):
    """One prepared weight: `target` ("layers.3.mixer.qkv", "embed"), the preparation `kind`
    (blocks/prepare.py's common kinds, or one its block's `prepare` knows), the canonical source tensors, in order, and which rows of
    them a tensor-parallel rank keeps (`shard`, lockstep/parallel/sharding.py's plan):

        whole         all of them (row-parallel kinds are cut later, by reduction chunks)
        heads         q | k | v sources: this rank's query heads' rows of q, KV heads' of k, v
        intermediate  each source's rows of this rank's intermediate columns
        shared        each source's rows of this rank's columns of the shared expert's width
        vocab         each source's rows of this rank's vocabulary slice
    """

    target: str
    kind: str
    sources: list[str]
    shard: str = "whole"


def linear(ops: Ops, x: torch.Tensor, w: Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) through the backend's plain or FP8 linear, by the weight's kind."""
    if isinstance(w, Fp8Weight):
        return ops.fp8_linear(x, w, bias)
    return ops.linear(x, w, bias)


def linear_entry(
    spec: ModelSpec, target: str, modules: list[str], shard: str = "whole"
) -> LayoutEntry:
    """The entry of one fused linear over `modules` (canonical module names): "linear" when
    none is FP8, "fp8" (weights, then weight scales, then input scales) when all are; a mix
    cannot share one matmul and is refused."""
    fp8 = [spec.is_fp8_linear(m) for m in modules]
    if not any(fp8):
        return LayoutEntry(target, "linear", [m + ".weight" for m in modules], shard)
    if not all(fp8):
        raise ModelLoadError(
            f"{modules[fp8.index(False)]} is not FP8 but {modules[fp8.index(True)]} is: "
            "projections fused into one matmul must share one format"
        )
    assert spec.fp8 is not None
    suffixes = [".weight", ".weight_scale"] + (
        [".input_scale"] if spec.fp8.scheme == "tensor" else []
    )
    return LayoutEntry(target, "fp8", [m + s for s in suffixes for m in modules], shard)


def row_linear_entry(spec: ModelSpec, target: str, module: str, kind: str) -> LayoutEntry:
    """A row-parallel linear (o_proj, down_proj), cut into reduction chunks ("row_attention",
    "row_mlp" or, a shared expert's down, "row_shared"); an FP8 one is "fp8_" + that kind
    (its "fp8" entry's sources: blocks/prepare.py)."""
    if spec.is_fp8_linear(module):
        entry = linear_entry(spec, target, [module])
        return entry._replace(kind="fp8_" + kind)
    return LayoutEntry(target, kind, [module + ".weight"])


@dataclass(frozen=True)
class BuildContext:
    """What a block's `build` may need beyond its prepared fields: the spec, this rank's shard
    plan, the RoPE tables (float32 [max_position, rotary_dim / 2]), where the layer's cache
    lives (its index among the K/V layers or among the linear-attention layers) and the
    layer's own index."""

    spec: ModelSpec
    plan: ShardPlan
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    cache_index: int
    layer: int  # the decoder layer's index


@dataclass(frozen=True)
class PrepareContext:
    """Where prepared weights go: the spec, this rank's tensor parallelism (its ops and shard
    plan), the model dtype and the device."""

    spec: ModelSpec
    parallel: TensorParallel
    dtype: torch.dtype
    device: torch.device

    @property
    def ops(self) -> Ops:
        return self.parallel.ops


class CacheBytes(NamedTuple):
    """What one layer's mixer keeps: `per_token` bytes in the KV pool for each cached token,
    and `per_snapshot` bytes of each state snapshot the radix cache keeps (in a pool of their
    own: lockstep/engine/memory.py; 0 for a mixer without state)."""

    per_token: int
    per_snapshot: int = 0


class KVStorage(Protocol):
    """K/V caches by K/V layer index (the KV pool, or a scratch cache), and the routing
    store beside them (lockstep/cache/routed_experts.py; None: routing is not kept)."""

    routed_experts: torch.Tensor | None

    def k_cache(self, layer: int) -> torch.Tensor: ...

    def v_cache(self, layer: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class Step:
    """One forward step as the blocks see it: the batch, the K/V caches, tensor parallelism
    (row-parallel reductions) and, by mixer type, what each mixer's `StepHook` began for this
    step (empty for a model whose mixers keep no state of their own)."""

    batch: ForwardBatch
    kv: KVStorage
    parallel: TensorParallel
    mixer_steps: Mapping[type, Any] = field(default_factory=dict)


class StepHook(Protocol):
    """Per-step work of a mixer whose layers share state beyond the KV pool: `begin` before
    the first layer (its result is `Step.mixer_steps[type(mixer)]`), `end` after the last."""

    def begin(self, ops: Ops, batch: ForwardBatch) -> Any: ...

    def end(self, began: Any, batch: ForwardBatch) -> None: ...


class Block(Protocol):
    """One part of a decoder layer (module docstring)."""

    prefix: str
    requires: tuple[type, ...]

    def weight_names(self, spec: ModelSpec) -> list[str]: ...

    def weight_shape(self, spec: ModelSpec, name: str) -> tuple[int, ...]: ...

    def layout(self, spec: ModelSpec, layer: int, role: str) -> list[LayoutEntry]: ...

    def prepare(
        self, entry: LayoutEntry, parts: list[torch.Tensor], context: PrepareContext
    ) -> Any: ...

    def build(self, parts: dict[str, Any], context: BuildContext) -> Any: ...

    def forward(self, ops: Ops, x: torch.Tensor, weights: Any, step: Step) -> torch.Tensor: ...


class Mixer(Block, Protocol):
    """A block that mixes positions (attention, linear attention), with the cache it keeps."""

    cache: str

    def cache_bytes(self, spec: ModelSpec, kv_heads: int, kv_dtype: torch.dtype) -> CacheBytes:
        """This layer's cache bytes with `kv_heads` KV heads (this rank's) in `kv_dtype`."""
        ...

    def step_hook(self, spec: ModelSpec, device: torch.device) -> StepHook | None:
        """The per-step hook of this kind of mixer (None: it needs none)."""
        ...
