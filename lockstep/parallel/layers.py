"""The parallel pieces of a forward step: row-parallel linears, the vocabulary-parallel
embedding and LM head. `TensorParallel` holds one rank's view (at TP 1 there are no
collectives and the same code runs).

Reductions of a row-parallel linear (`REDUCTIONS`):

    chunked     each of the CHUNKS chunks' partial alone, all-gathered, `tree_sum`: the same
                bits at every degree, TP 1 included (the deterministic default)
    ranks       one partial per rank, all-gathered, added in rank order: the same bits at one
                degree, different between degrees; at TP 1 the plain unchunked linear
    all_reduce  one partial per rank summed by the library's all-reduce (the negative
                control; reference mode's default); at TP 1 the plain unchunked linear

The vocabulary-parallel embedding and LM head move values, never add them: a token's
embedding row is taken from the rank that holds it, the logits are concatenated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lockstep.config import TP_REDUCTIONS
from lockstep.ops.base import Ops
from lockstep.parallel.collectives import Collectives
from lockstep.parallel.sharding import CHUNKS, ShardPlan, chunk_bounds, tree_sum

REDUCTIONS = TP_REDUCTIONS


def default_reduction(ops: Ops) -> str:
    """The reduction of a single-device decoder by default (EngineConfig.resolved_tp_reduction
    at tp=1): the one-call linear when deterministic, the library's when not."""
    return "ranks" if ops.deterministic else "all_reduce"


@dataclass(frozen=True)
class RowParallelWeight:
    """A row-parallel weight [N, K] on one rank: one prepared [N, cols] piece per reduction
    unit (a chunk under "chunked", the rank's whole input otherwise) and the local input
    columns [lo, hi) it multiplies; None for an empty chunk."""

    pieces: tuple[torch.Tensor | None, ...]
    bounds: tuple[tuple[int, int], ...]

    def copy_(self, other: RowParallelWeight) -> None:
        """Overwrite in place (the tensors keep their storage: CUDA graphs replay them)."""
        for mine, new in zip(self.pieces, other.pieces, strict=True):
            if mine is not None and new is not None:
                mine.copy_(new)


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
        plans = [ShardPlan(spec, plan.tp, r) for r in range(plan.tp)]
        head_bounds = chunk_bounds(spec.num_heads)
        # Per rank, its non-empty chunks in ascending order: the rows of its gathered stack.
        self._gathered_chunks = {
            "attention": [[c for c in p.attention_chunks() if head_bounds[c][0] < head_bounds[c][1]]
                          for p in plans],
            "mlp": [[c for c in p.mlp_chunks() if _nonempty(spec.intermediate_size, c)]
                    for p in plans],
        }  # fmt: skip
        self._vocab_rows = [plan.vocab_rows(r) for r in range(plan.tp)]

    @classmethod
    def single(cls, ops: Ops, plan: ShardPlan, reduction: str) -> TensorParallel:
        return cls(ops, plan, reduction, None)

    # ------------------------------------------------------------------ weights
    def row_weight(self, weight: torch.Tensor, kind: str) -> RowParallelWeight:
        """This rank's pieces of a full row-parallel weight [N, K]: `kind` "attention" (K is
        heads x head_dim, chunked by heads) or "mlp" (K is the intermediate size)."""
        plan, spec = self.plan, self.plan.spec
        if kind == "attention":
            unit, chunks = spec.head_dim, plan.attention_chunks()
            bounds = chunk_bounds(spec.num_heads)
            offset = plan.heads[0] * unit
        else:
            unit, chunks = 1, plan.mlp_chunks()
            bounds = chunk_bounds(spec.intermediate_size)
            offset = plan.intermediate[0]
        ranges = [(bounds[c][0] * unit, bounds[c][1] * unit) for c in chunks]
        if self.reduction != "chunked":
            ranges = [(ranges[0][0], ranges[-1][1])]
        pieces = tuple(
            None if lo == hi else self.ops.prepare_linear_weight(weight[:, lo:hi].contiguous())
            for lo, hi in ranges
        )
        return RowParallelWeight(pieces, tuple((lo - offset, hi - offset) for lo, hi in ranges))

    # ------------------------------------------------------------------ forward pieces
    def row_linear(self, x: torch.Tensor, weight: RowParallelWeight, kind: str) -> torch.Tensor:
        """x [T, local K] @ the full weight's rows, summed over every rank's columns, in x's
        dtype; identical on every rank."""
        ops, coll = self.ops, self.collectives
        if self.reduction != "chunked":
            (piece,) = weight.pieces
            assert piece is not None
            if coll is None:
                return ops.linear(x, piece)
            partial = ops.partial_linear(x, piece)
            if self.reduction == "all_reduce":
                return coll.all_reduce_sum(partial).to(x.dtype)
            parts = coll.all_gather(partial)
            total = parts[0]
            for part in parts[1:]:
                total = total + part
            return total.to(x.dtype)
        partials = [
            None if piece is None else ops.partial_linear(x[:, lo:hi], piece)
            for piece, (lo, hi) in zip(weight.pieces, weight.bounds, strict=True)
        ]
        if coll is None:
            return tree_sum(partials).to(x.dtype)
        local = [p for p in partials if p is not None]
        per_rank = self._gathered_chunks[kind]
        most = max(len(ids) for ids in per_rank)
        rows = (x.shape[0], local[0].shape[1]) if local else None
        assert rows is not None, "a rank with no work in a row-parallel layer"
        while len(local) < most:  # gather needs one shape on every rank
            local.append(torch.zeros(rows, dtype=torch.float32, device=x.device))
        gathered = coll.all_gather(torch.stack(local))
        full: list[torch.Tensor | None] = [None] * CHUNKS
        for stack, ids in zip(gathered, per_rank, strict=True):
            for j, c in enumerate(ids):
                full[c] = stack[j]
        return tree_sum(full).to(x.dtype)

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
