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
    row_attention, row_mlp, row_shared, row_linear   row-parallel
                    (`TensorParallel.row_weight`): o_proj, down_proj, a shared expert's
                    down_proj, Gated DeltaNet's out_proj
    fp8             an FP8 linear: its parts' weights, then their weight scales, then their
                    input scales ("tensor"), fused by `fuse_fp8`
    fp8_row_attention, fp8_row_mlp, fp8_row_shared   a block-FP8 row-parallel linear (weight,
                    block scales): pieces of `TensorParallel.fp8_row_weight` where
                    `fp8_pieces`, else one FP8 linear

Every kind first keeps this rank's rows of its sources (`LayoutEntry.shard`; FP8 scales with
their weights' rows: `shard_fp8`). Only block-FP8 models shard (lockstep/parallel/sharding.py,
`fp8_block_problem`).
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
        parts = shard_fp8(context.parallel.plan, entry.shard, spec.fp8.scheme, parts)
        return fuse_fp8(spec.fp8.scheme, parts, context.ops, device, entry.sources)
    if kind.startswith("fp8_row_"):
        assert spec.fp8 is not None
        if not fp8_pieces(context):
            return fuse_fp8(spec.fp8.scheme, parts, context.ops, device, entry.sources)
        weight, scale = (p.to(device) for p in parts)
        return context.parallel.fp8_row_weight(weight, scale.float(), kind.removeprefix("fp8_row_"))
    parts = shard(context.parallel.plan, entry.shard, parts)
    if kind in ("norm", "bias"):
        return torch.cat(parts).to(device=device, dtype=torch.float32)
    if kind == "norm1p":
        return torch.cat(parts).to(device=device, dtype=torch.float32) + 1.0
    if kind == "embed":
        return concatenated(parts, context)
    if kind in ("row_attention", "row_mlp", "row_shared", "row_linear"):
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
    if plan.tp == 1 or rule == "whole":
        return parts
    return [p[lo:hi] for p, (lo, hi) in zip(parts, _row_ranges(plan, rule, len(parts)),
                                            strict=True)]  # fmt: skip


def _row_ranges(plan: ShardPlan, rule: str, count: int) -> list[tuple[int, int]]:
    """The rows [lo, hi) this rank keeps of each of an entry's `count` sources."""
    if rule not in SHARDS:
        raise ValueError(f"shard={rule!r} is invalid: expected one of {SHARDS}")
    if rule == "heads":  # q | k | v
        d = plan.spec.head_dim
        (h0, h1), (k0, k1) = plan.heads, plan.kv_heads
        return [(h0 * d, h1 * d), (k0 * d, k1 * d), (k0 * d, k1 * d)]
    if rule == "shared":
        lo, hi = plan.shared_columns
    else:
        lo, hi = {"intermediate": plan.intermediate, "vocab": plan.vocab_rows()}[rule]
    return [(lo, hi)] * count


def shard_fp8(
    plan: ShardPlan, rule: str, scheme: str, parts: list[torch.Tensor]
) -> list[torch.Tensor]:
    """`shard` of an "fp8" entry's parts (weights, weight scales[, input scales]): each
    weight's rows, each block scale's rows of 128-row blocks (`fp8_block_problem` has checked
    that every cut falls on a block edge), each per-row scale's rows; input scales whole."""
    count = len(parts) // (3 if scheme == "tensor" else 2)
    if plan.tp == 1 or rule == "whole":
        return parts
    weights, scales, rest = parts[:count], parts[count : 2 * count], parts[2 * count :]
    ranges = _row_ranges(plan, rule, count)
    if scheme == "block":
        scales = [
            s[lo // BLOCK : -(-hi // BLOCK)] for s, (lo, hi) in zip(scales, ranges, strict=True)
        ]
    elif scheme == "channel":
        scales = [s[lo:hi] for s, (lo, hi) in zip(scales, ranges, strict=True)]
    return [w[lo:hi] for w, (lo, hi) in zip(weights, ranges, strict=True)] + scales + rest


def fp8_pieces(context: PrepareContext) -> bool:
    """Whether a block-FP8 row-parallel linear (or stacked experts) is cut into reduction
    pieces, each an FP8 linear of its own: at tp > 1, and at TP 1 under the chunked reduction
    for a model that shards at all (so that TP 1 gives the bits of the other degrees); on the
    CPU only, whose FP8 linear returns unrounded float32 partials (tp > 1 with FP8 on CUDA is
    refused: lockstep/engine/engine.py)."""
    from lockstep.parallel.sharding import supported_degrees

    parallel = context.parallel
    if context.device.type != "cpu" or context.spec.fp8 is None:
        return False
    if parallel.plan.tp > 1:
        return True
    return parallel.reduction == "chunked" and len(supported_degrees(context.spec)) > 1
