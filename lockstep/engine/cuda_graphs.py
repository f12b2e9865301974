"""CUDA graphs for decode steps: one graph per (batch bucket, context bucket), same bits as eager.

A decode step (every sequence adds exactly one token) is captured the first time its bucket is
seen and replayed afterwards with the step's values copied into the graph's static inputs.
Why a replay gives the bits of an eager step:

  * Graphs hold the same kernels with the same configs: the config tables are keyed by shape,
    and a bucket's shapes are what eager would see for that many rows.
  * Every kernel of the deterministic backend computes a row independently of the number of
    rows and of its batch-mates, so padding b sequences up to a bucket of B changes no real row.
  * Padding rows are copies of row 0 (token, position, output slot, keys), so they compute row
    0's values bit for bit and write the very same K/V bits into row 0's slot. A hybrid model's
    padding rows would run row 0's recurrence from another state: they write the state pool's
    scratch slot and a spare KV row instead (`_StaticInputs.fill`).
  * The context bucket (the attention's max_kv) and the batch bucket only pick the decode
    attention's path (fold or split, `decode_path`: speed only, the same bits) and size the
    split path's grid, whose splits past a sequence's end are empty programs (docs/design.md: keys
    at absolute positions). Buckets start above one split, so a graph may take the split path
    where the eager step folded: the same bits either way.

Verify steps (exact speculative decoding: every sequence adds the same number Q > 1 of rows,
its last token and Q - 1 drafts) replay graphs too, keyed by Q beside the two buckets, when the
runner is built with `verify_graphs` (models whose mixers are all paged attention, no linear
states). The same argument holds per sequence: a padding sequence repeats sequence 0's Q rows
(tokens, positions, output slots, q_start, keys), so it computes sequence 0's rows bit for bit
and writes the same K/V bits into the same slots; every row's logits are computed. A chunk of
Q rows takes the attention path an eager step of that chunk takes (prefill tiles above
`split_path_max_q`, decode tiles below), the path again chosen for speed only. The graph's
rows, B x Q, stay within the runner's output buffer (B x Q <= max_batch).

The first step of a bucket runs eagerly on the static buffers (warm-up and Triton compilation),
then is captured and replayed; the eager run writes exactly the K/V the replay writes again.
All graphs share one memory pool and one output buffer; they never run concurrently.

    static inputs of bucket (B, C, Q)    filled from a step of b <= B sequences of Q rows
    token_ids, positions, out_slots [BQ] real rows 0..bQ-1, then copies of sequence 0's Q
    q_start, kv_len [B]                  (padding sequences: sequence 0's)
    cu_q = 0, Q, .., BQ [B+1]            (Q queries per sequence; Q = 1 for decode)
    cu_kv [B+1]                          start of each sequence's slots (padding: row 0's)
    slot_table [B*C]                     the step's concatenated slot tables, then unused
    logit_rows [BQ]                      0..BQ-1 (the graph computes every row's logits)

The int64 inputs are views of one device buffer and the int32 inputs of another, filled from
one pinned staging area shared by all buckets by asynchronous transfers: three per step,
none of which waits for the host (small pageable copies would each be a host round trip).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from lockstep.models.decoder import Decoder, KVStorage
from lockstep.models.forward_batch import ForwardBatch
from lockstep.models.linear_attention import LinearStatePool
from lockstep.ops.base import AttentionMeta, PooledRows

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
DEFAULT_CONTEXT_BUCKETS = (2048, 8192, 32768, 131072)
# Past the table's last batch bucket, one bucket every this many sequences, so a large
# max_running pads a step by at most this many rows.
BATCH_BUCKET_STEP = 256


def graph_batch_buckets(
    max_batch: int, table: tuple[int, ...] = DEFAULT_BATCH_BUCKETS
) -> list[int]:
    """The batch buckets of a runner for up to `max_batch` sequences: the table's below it,
    one every BATCH_BUCKET_STEP past the table's end, and `max_batch` itself."""
    beyond = range(max(table) + BATCH_BUCKET_STEP, max_batch, BATCH_BUCKET_STEP)
    return sorted({b for b in table if b < max_batch} | set(beyond) | {max_batch})


def graph_context_buckets(
    max_context: int, table: tuple[int, ...] = DEFAULT_CONTEXT_BUCKETS
) -> list[int]:
    """The context buckets of a runner for up to `max_context` keys: the table's below it
    and `max_context` itself."""
    return sorted({c for c in table if c < max_context} | {max_context})


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: _StaticInputs  # the static inputs (`inputs.batch`)
    logits: torch.Tensor  # static output [B * Q, vocab]: rows of the runner's shared output


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
        state_pool: LinearStatePool | None = None,
        spare_kv_slot: int | None = None,
        verify_graphs: bool = False,
    ) -> None:
        """Hybrid models: `state_pool` holds the running sequences' linear states and
        `spare_kv_slot` is a KV row no sequence owns (`KVPool(spare_slots=1)`): padding rows
        write there and to the pool's scratch slot, never to row 0's state. `verify_graphs`:
        steps of Q > 1 rows per sequence replay graphs too (module docstring; not with a
        state pool)."""
        if decoder.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA decoder, got device={decoder.device}")
        if max_batch < 1 or max_context < 1:
            raise ValueError(f"max_batch={max_batch} and max_context={max_context} must be >= 1")
        self.decoder = decoder
        self.kv = kv
        self.device = decoder.device
        self.batch_buckets = graph_batch_buckets(max_batch, batch_buckets)
        self.context_buckets = graph_context_buckets(max_context, context_buckets)
        if (state_pool is None) != (spare_kv_slot is None):
            raise ValueError("a hybrid model's graphs need both a state pool and a spare KV slot")
        if verify_graphs and state_pool is not None:
            raise ValueError("verify steps of a hybrid model do not run from graphs")
        self.state_pool = state_pool
        self.spare_kv_slot = spare_kv_slot
        self.verify_graphs = verify_graphs
        self._graphs: dict[tuple[int, int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self._staging = _Staging(self.device)
        # Every graph writes its logits into the first B rows of one buffer (graphs never run
        # concurrently, and each replay's rows are copied out before the next): one bucket's
        # worth of output memory, not one per bucket (lockstep/engine/memory.py).
        self._out = torch.empty(
            (self.max_batch, decoder.spec.vocab_size), dtype=torch.float32, device=self.device
        )

    @property
    def max_batch(self) -> int:
        return self.batch_buckets[-1]

    @property
    def max_context(self) -> int:
        return self.context_buckets[-1]

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def drop_graphs(self) -> None:
        """Forget every captured graph and free its memory pool; each is captured again on
        first use. For when the weights or the KV pool moved to new device addresses (memory
        released and resumed: lockstep/engine/memory_occupation.py)."""
        self._graphs.clear()
        self._pool = torch.cuda.graph_pool_handle()

    def can_run(self, batch: ForwardBatch) -> bool:
        """A pure decode step that fits the largest buckets, or (`verify_graphs`) a step whose
        sequences all have the same Q > 1 rows, whose bucket's B x Q rows fit the output."""
        meta = batch.meta
        b, q = meta.num_seqs, meta.max_q
        states = batch.linear_states
        if (states is not None or self.state_pool is not None) and (
            states is None or any(s.pool is not self.state_pool for s in states)
        ):
            return False  # linear states outside the pool (or a hybrid runner without any)
        if not (0 < b <= self.max_batch and q >= 1 and batch.num_tokens == b * q):
            return False
        if q > 1 and not (self.verify_graphs and self._batch_bucket(b) * q <= self.max_batch):
            return False
        return meta.max_kv <= self.max_context

    def _batch_bucket(self, b: int) -> int:
        return self.batch_buckets[bisect.bisect_left(self.batch_buckets, b)]

    def run(
        self, batch: ForwardBatch, patch: tuple[list[tuple[int, int]], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Replay the bucket's graph on `batch` (CPU tensors). `patch` = ([(row, index)],
        tokens): rows whose token is still on the device, copied from tokens[index] after the
        staged inputs land (padding rows copy row 0's, patched too), without a host wait."""
        meta = batch.meta
        if not self.can_run(batch) or (patch is not None and meta.max_q > 1):
            raise ValueError(
                f"not a graph-sized step: {meta.num_seqs} sequences (max {self.max_batch}), "
                f"{batch.num_tokens} rows, max_q={meta.max_q} (1, or the same for every "
                f"sequence with verify graphs and no pending tokens), max_kv={meta.max_kv} "
                f"(max {self.max_context})"
            )  # fmt: skip
        bb = self._batch_bucket(meta.num_seqs)
        cb = self.context_buckets[bisect.bisect_left(self.context_buckets, meta.max_kv)]
        key = (bb, cb, meta.max_q)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(batch, key, patch)
            self._graphs[key] = entry
        else:
            entry.inputs.fill(batch, self._staging, patch)
            entry.graph.replay()
        for state in batch.linear_states or ():
            state.advance(1)  # after the replay in stream order: a boundary's snapshot copies
        rows = batch.logit_rows
        n = rows.shape[0]
        if torch.equal(rows, torch.arange(n, dtype=rows.dtype)):  # every decode step
            return entry.logits.index_select(0, entry.inputs.batch.logit_rows[:n])
        return entry.logits.index_select(0, rows.to(self.device, non_blocking=True))

    def _capture(
        self,
        batch: ForwardBatch,
        key: tuple[int, int, int],
        patch: tuple[list[tuple[int, int]], torch.Tensor] | None,
    ) -> _Graph:
        bb, cb, q = key
        inputs = _StaticInputs(bb, cb, self.device, self.state_pool, self.spare_kv_slot, q)
        static = inputs.batch
        inputs.fill(batch, self._staging, patch)
        if self.state_pool is not None:
            # A linear state moves at every step: the warm-up runs on the scratch rows.
            inputs.point_at_scratch()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            # Warm-up: compiles the kernels and writes this step's K/V (the replay writes the
            # same bits again).
            self.decoder.forward(static, self.kv)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        out = self._out[: bb * q]
        with torch.cuda.graph(graph, pool=self._pool):
            out.copy_(self.decoder.forward(static, self.kv))
        if self.state_pool is not None:
            inputs.fill(batch, self._staging, patch)
        graph.replay()
        return _Graph(graph, inputs, out)


class _Staging:
    """Pinned host buffers every bucket stages its inputs in (one pair for the runner, grown
    to the largest bucket: buckets never run concurrently), and the event that says the last
    transfer out of them is done."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"  # (CPU only in unit tests of the layout)
        self.host64 = torch.empty(0, dtype=torch.int64)
        self.host32 = torch.empty(0, dtype=torch.int32)
        self._copied = torch.cuda.Event() if self._cuda else None
        self._pending = False  # a transfer out of the buffers may still be running

    def buffers(self, n64: int, n32: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host buffers of at least n64 / n32 elements, safe to overwrite."""
        if self._pending:  # the previous step's transfer must have read them
            self._copied.synchronize()
        if self.host64.numel() < n64:
            self.host64 = torch.empty(n64, dtype=torch.int64, pin_memory=self._cuda)
        if self.host32.numel() < n32:
            self.host32 = torch.empty(n32, dtype=torch.int32, pin_memory=self._cuda)
        return self.host64, self.host32

    def copied(self) -> None:
        """Mark the transfers just enqueued on the current stream."""
        if self._copied is not None:
            self._copied.record()
            self._pending = True


class _StaticInputs:
    """A bucket's static inputs as views of two device buffers (int64 and int32). Layout
    (B = bucket, C = context bucket, Q rows per sequence, R = B * Q): int64 [token_ids R |
    positions R | out_slots R | logit_rows = 0..R-1 | patch rows R | patch indices R], int32
    [q_start B | kv_len B | cu_kv B+1 | cu_q = 0, Q, .., R | slot_table B*C]. The constant
    parts (logit_rows, cu_q) are written once; `fill` transfers the rest."""

    def __init__(
        self,
        bb: int,
        cb: int,
        device: torch.device,
        state_pool: LinearStatePool | None = None,
        spare_kv_slot: int | None = None,
        q: int = 1,
    ) -> None:
        if q > 1 and state_pool is not None:
            raise ValueError("a hybrid model's static inputs take one row per sequence")
        self.bb = bb
        self.q = q
        self.state_pool = state_pool
        self.spare_kv_slot = spare_kv_slot
        i32, i64 = torch.int32, torch.int64
        r = bb * q
        # The patch rows/indices are not graph inputs: they say where a step's pending tokens
        # (overlapped decode) are copied from, before the replay.
        self.dev64 = torch.zeros(6 * r, dtype=i64, device=device)
        self.dev32 = torch.zeros(4 * bb + 2 + bb * cb, dtype=i32, device=device)
        self.dev64[3 * r : 4 * r] = torch.arange(r, dtype=i64, device=device)  # logit_rows
        self.dev32[3 * bb + 1 : 4 * bb + 2] = q * torch.arange(bb + 1, dtype=i32, device=device)
        d64, d32 = self.dev64, self.dev32
        meta = AttentionMeta(
            cu_q=d32[3 * bb + 1 : 4 * bb + 2],
            q_start=d32[0:bb],
            kv_len=d32[bb : 2 * bb],
            cu_kv=d32[2 * bb : 3 * bb + 1],
            slot_table=d32[4 * bb + 2 :],
            max_q=q,
            max_kv=cb,
        )
        pooled = None
        if state_pool is not None:
            # Hybrid models: each row's state pool slot, first position and end [B each];
            # a decode step crosses no boundary before its last row; each row is one chunk
            # task (the chunked rule's).
            self.lin32 = torch.zeros(3 * bb, dtype=i32, device=device)
            count = torch.arange(bb, dtype=i32, device=device)
            none = torch.zeros(0, dtype=i32, device=device)
            pooled = PooledRows(
                cu=meta.cu_q, starts=self.lin32[bb : 2 * bb], ends=self.lin32[2 * bb :],
                slots=self.lin32[:bb], bound_at=torch.zeros_like(count), bound_index=none,
                row_seq=count,
                bound_seq=none, bound_pos=none, seq_ids=count, bound_ids=none, boundaries=[],
                task_seq=count, task_pos=self.lin32[bb : 2 * bb], task_row=count,
                task_n=torch.ones_like(count), task_cu=meta.cu_q, task_count=bb,
            )  # fmt: skip
        self.batch = ForwardBatch(
            token_ids=d64[0:r],
            positions=d64[r : 2 * r],
            out_slots=d64[2 * r : 3 * r],
            meta=meta,
            logit_rows=d64[3 * r : 4 * r],
            pooled=pooled,
            state_pool=state_pool,
        )

    def point_at_scratch(self) -> None:
        """Make every row write the spare KV row and the pool's scratch state (a run that
        must leave the sequences' K/V and states as they are)."""
        assert self.state_pool is not None and self.spare_kv_slot is not None
        self.batch.out_slots.fill_(self.spare_kv_slot)
        self.lin32[: self.bb].fill_(self.state_pool.scratch_slot)

    def fill(
        self,
        batch: ForwardBatch,
        staging: _Staging,
        patch: tuple[list[tuple[int, int]], torch.Tensor] | None = None,
    ) -> None:
        """Stage `batch` (CPU tensors, b <= B sequences of Q queries each) and copy it in:
        one asynchronous transfer per buffer; then copy pending tokens (`patch`, Q = 1 only)
        from the device, padding rows included when row 0's token is pending."""
        bb, q, meta = self.bb, self.q, batch.meta
        b = meta.num_seqs
        r, real = bb * q, b * q
        if batch.num_tokens != real or meta.max_q != q or (patch is not None and q > 1):
            raise ValueError(f"a step of {batch.num_tokens} rows, max_q={meta.max_q}, does not "
                             f"fill {b} sequences of {q} rows (pending tokens only at 1)")  # fmt: skip
        total = meta.slot_table.shape[0]
        n32 = 3 * bb + 1 + total  # q_start, kv_len, cu_kv, then the slot table
        h64, h32 = staging.buffers(5 * r, n32 + 3 * bb)  # (+ hybrid models' slots)
        for i, src in enumerate((batch.token_ids, batch.positions, batch.out_slots)):
            h64[i * r : i * r + real] = src
            # Padding sequences repeat sequence 0's rows.
            h64[i * r + real : (i + 1) * r] = src[:q].repeat(bb - b)
        if self.state_pool is not None:
            # Padding rows of a hybrid model compute from other states than row 0's: they
            # write the spare KV row and the scratch state, never row 0's.
            h64[2 * bb + b : 3 * bb] = self.spare_kv_slot
            states = batch.linear_states
            assert states is not None and len(states) == b
            lin = h32[n32 : n32 + 3 * bb]
            lin[:b] = torch.tensor([s.slot for s in states], dtype=torch.int32)
            lin[b:bb] = self.state_pool.scratch_slot
            lin[bb : bb + b] = torch.tensor([s.position for s in states], dtype=torch.int32)
            lin[bb + b : 2 * bb] = states[0].position
            lin[2 * bb :] = lin[bb : 2 * bb] + 1
        for i, src in enumerate((meta.q_start, meta.kv_len)):
            h32[i * bb : i * bb + b] = src
            h32[i * bb + b : (i + 1) * bb] = src[0]
        # cu_kv: padding sequences start at row 0's slots; the last entry (total) is never a
        # start.
        h32[2 * bb : 2 * bb + b] = meta.cu_kv[:b]
        h32[2 * bb + b : 3 * bb] = meta.cu_kv[0]
        h32[3 * bb] = meta.cu_kv[b]
        h32[3 * bb + 1 : n32] = meta.slot_table
        n_patch = 0
        if patch is not None:
            pairs, _ = patch
            pairs = list(pairs)
            row0 = next((i for r, i in pairs if r == 0), None)
            if row0 is not None:  # padding rows repeat row 0: its token is theirs too
                pairs += [(row, row0) for row in range(b, bb)]
            n_patch = len(pairs)
            h64[3 * bb : 3 * bb + n_patch] = torch.tensor([row for row, _ in pairs])
            h64[4 * bb : 4 * bb + n_patch] = torch.tensor([i for _, i in pairs])
        self.dev64[: 3 * r].copy_(h64[: 3 * r], non_blocking=True)
        if n_patch:
            self.dev64[4 * bb : 4 * bb + n_patch].copy_(h64[3 * bb : 3 * bb + n_patch],
                                                         non_blocking=True)  # fmt: skip
            self.dev64[5 * bb : 5 * bb + n_patch].copy_(h64[4 * bb : 4 * bb + n_patch],
                                                         non_blocking=True)  # fmt: skip
        self.dev32[: 3 * bb + 1].copy_(h32[: 3 * bb + 1], non_blocking=True)
        slot_start = 4 * bb + 2  # past the constant cu_q
        self.dev32[slot_start : slot_start + total].copy_(h32[3 * bb + 1 : n32], non_blocking=True)
        if self.state_pool is not None:
            self.lin32.copy_(h32[n32 : n32 + 3 * bb], non_blocking=True)
        staging.copied()
        if n_patch:
            assert patch is not None
            tokens = patch[1]
            rows = self.dev64[4 * bb : 4 * bb + n_patch]
            index = self.dev64[5 * bb : 5 * bb + n_patch]
            self.batch.token_ids.index_copy_(0, rows, tokens.index_select(0, index))
