"""The parallel pieces of a forward step: row-parallel linears, the vocabulary-parallel
embedding and LM head. `TensorParallel` holds one rank's view (at TP 1 there are no
collectives and the same code runs).

Reductions of a row-parallel linear (`REDUCTIONS`):

    chunked     each of the CHUNKS chunks' partial alone, added in `tree_sum` by one rank
                per row: the same bits at every degree, TP 1 included (the deterministic
                default); the partials are all-gathered (few rows) or sent by blocks of rows
                to the rank that adds them, whose sums are then all-gathered (many rows)
    ranks       one partial per rank, all-gathered, added in rank order: the same bits at one
                degree, different between degrees; at TP 1 the plain unchunked linear
    all_reduce  one partial per rank summed by the library's all-reduce (the negative
                control; reference mode's default); at TP 1 the plain unchunked linear

The vocabulary-parallel embedding and LM head move values, never add them: a token's
embedding row is taken from the rank that holds it, the logits are concatenated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from lockstep.config import TP_REDUCTIONS
from lockstep.ops.base import Ops
from lockstep.ops.fp8 import BLOCK, Fp8Weight
from lockstep.ops.moe import prepare_expert_weights
from lockstep.parallel.collectives import Collectives
from lockstep.parallel.sharding import CHUNKS, ShardPlan, chunk_bounds, tree_sum

REDUCTIONS = TP_REDUCTIONS
# A chunked reduction of at least this many rows per rank is added by blocks of rows
# (`TensorParallel.reduce_by_blocks`: fewer bytes, two collectives); fewer rows (decode)
# are gathered whole (one collective). The same bits either way.
SCATTER_ROWS_PER_RANK = 4
# What a row-parallel linear reduces over (`TensorParallel.row_width`).
ROW_KINDS = ("attention", "mlp", "expert", "shared", "linear")


def default_reduction(ops: Ops) -> str:
    """The reduction of a single-device decoder by default (EngineConfig.resolved_tp_reduction
    at tp=1): the one-call linear when deterministic, the library's when not."""
    return "ranks" if ops.deterministic else "all_reduce"


@dataclass(frozen=True)
class RowParallelWeight:
    """A row-parallel weight [N, K] on one rank: one prepared [N, cols] piece per reduction
    unit (a chunk under "chunked", the rank's whole input otherwise) and the local input
    columns [lo, hi) it multiplies; None for an empty chunk."""

    pieces: tuple[Any, ...]  # torch.Tensor, Fp8Weight or Fp8Experts; None: an empty chunk
    bounds: tuple[tuple[int, int], ...]

    def copy_(self, other: RowParallelWeight) -> None:
        """Overwrite in place (the tensors keep their storage: CUDA graphs replay them)."""
        for mine, new in zip(self.pieces, other.pieces, strict=True):
            if isinstance(mine, torch.Tensor) and isinstance(new, torch.Tensor):
                mine.copy_(new)
            elif mine is not None and new is not None:  # FP8: every tensor it holds
                for live, fresh in zip(mine.tensors(), new.tensors(), strict=True):
                    live.copy_(fresh)


class TensorParallel:
    """One rank's side of tensor parallelism (or the whole model at TP 1)."""

    def __init__(
        self, ops: Ops, plan: ShardPlan, reduction: str, collectives: Collectives | None
    ) -> None:
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction={reduction!r} is invalid: expected one of {REDUCTIONS}")
        if (collectives is None) != (plan.tp == 1):
            raise ValueError(f"tp={plan.tp} needs collectives exactly when tp > 1")
        self.ops = ops
        self.plan = plan
        self.reduction = reduction
        self.collectives = collectives
        spec = plan.spec
        plans = [ShardPlan(spec, plan.tp, r, plan.ep) for r in range(plan.tp)]
        head_bounds = chunk_bounds(spec.num_heads)
        # Per rank, its non-empty chunks in ascending order: the rows of its gathered stack.
        self._gathered_chunks = {
            "attention": [[c for c in p.attention_chunks() if head_bounds[c][0] < head_bounds[c][1]]
                          for p in plans],
        }  # fmt: skip
        if spec.linear is not None:  # Gated DeltaNet's out_proj, by value heads
            value_bounds = chunk_bounds(spec.linear.num_value_heads)
            self._gathered_chunks["linear"] = [
                [c for c in p.linear_chunks() if value_bounds[c][0] < value_bounds[c][1]]
                for p in plans
            ]
        for kind in ("mlp", "expert", "shared"):
            width = self.row_width(kind)
            self._gathered_chunks[kind] = [
                [c for c in p.mlp_chunks() if _nonempty(width, c)] for p in plans
            ]
        self._vocab_rows = [plan.vocab_rows(r) for r in range(plan.tp)]

    @classmethod
    def single(cls, ops: Ops, plan: ShardPlan, reduction: str) -> TensorParallel:
        return cls(ops, plan, reduction, None)

    # ------------------------------------------------------------------ weights
    def row_width(self, kind: str) -> int:
        """The units of K a row-parallel `kind` reduces over: heads ("attention"), the dense
        MLP's intermediate size ("mlp"), an expert's ("expert"), the shared expert's
        ("shared"), Gated DeltaNet's value heads ("linear")."""
        spec = self.plan.spec
        if kind == "attention":
            return spec.num_heads
        if kind == "linear":
            return 0 if spec.linear is None else spec.linear.num_value_heads
        if kind == "mlp":
            return spec.intermediate_size
        if kind not in ROW_KINDS:
            raise ValueError(f"row-parallel kind {kind!r}: expected one of {ROW_KINDS}")
        moe = spec.moe
        if moe is None:
            return 0
        return moe.intermediate_size if kind == "expert" else moe.shared_expert_size

    def row_ranges(self, kind: str) -> list[tuple[int, int]]:
        """This rank's reduction units of a row-parallel `kind`: [lo, hi) columns of the full
        K (`row_width` units times o_proj's columns per head), one per chunk it computes
        under "chunked" (empty chunks included), else one over all its columns. Under expert
        parallelism an expert's units are all CHUNKS chunks (its owner computes it whole)."""
        plan = self.plan
        bounds = chunk_bounds(self.row_width(kind))
        unit = 1
        if kind == "attention":
            # o_proj's input per head: head_dim, or MLA's value width.
            mla = plan.spec.mla
            unit = plan.spec.head_dim if mla is None else mla.v_head_dim
            chunks = plan.attention_chunks()
        elif kind == "linear":  # out_proj's input per value head: value_head_dim
            assert plan.spec.linear is not None
            unit = plan.spec.linear.value_head_dim
            chunks = plan.linear_chunks()
        elif kind == "expert" and plan.ep > 1:
            chunks = list(range(CHUNKS))
        else:
            chunks = plan.mlp_chunks()
        ranges = [(bounds[c][0] * unit, bounds[c][1] * unit) for c in chunks]
        if self.reduction != "chunked":
            ranges = [(ranges[0][0], ranges[-1][1])]
        return ranges

    def row_weight(self, weight: torch.Tensor, kind: str) -> RowParallelWeight:
        """This rank's pieces of a row-parallel weight [N, K] (`kind` "expert": stacked
        experts [E, N, K], every piece stacked alike): "attention" (K is heads x head_dim,
        chunked by heads), "linear" (K is value heads x value_head_dim), "mlp", "expert" or "shared" (K is that MLP's width). `weight`
        holds every column, or for "expert" this rank's columns (`ShardPlan.expert_columns`)."""
        ranges = self.row_ranges(kind)
        offset = ranges[0][0]  # the rank's first column: where its local input starts
        shift = offset if kind == "expert" else 0
        prepare = self.ops.prepare_linear_weight
        if weight.dim() == 3:
            prepare = partial(prepare_expert_weights, prepare)
        pieces = tuple(
            None if lo == hi else prepare(weight[..., lo - shift : hi - shift].contiguous())
            for lo, hi in ranges
        )
        return RowParallelWeight(pieces, tuple((lo - offset, hi - offset) for lo, hi in ranges))

    def fp8_row_weight(
        self, weight: torch.Tensor, scale: torch.Tensor, kind: str
    ) -> RowParallelWeight:
        """`row_weight` of a block-FP8 weight: e4m3 [N, K] with its block scales [ceil(N/128),
        ceil(K/128)], every column; each piece an FP8 linear of its columns and their scale
        columns (`fp8_block_problem` has checked that every cut falls on a block edge)."""
        ranges = self.row_ranges(kind)
        offset = ranges[0][0]
        pieces = tuple(
            None
            if lo == hi
            else self.ops.prepare_fp8_linear(
                "block", weight[:, lo:hi].contiguous(),
                scale[:, lo // BLOCK : -(-hi // BLOCK)].contiguous(), None,
            )
            for lo, hi in ranges
        )  # fmt: skip
        return RowParallelWeight(pieces, tuple((lo - offset, hi - offset) for lo, hi in ranges))

    # ------------------------------------------------------------------ forward pieces
    def row_linear(self, x: torch.Tensor, weight: RowParallelWeight, kind: str) -> torch.Tensor:
        """x [T, local K] @ the full weight's rows, summed over every rank's columns, in x's
        dtype; identical on every rank."""
        if self.reduction != "chunked" and self.collectives is None:
            (piece,) = weight.pieces
            assert piece is not None
            return self.ops.linear(x, piece)
        partials = [
            None if piece is None else self.partial(x[:, lo:hi], piece)
            for piece, (lo, hi) in zip(weight.pieces, weight.bounds, strict=True)
        ]
        return self.reduce(partials, kind).to(x.dtype)

    def partial(self, x: torch.Tensor, piece: torch.Tensor | Fp8Weight) -> torch.Tensor:
        """One reduction unit's float32 partial: `Ops.partial_linear`, or for a block-FP8
        piece its FP8 linear (the CPU backends': fp32 activations in, fp32 out, unrounded;
        FP8 pieces are built on the CPU only, lockstep/models/blocks/prepare.py)."""
        if isinstance(piece, Fp8Weight):
            return self.ops.fp8_linear(x, piece).float()
        return self.ops.partial_linear(x, piece)

    def reduce(self, partials: list[torch.Tensor | None], kind: str) -> torch.Tensor:
        """The float32 sum over every rank of a row-parallel `kind`'s partials [T, N]: this
        rank's, one per piece of its `RowParallelWeight` (None: an empty chunk), by the
        reduction (module docstring); identical on every rank. A collective: every rank
        calls it with the same T."""
        coll = self.collectives
        if self.reduction != "chunked":
            (only,) = partials
            assert only is not None
            if coll is None:
                return only
            if self.reduction == "all_reduce":
                return coll.all_reduce_sum(only)
            parts = coll.all_gather(only)
            total = parts[0]
            for part in parts[1:]:
                total = total + part
            return total
        if coll is None:
            return tree_sum(partials)
        stack, per_rank = self._local_stack(partials, kind)
        if stack.shape[1] >= SCATTER_ROWS_PER_RANK * coll.size:
            return self.reduce_by_blocks(partials, kind)
        full: list[torch.Tensor | None] = [None] * CHUNKS
        for gathered, ids in zip(coll.all_gather(stack), per_rank, strict=True):
            for j, c in enumerate(ids):
                full[c] = gathered[j]
        return tree_sum(full)

    def _local_stack(
        self, partials: list[torch.Tensor | None], kind: str
    ) -> tuple[torch.Tensor, list[list[int]]]:
        """This rank's non-empty chunk partials stacked [most, rows, ...] (zero-padded to the
        most any rank has: the collectives need one shape on every rank), and every rank's
        chunk ids, the rows of its stack."""
        local = [p for p in partials if p is not None]
        per_rank = self._gathered_chunks[kind]
        most = max(len(ids) for ids in per_rank)
        assert local, "a rank with no work in a row-parallel layer"
        while len(local) < most:
            local.append(torch.zeros_like(local[0]))
        return torch.stack(local), per_rank

    def reduce_by_blocks(
        self,
        partials: list[torch.Tensor | None],
        kind: str,
        finish: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`reduce` under "chunked" at tp > 1 by blocks of rows (partials [R, ...]): rank r
        receives every rank's chunk partials of its block of rows (an all-to-all), adds each
        element's CHUNKS partials in the tree, applies `finish(sums, lo, hi)` to its block
        (rows [lo, hi); default: none) and the blocks are all-gathered. Each element is the
        same tree of the same partials as on `reduce`'s gather path, so the bits do not
        depend on the path; for many rows at TP 8 it moves about a quarter of the bytes. A
        collective; every rank needs at least one row.

            rows    | block 0 | block 1 | ... |      block r: rows [r R / tp, (r+1) R / tp)
            rank q  sends its chunks' rows of block r to rank r; rank r adds them"""
        coll = self.collectives
        assert coll is not None and self.reduction == "chunked"
        stack, per_rank = self._local_stack(partials, kind)
        rows = stack.shape[1]
        blocks = [(r * rows // coll.size, (r + 1) * rows // coll.size) for r in range(coll.size)]
        tallest = max(hi - lo for lo, hi in blocks)
        send = stack.new_zeros((coll.size, stack.shape[0], tallest, *stack.shape[2:]))
        for r, (lo, hi) in enumerate(blocks):
            send[r, :, : hi - lo] = stack[:, lo:hi]
        received = coll.all_to_all(send)  # [q]: rank q's chunk partials of this rank's block
        lo, hi = blocks[coll.rank]
        full: list[torch.Tensor | None] = [None] * CHUNKS
        for q, ids in enumerate(per_rank):
            for j, c in enumerate(ids):
                full[c] = received[q, j, : hi - lo]
        done = tree_sum(full)
        if finish is not None:
            done = finish(done, lo, hi)
        mine = done.new_zeros((tallest, *done.shape[1:]))
        mine[: hi - lo] = done
        sums = coll.all_gather(mine)
        return torch.cat([s[: b - a] for s, (a, b) in zip(sums, blocks, strict=True)])

    def embed(self, token_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Embedding rows of `token_ids` from this rank's vocabulary rows `table`; each row
        is taken whole from the rank that holds it."""
        coll = self.collectives
        if coll is None:
            return table[token_ids]
        lo, hi = self._vocab_rows[self.plan.rank]
        local = table[(token_ids - lo).clamp(0, hi - lo - 1)]
        stacked = torch.stack(coll.all_gather(local))  # [tp, T, H]
        starts = torch.tensor([r[0] for r in self._vocab_rows], device=token_ids.device)
        owner = torch.searchsorted(starts, token_ids, right=True) - 1
        return stacked[owner, torch.arange(token_ids.shape[0], device=token_ids.device)]

    def logits(self, x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """float32 logits [R, vocab]: this rank's vocabulary rows `head`, concatenated with
        every other rank's."""
        local = self.ops.linear(x, head).float()
        coll = self.collectives
        if coll is None:
            return local
        widths = [hi - lo for lo, hi in self._vocab_rows]
        local = F.pad(local, (0, max(widths) - local.shape[1]))
        parts = coll.all_gather(local)
        return torch.cat([p[:, :w] for p, w in zip(parts, widths, strict=True)], dim=1)


def _nonempty(n: int, chunk: int) -> bool:
    lo, hi = chunk_bounds(n)[chunk]
    return lo < hi
