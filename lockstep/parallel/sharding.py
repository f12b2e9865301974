"""Which slice of every weight a tensor-parallel rank holds, and the fixed reduction chunks.

Megatron-style: qkv and gate-up are column-parallel (a rank holds whole heads and a range of
intermediate columns), o and down are row-parallel (a rank holds the matching input columns and
produces a partial sum over them), the embedding and the LM head are vocabulary-parallel.

The same bits at every degree: the K dimension of each row-parallel matmul is cut into
`CHUNKS` chunks at fixed places, the same at TP 1 as at TP 8, and every chunk's partial is
computed alone (the deterministic matmul over that chunk's columns only) and then added in one
fixed tree (`tree_sum`). A rank holds whole chunks, so where a chunk is computed never changes
its bits, and the tree never changes shape:

    o_proj input, H heads:    chunk c = heads [c*H//8, (c+1)*H//8)      (may be empty: H < 8)
    down_proj input, I cols:  chunk c = cols  [c*I//8, (c+1)*I//8)
    tree:                     ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)), an empty chunk
                              adds nothing (its node is the other operand)

    tp = 2, H = 32:  rank 0  heads 0-15  = chunks 0-3 | rank 1  heads 16-31 = chunks 4-7
    tp = 3, H = 9:   rank 0  heads 0-2   = chunks 0-2 | rank 1  heads 3-5 = chunks 3-5 | ...

A degree works when it divides the attention heads, divides the KV heads or is a multiple of
them (then each KV head is held, computed identically, by tp/Hkv ranks), and every rank's first
head is a chunk boundary (always so when the degree divides 8). `supported_degrees` lists them.

Mixture of experts (lockstep/parallel/experts.py). Under tensor parallelism every rank holds
every expert's slice of intermediate columns, cut at the same CHUNKS places as the dense MLP's
(`columns`), and the shared expert likewise. Under expert parallelism (`ep` = tp > 1) rank r
holds experts [r*E/ep, (r+1)*E/ep) whole (`experts`) and computes each of them exactly as
TP 1 does, chunks and tree included; attention and the dense and shared MLPs stay
tensor-parallel over the same ranks:

    E = 8, I = 40      chunks of I: 5 columns each
    tp 2:   rank 0  experts 0-7, columns 0-19  | rank 1  experts 0-7, columns 20-39
    ep 2:   rank 0  experts 0-3, columns 0-39  | rank 1  experts 4-7, columns 0-39

Gated DeltaNet (hybrid models, lockstep/models/blocks/gated_deltanet.py). A rank holds whole
linear-attention heads, key heads and the value heads they serve together (value head j reads
key head j // (Hv / Hk)): their q, k, v, z, b, a rows, their convolution channels, A_log and
dt_bias, and its sequences' recurrent states and open rows for those heads only. out_proj is
row-parallel over the value heads, chunked like o_proj over attention heads:

    Hk = 2, Hv = 4     tp 2:  rank 0  key head 0, value heads 0-1 = chunks 0-3
                              rank 1  key head 1, value heads 2-3 = chunks 4-7
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lockstep.config import MAX_TP
from lockstep.models.spec import ModelSpec

CHUNKS = MAX_TP  # reduction chunks of every row-parallel matmul: 8, the most ranks supported


def chunk_bounds(n: int) -> list[tuple[int, int]]:
    """The CHUNKS fixed [start, end) ranges of n units (heads or columns)."""
    return [(c * n // CHUNKS, (c + 1) * n // CHUNKS) for c in range(CHUNKS)]


def degree_problem(spec: ModelSpec, tp: int) -> str | None:
    """Why `tp` cannot shard `spec` (None when it can)."""
    h, hkv = spec.num_heads, spec.num_kv_heads
    if spec.hybrid and spec.fp8 is not None and tp > 1:
        return "FP8 hybrid (linear-attention) models run at tp=1 only"
    if spec.fp8 is not None and tp > 1 and spec.fp8.scheme != "block":
        return f"{spec.fp8.scheme}-scaled FP8 models run at tp=1 only (block-FP8 ones shard)"
    if not 1 <= tp <= MAX_TP:
        return f"expected 1..{MAX_TP}"
    if h % tp:
        return f"it does not divide the {h} attention heads"
    if hkv % tp and tp % hkv:
        return f"it neither divides nor is a multiple of the {hkv} KV heads"
    starts = {lo for lo, _ in chunk_bounds(h)}
    if any(r * h // tp not in starts for r in range(tp)):
        return f"its rank boundaries fall inside one of the {CHUNKS} reduction chunks"
    lin = spec.linear
    if lin is not None and tp > 1:
        if lin.num_key_heads % tp:
            return f"it does not divide the {lin.num_key_heads} linear-attention key heads"
        hv, starts = lin.num_value_heads, {lo for lo, _ in chunk_bounds(lin.num_value_heads)}
        if any(r * hv // tp not in starts for r in range(tp)):
            return (f"its rank boundaries fall inside one of the {CHUNKS} reduction chunks of "
                    f"the {hv} linear-attention value heads")  # fmt: skip
    if spec.fp8 is not None and tp > 1:
        problem = fp8_block_problem(spec, tp)
        if problem is not None:
            return problem
    moe = spec.moe
    if moe is not None:
        widths = [("expert", moe.intermediate_size), ("shared expert", moe.shared_expert_size)]
        for what, width in widths:
            spans = [_columns(width, tp, r) for r in range(tp)] if width else []
            empty = [r for r, (lo, hi) in enumerate(spans) if lo == hi]
            if empty:
                return f"the {what} width {width} leaves rank {empty[0]} no columns"
    return None


def fp8_block_problem(spec: ModelSpec, tp: int) -> str | None:
    """Where sharding a block-FP8 model over `tp` ranks would split one of its 128 x 128 scale
    blocks (None: nowhere). Every cut must fall on a block edge: each rank's first row of a
    column-parallel projection (its heads' q / k / v rows, its columns of gate / up) and every
    reduction chunk's first column of a row-parallel one (o by heads, down by columns), since a
    chunk's partial is an FP8 linear of its own, which quantizes its activation per 128-column
    group. The dimension and the cut are named, one line."""
    from lockstep.ops.fp8 import BLOCK  # here: lockstep.ops imports the models package

    mla, moe = spec.mla, spec.moe
    unit = spec.head_dim if mla is None else mla.v_head_dim
    q_rows = spec.head_dim if mla is None else mla.qk_head_dim
    cuts: list[tuple[str, int, list[int]]] = [
        ("the query rows", spec.num_heads * q_rows, [r * spec.num_heads // tp * q_rows
                                                     for r in range(tp)]),
        ("o_proj's input", spec.num_heads * unit, [lo * unit for lo, _ in chunk_bounds(
            spec.num_heads)]),
    ]  # fmt: skip
    if mla is None and tp <= spec.num_kv_heads:
        per = spec.num_kv_heads // tp
        cuts.append(("the key and value rows", spec.num_kv_heads * spec.head_dim,
                     [r * per * spec.head_dim for r in range(tp)]))  # fmt: skip
    widths = [("the MLP width", spec.intermediate_size)]
    if moe is not None:
        widths += [("the expert width", moe.intermediate_size),
                   ("the shared expert width", moe.shared_expert_size)]  # fmt: skip
    for what, width in widths:
        if width:
            cuts.append((what, width, [lo for lo, _ in chunk_bounds(width)]))
    for what, n, starts in cuts:
        bad = next((c for c in starts if c % BLOCK and c < n), None)
        if bad is not None:
            return (f"a shard would split an FP8 scale block: {what} ({n}) would be cut at "
                    f"{bad}, not a multiple of {BLOCK}")  # fmt: skip
    return None


def expert_problem(spec: ModelSpec, ep: int) -> str | None:
    """Why expert parallelism of degree `ep` cannot shard `spec` (None when it can)."""
    if ep == 1:
        return None
    if spec.moe is None:
        return "it has no routed experts (expert parallelism is for mixture-of-experts models)"
    if spec.moe.num_experts % ep:
        return f"it does not divide the {spec.moe.num_experts} routed experts"
    return None


def _columns(n: int, tp: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s columns of a row-parallel K of n units: its chunks' union."""
    bounds = chunk_bounds(n)
    return bounds[rank * CHUNKS // tp][0], bounds[(rank + 1) * CHUNKS // tp - 1][1]


def supported_degrees(spec: ModelSpec) -> list[int]:
    """Every tensor-parallel degree that shards `spec`."""
    return [tp for tp in range(1, MAX_TP + 1) if degree_problem(spec, tp) is None]


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `tp`: the heads, KV heads, intermediate columns and vocabulary rows it
    holds, and which reduction chunks it computes. Built only for a supported degree."""

    spec: ModelSpec
    tp: int
    rank: int
    ep: int = 1  # expert parallelism: 1, or tp (the experts spread over the same ranks)

    def __post_init__(self) -> None:
        problem = degree_problem(self.spec, self.tp)
        if problem is not None:
            raise ValueError(f"tp={self.tp} is invalid for this model: {problem}")
        if self.ep not in (1, self.tp):
            raise ValueError(f"ep={self.ep} is invalid with tp={self.tp}: expected 1 or {self.tp}")
        problem = expert_problem(self.spec, self.ep)
        if problem is not None:
            raise ValueError(f"ep={self.ep} is invalid for this model: {problem}")
        if not 0 <= self.rank < self.tp:
            raise ValueError(f"rank={self.rank} is invalid: expected 0..{self.tp - 1}")

    @property
    def heads(self) -> tuple[int, int]:
        per = self.spec.num_heads // self.tp
        return self.rank * per, (self.rank + 1) * per

    @property
    def kv_heads(self) -> tuple[int, int]:
        hkv, tp = self.spec.num_kv_heads, self.tp
        if tp <= hkv:
            per = hkv // tp
            return self.rank * per, (self.rank + 1) * per
        first = self.rank // (tp // hkv)  # replicated: tp/hkv ranks share each KV head
        return first, first + 1

    @property
    def kv_owner(self) -> bool:
        """Whether this rank is the first holder of its KV heads (the one read when the heads
        are gathered)."""
        hkv, tp = self.spec.num_kv_heads, self.tp
        return tp <= hkv or self.rank % (tp // hkv) == 0

    @property
    def num_local_kv_heads(self) -> int:
        lo, hi = self.kv_heads
        return hi - lo

    @property
    def linear_key_heads(self) -> tuple[int, int]:
        """This rank's Gated DeltaNet key heads [lo, hi) (a hybrid model's)."""
        assert self.spec.linear is not None
        per = self.spec.linear.num_key_heads // self.tp
        return self.rank * per, (self.rank + 1) * per

    @property
    def linear_value_heads(self) -> tuple[int, int]:
        """This rank's Gated DeltaNet value heads [lo, hi): those its key heads serve."""
        assert self.spec.linear is not None
        per = self.spec.linear.num_value_heads // self.tp
        return self.rank * per, (self.rank + 1) * per

    def linear_chunks(self) -> list[int]:
        """Chunk ids of a Gated DeltaNet out_proj input (value heads) on this rank."""
        assert self.spec.linear is not None
        lo, hi = self.linear_value_heads
        bounds = chunk_bounds(self.spec.linear.num_value_heads)
        return [c for c, (s, _) in enumerate(bounds) if lo <= s < hi]

    def attention_chunks(self) -> list[int]:
        """Chunk ids of the o_proj input on this rank (those starting in its heads)."""
        lo, hi = self.heads
        return [c for c, (s, _) in enumerate(chunk_bounds(self.spec.num_heads)) if lo <= s < hi]

    def mlp_chunks(self) -> list[int]:
        """Chunk ids of the down_proj input on this rank: chunks [r*8//tp, (r+1)*8//tp)."""
        return list(range(self.rank * CHUNKS // self.tp, (self.rank + 1) * CHUNKS // self.tp))

    def columns(self, n: int) -> tuple[int, int]:
        """This rank's columns [lo, hi) of a row-parallel K of n units (an MLP's
        intermediate width): the union of its mlp chunks."""
        return _columns(n, self.tp, self.rank)

    @property
    def intermediate(self) -> tuple[int, int]:
        """This rank's intermediate columns of the dense MLP."""
        return self.columns(self.spec.intermediate_size)

    @property
    def experts(self) -> tuple[int, int]:
        """The routed experts [lo, hi) this rank computes: all of them under tensor
        parallelism (a slice of each), its own share under expert parallelism."""
        assert self.spec.moe is not None
        e = self.spec.moe.num_experts
        if self.ep == 1:
            return 0, e
        return self.rank * e // self.ep, (self.rank + 1) * e // self.ep

    @property
    def expert_columns(self) -> tuple[int, int]:
        """The columns of each of its experts' intermediate width this rank holds: every
        column under expert parallelism, its chunks' under tensor parallelism."""
        assert self.spec.moe is not None
        width = self.spec.moe.intermediate_size
        return (0, width) if self.ep > 1 else self.columns(width)

    @property
    def shared_columns(self) -> tuple[int, int]:
        """This rank's columns of the shared expert's width (tensor-parallel always)."""
        assert self.spec.moe is not None
        return self.columns(self.spec.moe.shared_expert_size)

    def vocab_rows(self, rank: int | None = None) -> tuple[int, int]:
        """Vocabulary rows [lo, hi) of `rank` (default: this rank)."""
        r = self.rank if rank is None else rank
        v = self.spec.vocab_size
        return r * v // self.tp, (r + 1) * v // self.tp


def tree_sum(partials: list[torch.Tensor | None]) -> torch.Tensor:
    """The CHUNKS chunk partials (None: an empty chunk) added in the one fixed tree: adjacent
    pairs, level by level. Elementwise adds only, so every element is the same expression at
    every degree."""
    if len(partials) != CHUNKS:
        raise ValueError(f"tree_sum: {len(partials)} partials, expected {CHUNKS}")
    level = list(partials)
    while len(level) > 1:
        level = [_add(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    assert level[0] is not None, "every chunk is empty"
    return level[0]


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    if b is None:
        return a
    return a + b
