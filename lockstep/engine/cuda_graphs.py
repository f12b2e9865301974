"""CUDA graphs for decode steps: one graph per (batch bucket, context bucket), same bits as eager.

A decode step (every sequence adds exactly one token) is captured the first time its bucket is
seen and replayed afterwards with the step's values copied into the graph's static inputs.
Why a replay gives the bits of an eager step:

  * Graphs hold the same kernels with the same configs: the config tables are keyed by shape,
    and a bucket's shapes are what eager would see for that many rows.
  * Every kernel of the deterministic backend computes a row independently of the number of
    rows and of its batch-mates, so padding b sequences up to a bucket of B changes no real row.
  * Padding rows are copies of row 0 (token, position, output slot, keys), so they compute row
    0's values bit for bit and write the very same K/V bits into row 0's slot.
  * The context bucket only sets how many key splits the attention grid has; splits past a
    sequence's end are empty programs (DESIGN.md: keys at absolute positions).

The first step of a bucket runs eagerly on the static buffers (warm-up and Triton compilation),
then is captured and replayed; the eager run writes exactly the K/V the replay writes again.
All graphs share one memory pool; they never run concurrently.

    static inputs of bucket (B, C)       filled from a step of b <= B sequences
    token_ids, positions, out_slots [B]  real rows 0..b-1, then copies of row 0
    q_start, kv_len [B], cu_q = 0..B     (one query per sequence)
    cu_kv [B+1]                          start of each sequence's slots (padding: row 0's)
    slot_table [B*C]                     the step's concatenated slot tables, then unused
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from lockstep.engine.forward_batch import ForwardBatch
from lockstep.models.decoder import Decoder, KVStorage
from lockstep.ops.base import AttentionMeta

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
DEFAULT_CONTEXT_BUCKETS = (2048, 8192, 32768, 131072)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch  # static inputs
    logits: torch.Tensor  # static output [B, vocab]


class DecodeGraphRunner:
    """Runs decode steps of up to `max_batch` sequences and `max_context` keys from graphs.

    Use: `if runner.can_run(batch): logits = runner.run(batch)` (else run eagerly); the
    returned logits are a fresh tensor of `batch.logit_rows`, as `Decoder.forward` returns."""

    def __init__(
        self,
        decoder: Decoder,
        kv: KVStorage,
        max_batch: int,
        max_context: int,
        batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS,
        context_buckets: tuple[int, ...] = DEFAULT_CONTEXT_BUCKETS,
    ) -> None:
        if decoder.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA decoder, got device={decoder.device}")
        if max_batch < 1 or max_context < 1:
            raise ValueError(f"max_batch={max_batch} and max_context={max_context} must be >= 1")
        self.decoder = decoder
        self.kv = kv
        self.device = decoder.device
        self.batch_buckets = sorted({b for b in batch_buckets if b < max_batch} | {max_batch})
        self.context_buckets = sorted(
            {c for c in context_buckets if c < max_context} | {max_context}
        )
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()

    @property
    def max_batch(self) -> int:
        return self.batch_buckets[-1]

    @property
    def max_context(self) -> int:
        return self.context_buckets[-1]

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def can_run(self, batch: ForwardBatch) -> bool:
        """A pure decode step that fits the largest buckets."""
        meta = batch.meta
        b = meta.num_seqs
        return (
            0 < b <= self.max_batch
            and meta.max_q == 1
            and batch.num_tokens == b
            and meta.max_kv <= self.max_context
        )

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        if not self.can_run(batch):
            raise ValueError(
                f"not a graph-sized decode step: {batch.meta.num_seqs} sequences (max "
                f"{self.max_batch}), max_q={batch.meta.max_q} (need 1), "
                f"max_kv={batch.meta.max_kv} (max {self.max_context})"
            )
        meta = batch.meta
        bb = self.batch_buckets[bisect.bisect_left(self.batch_buckets, meta.num_seqs)]
        cb = self.context_buckets[bisect.bisect_left(self.context_buckets, meta.max_kv)]
        entry = self._graphs.get((bb, cb))
        if entry is None:
            entry = self._capture(batch, bb, cb)
            self._graphs[(bb, cb)] = entry
        else:
            _fill(entry.batch, batch)
            entry.graph.replay()
        rows = batch.logit_rows.to(self.device, non_blocking=True)
        return entry.logits.index_select(0, rows)

    def _capture(self, batch: ForwardBatch, bb: int, cb: int) -> _Graph:
        static = _static_batch(bb, cb, self.device)
        _fill(static, batch)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            # Warm-up: compiles the kernels and writes this step's K/V (the replay writes the
            # same bits again).
            self.decoder.forward(static, self.kv)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.decoder.forward(static, self.kv)
        graph.replay()
        return _Graph(graph, static, logits)


def _static_batch(bb: int, cb: int, device: torch.device) -> ForwardBatch:
    i32, i64 = torch.int32, torch.int64
    meta = AttentionMeta(
        cu_q=torch.arange(bb + 1, dtype=i32, device=device),
        q_start=torch.zeros(bb, dtype=i32, device=device),
        kv_len=torch.ones(bb, dtype=i32, device=device),
        cu_kv=torch.zeros(bb + 1, dtype=i32, device=device),
        slot_table=torch.zeros(bb * cb, dtype=i32, device=device),
        max_q=1,
        max_kv=cb,
    )
    return ForwardBatch(
        token_ids=torch.zeros(bb, dtype=i64, device=device),
        positions=torch.zeros(bb, dtype=i64, device=device),
        out_slots=torch.zeros(bb, dtype=i64, device=device),
        meta=meta,
        logit_rows=torch.arange(bb, dtype=i64, device=device),
    )


def _pad(src: torch.Tensor, n: int) -> torch.Tensor:
    """src [b] -> [n]: padding rows repeat row 0."""
    extra = n - src.shape[0]
    return src if extra == 0 else torch.cat([src, src[:1].expand(extra)])


def _fill(static: ForwardBatch, batch: ForwardBatch) -> None:
    bb = static.num_tokens
    meta, smeta = batch.meta, static.meta
    static.token_ids.copy_(_pad(batch.token_ids, bb), non_blocking=True)
    static.positions.copy_(_pad(batch.positions, bb), non_blocking=True)
    static.out_slots.copy_(_pad(batch.out_slots, bb), non_blocking=True)
    smeta.q_start.copy_(_pad(meta.q_start, bb), non_blocking=True)
    smeta.kv_len.copy_(_pad(meta.kv_len, bb), non_blocking=True)
    # Padding sequences start at row 0's slots; the last entry (total) is never a start.
    smeta.cu_kv.copy_(torch.cat([_pad(meta.cu_kv[:-1], bb), meta.cu_kv[-1:]]), non_blocking=True)
    total = meta.slot_table.shape[0]
    smeta.slot_table[:total].copy_(meta.slot_table, non_blocking=True)
