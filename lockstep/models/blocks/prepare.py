"""The preparations every block shares: how canonical tensors (lockstep/models/spec.py) become
the prepared weights a forward reads. A block's `prepare` handles its own kinds (fused q/k/v
with a gate, MLA's reordered and absorbed projections, Gated DeltaNet's convolution, stacked
experts) and hands the rest to `prepare_common`; the decoder prepares its norms, embedding
and LM head with `prepare_common` too.

Common kinds (`LayoutEntry.kind`):

    norm, bias      float32 (sources concatenated)
    norm1p          float32 plus one (the checkpoint stores w - 1: `ModelSpec.norm_style`)
    embed           as is, in the model dtype
    linear          rows concatenated, then `Ops.prepare_linear_weight` (each output element's
                    reduction is unchanged by the fusion)
    row_attention, row_mlp, row_shared   row-parallel (`TensorParallel.row_weight`): o_proj,
                    down_proj, a shared expert's down_proj
    fp8             an FP8 linear: its parts' weights, then their weight scales, then their
                    input scales ("tensor"), fused by `fuse_fp8`

Every kind but fp8 first keeps this rank's rows of its sources (`LayoutEntry.shard`); FP8
models run at tp 1 (lockstep/parallel/sharding.py), so FP8 kinds never shard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lockstep.errors import ModelLoadError
from lockstep.models.blocks.base import SHARDS, LayoutEntry, PrepareContext
from lockstep.ops.fp8 import BLOCK, Fp8Weight

if TYPE_CHECKING:
    from lockstep.ops.base import Ops
    from lockstep.parallel.sharding import ShardPlan


def prepare_common(entry: LayoutEntry, parts: list[torch.Tensor], context: PrepareContext) -> Any:
    """One entry of a common kind (module docstring) from its source tensors `parts`."""
    kind, spec, device = entry.kind, context.spec, context.device
    if kind == "fp8":
        assert spec.fp8 is not None
        return fuse_fp8(spec.fp8.scheme, parts, context.ops, device, entry.sources)
    parts = shard(context.parallel.plan, entry.shard, parts)
    if kind in ("norm", "bias"):
        return torch.cat(parts).to(device=device, dtype=torch.float32)
    if kind == "norm1p":
        return torch.cat(parts).to(device=device, dtype=torch.float32) + 1.0
    if kind == "embed":
        return concatenated(parts, context)
    if kind in ("row_attention", "row_mlp", "row_shared"):
        return context.parallel.row_weight(concatenated(parts, context), kind.removeprefix("row_"))
    if kind == "linear":
        return fused_linear(parts, context)
    raise ValueError(f"preparation kind {kind!r} of {entry.target} is not a common kind")


def concatenated(parts: list[torch.Tensor], context: PrepareContext) -> torch.Tensor:
    """`parts` concatenated by rows, in the model dtype on the device."""
    fused = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return fused.to(device=context.device, dtype=context.dtype)


def fused_linear(parts: list[torch.Tensor], context: PrepareContext) -> torch.Tensor:
    """One linear whose rows are `parts`' rows in order, prepared by the backend."""
    return context.ops.prepare_linear_weight(concatenated(parts, context).contiguous())


def fuse_fp8(
    scheme: str, parts: list[torch.Tensor], ops: Ops, device: torch.device, sources: list[str]
) -> Fp8Weight:
    """One FP8 linear from its parts' (weights, weight scales[, input scales]) in canonical
    form (spec.py), `sources` their names (for messages): weights and per-row or per-block
    scales concatenated by rows; a "tensor" part's scalar repeated over its rows; the parts'
    static input scales, which all see the same activation, merged into their maximum
    (docs/models.md). Block scales concatenate only where every part but the last has whole
    128-row blocks (else a scale row would cover two parts' rows): refused otherwise."""
    count = len(parts) // (3 if scheme == "tensor" else 2)
    weights, scales = parts[:count], parts[count : 2 * count]
    if scheme == "block" and count > 1:
        uneven = next((i for i, w in enumerate(weights[:-1]) if w.shape[0] % BLOCK), None)
        if uneven is not None:
            raise ModelLoadError(
                f"FP8 block scales cannot be fused: {sources[uneven]} has "
                f"{weights[uneven].shape[0]} rows, not a multiple of {BLOCK}, and is fused by "
                f"rows with {sources[uneven + 1]}; supported: fused parts of whole {BLOCK}-row "
                "blocks but the last"
            )
    if scheme == "tensor":
        scales = [s.reshape(1).expand(w.shape[0]) for w, s in zip(weights, scales, strict=True)]
    weight = torch.cat(weights, dim=0).to(device).contiguous()
    weight_scale = torch.cat(scales, dim=0).to(device=device, dtype=torch.float32).contiguous()
    input_scale = None
    if scheme == "tensor":
        input_scale = torch.stack([s.reshape(()) for s in parts[2 * count :]]).amax()
        input_scale = input_scale.to(device=device, dtype=torch.float32)
    return ops.prepare_fp8_linear(scheme, weight, weight_scale, input_scale)


def shard(plan: ShardPlan, rule: str, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's rows of an entry's sources, by the entry's shard `rule` (`LayoutEntry`)."""
    if rule not in SHARDS:
        raise ValueError(f"shard={rule!r} is invalid: expected one of {SHARDS}")
    if plan.tp == 1 or rule == "whole":
        return parts
    if rule == "heads":
        d = plan.spec.head_dim
        (h0, h1), (k0, k1) = plan.heads, plan.kv_heads
        q, k, v = parts
        return [q[h0 * d : h1 * d], k[k0 * d : k1 * d], v[k0 * d : k1 * d]]
    if rule == "shared":
        lo, hi = plan.shared_columns
    else:
        lo, hi = {"intermediate": plan.intermediate, "vocab": plan.vocab_rows()}[rule]
    return [p[lo:hi] for p in parts]
