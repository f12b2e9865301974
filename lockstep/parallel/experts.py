"""The routed experts of a mixture-of-experts layer under tensor or expert parallelism, with
the bits of TP 1's chunked reduction at every degree (docs/design.md, "Tensor parallelism").

The router is replicated and a layer's input x is the same on every rank, so every rank routes
every token alike (`Ops.moe_route`). Then, for each (token, rank) slot s of expert e:

    act_s  = silu_mul(x_t @ gate_up_e.T)             per column: the same bits at any degree
    p_s,c  = act_s[chunk c] @ down_e[:, chunk c].T    c = 0..CHUNKS-1, each alone, fp32
    y_s    = tree_sum(p_s,0, ..., p_s,7)              the dense down projection's fixed tree
    out_t  = w_t0 y_t0 + w_t1 y_t1 + ...              ascending rank, fp32 (y rounded to x's
                                                      dtype first), on every rank

Who computes what (lockstep/parallel/sharding.py, `ShardPlan.experts`, `expert_columns`):

    tensor parallel   every rank holds its chunks' columns of every expert and computes the
                      p_s,c of its chunks for every slot; `TensorParallel.reduce` adds each
                      slot's CHUNKS partials in the tree (few tokens: all gathered, every
                      rank adds; at least 4 tokens a rank: `reduce_by_blocks` sends each
                      rank its block of tokens' partials, that rank adds and combines them,
                      and the tokens' outputs are gathered)
    expert parallel   the owner of e holds it whole and computes y_s itself, tree included;
                      the owners' rows are all-gathered (each rank's slots packed, padded to
                      the largest count) and each slot takes its owner's row: a copy, so
                      nothing is added across ranks

Either way y_s is the same expression as at TP 1, so the output is. Other reductions (the
negative controls and reference mode, lockstep/parallel/layers.py): under tensor parallelism as the
dense MLP's; under expert parallelism "ranks" has the owner run one linear over the whole
width (TP 1's default arithmetic) and "all_reduce" has each rank combine its own slots and the
library's SUM add the ranks' combinations, the usual expert-parallel combine, whose order of
adding a token's k outputs follows where its experts live.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from lockstep.ops.fp8 import BLOCK
from lockstep.ops.moe import (
    Fp8Experts,
    MoeLayer,
    combine_in_rank_order,
    prepare_fp8_experts,
    write_routed_experts,
)
from lockstep.parallel.layers import SCATTER_ROWS_PER_RANK, RowParallelWeight, TensorParallel
from lockstep.parallel.sharding import ShardPlan, tree_sum


def sharded_experts(parallel: TensorParallel) -> bool:
    """Whether a layer's routed experts run here rather than in `Ops.moe`: at any degree
    above 1, and at TP 1 under the chunked reduction (so that TP 1 gives TP 8's bits)."""
    return parallel.plan.tp > 1 or parallel.reduction == "chunked"


def expert_gate_up_rows(plan: ShardPlan, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's part of the gate and up sources (expert-major, gate then up, [I, H] each):
    its experts, and of each its rows of `expert_columns`."""
    lo, hi = plan.experts
    c0, c1 = plan.expert_columns
    return [p[c0:c1] for p in parts[2 * lo : 2 * hi]]


def expert_down_columns(plan: ShardPlan, parts: list[torch.Tensor]) -> torch.Tensor:
    """This rank's part of the down sources ([H, I] each, by expert), stacked: its experts,
    and of each its columns of `expert_columns`, [local experts, H, local columns]."""
    lo, hi = plan.experts
    c0, c1 = plan.expert_columns
    return torch.stack([p[:, c0:c1] for p in parts[lo:hi]])


def sharded_fp8_experts(
    parallel: TensorParallel, target: str, weights: list[torch.Tensor], scales: list[torch.Tensor]
) -> Fp8Experts | RowParallelWeight:
    """Block-FP8 experts cut as `expert_gate_up_rows` and `expert_down_columns` cut plain ones:
    e4m3 `weights` and their fp32 block `scales` (expert-major, as the layout lists them),
    each scale cut with its weight's rows or columns (every cut on a 128 edge:
    `fp8_block_problem`). gate_up: one `Fp8Experts` of this rank's experts and rows; down: a
    `RowParallelWeight` whose pieces are `Fp8Experts` of each reduction unit's columns."""
    plan, ops = parallel.plan, parallel.ops
    lo, hi = plan.experts
    c0, c1 = plan.expert_columns
    if not target.endswith("experts_down"):
        mine_w = [w[c0:c1] for w in weights[2 * lo : 2 * hi]]
        mine_s = [s[c0 // BLOCK : -(-c1 // BLOCK)] for s in scales[2 * lo : 2 * hi]]
        return prepare_fp8_experts(ops.prepare_fp8_linear, mine_w, mine_s, hi - lo)
    ranges = parallel.row_ranges("expert")
    pieces = tuple(
        None
        if a == b
        else prepare_fp8_experts(
            ops.prepare_fp8_linear, [w[:, a:b].contiguous() for w in weights[lo:hi]],
            [s[:, a // BLOCK : -(-b // BLOCK)].contiguous() for s in scales[lo:hi]], hi - lo,
        )
        for a, b in ranges
    )  # fmt: skip
    first = ranges[0][0]
    return RowParallelWeight(pieces, tuple((a - first, b - first) for a, b in ranges))


def sharded_moe(
    parallel: TensorParallel,
    x: torch.Tensor,
    layer: MoeLayer,
    down: RowParallelWeight,
    routed_experts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts' output [T, H] in x's dtype, identical on every rank (module
    docstring). `layer`: the router, the routing parameters and this rank's gate_up
    [local experts, 2 x local columns, K']; `down`: this rank's down pieces (stacked over its
    experts). `routed_experts`: as `Ops.moe`'s. A collective: every rank calls it."""
    ops, plan = parallel.ops, parallel.plan
    fp8 = any(isinstance(piece, Fp8Experts) for piece in down.pieces)
    # Block-FP8 experts (the CPU's dequantized weights): the FP8 expert linear, whose fp32
    # output is the unrounded partial.
    expert_linear = ops.fp8_expert_linear if fp8 else ops.linear  # type: ignore[attr-defined]
    experts, weights = ops.moe_route(x, layer)
    write_routed_experts(routed_experts, experts)
    t, k = experts.shape
    hidden = x.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, ascending within
    counts = torch.bincount(flat, minlength=layer.router.shape[0]).tolist()
    first, last = plan.experts
    starts = [0, *accumulate(counts)]  # expert e's slots: order[starts[e] : starts[e + 1]]
    mine = order[starts[first] : starts[last]]  # the slots of this rank's experts, by expert
    partials: list[torch.Tensor | None] = [
        None if piece is None else torch.zeros(len(mine), hidden, device=x.device)
        for piece in down.pieces
    ]
    for e in range(first, last):
        if not counts[e]:
            continue
        at = slice(starts[e] - starts[first], starts[e + 1] - starts[first])
        rows = x.index_select(0, torch.div(mine[at], k, rounding_mode="floor"))
        act = ops.silu_mul(expert_linear(rows, layer.gate_up[e - first]))
        for out, piece, (lo, hi) in zip(partials, down.pieces, down.bounds, strict=True):
            if out is not None and piece is not None:
                if fp8:
                    out[at] = expert_linear(act[:, lo:hi].contiguous(), piece.weight[e - first])
                else:
                    out[at] = ops.partial_linear(act[:, lo:hi], piece[e - first])
    many = t >= SCATTER_ROWS_PER_RANK * plan.tp
    if plan.ep == 1 and plan.tp > 1 and parallel.reduction == "chunked" and many:
        # Blocks of tokens: each block's rank adds its slots' partials in the tree and
        # combines them, so a token's sum travels instead of its k slots.
        inv = torch.argsort(order)
        by_token = [None if p is None else p[inv].view(t, k, hidden) for p in partials]

        def combine(y: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
            return combine_in_rank_order(y.to(x.dtype), weights[lo:hi])

        return parallel.reduce_by_blocks(by_token, "expert", combine).to(x.dtype)
    if plan.ep == 1:  # every rank has every slot's partials over its columns
        y = parallel.reduce(partials, "expert")[torch.argsort(order)]
    elif parallel.reduction == "all_reduce":  # combined per rank, then summed across ranks
        return _summed_combination(parallel, order, starts, partials, weights).to(x.dtype)
    else:
        y = _gather_owned(parallel, order, starts, partials)
    return combine_in_rank_order(y.to(x.dtype).view(t, k, hidden), weights).to(x.dtype)


def _owned_rows(parallel: TensorParallel, partials: list[torch.Tensor | None]) -> torch.Tensor:
    """This rank's slots' expert outputs y (fp32): its chunk partials in the tree, or the one
    partial of the whole width."""
    if parallel.reduction == "chunked":
        return tree_sum(partials)
    (only,) = partials
    assert only is not None
    return only


def _gather_owned(
    parallel: TensorParallel,
    order: torch.Tensor,
    starts: list[int],
    partials: list[torch.Tensor | None],
) -> torch.Tensor:
    """Every slot's y [T*k, H], each row its owner's (expert parallelism)."""
    coll, plan = parallel.collectives, parallel.plan
    assert coll is not None
    owned = _owned_rows(parallel, partials)
    spans = [ShardPlan(plan.spec, plan.tp, r, plan.ep).experts for r in range(plan.tp)]
    sizes = [starts[hi] - starts[lo] for lo, hi in spans]
    # One shape on every rank (at least a row: a gather of empty tensors is not portable).
    padded = torch.zeros(max(*sizes, 1), owned.shape[1], dtype=owned.dtype, device=owned.device)
    padded[: owned.shape[0]] = owned
    y = torch.empty(order.shape[0], owned.shape[1], dtype=owned.dtype, device=owned.device)
    for (lo, hi), size, rows in zip(spans, sizes, coll.all_gather(padded), strict=True):
        y.index_copy_(0, order[starts[lo] : starts[hi]], rows[:size])
    return y


def _summed_combination(
    parallel: TensorParallel,
    order: torch.Tensor,
    starts: list[int],
    partials: list[torch.Tensor | None],
    weights: torch.Tensor,
) -> torch.Tensor:
    """Expert parallelism under "all_reduce": each rank combines its own slots (the others
    weigh 0) and the library's SUM adds the ranks' combinations."""
    t, k = weights.shape
    coll, plan = parallel.collectives, parallel.plan
    assert coll is not None
    owned = _owned_rows(parallel, partials)
    first, last = plan.experts
    y = torch.zeros(t * k, owned.shape[1], dtype=owned.dtype, device=owned.device)
    y.index_copy_(0, order[starts[first] : starts[last]], owned)
    mask = torch.zeros(t * k, dtype=weights.dtype, device=weights.device)
    mask[order[starts[first] : starts[last]]] = 1
    local = combine_in_rank_order(y.view(t, k, -1), weights * mask.view(t, k))
    return coll.all_reduce_sum(local)


__all__ = ["expert_down_columns", "expert_gate_up_rows", "sharded_experts",
           "sharded_fp8_experts", "sharded_moe"]  # fmt: skip
