"""CUDA graphs for steps with prompt rows: every op but attention replayed per token bucket.

A decode graph (lockstep/engine/cuda_graphs.py) captures whole steps of one query per
sequence. A step that carries prompt rows beside decodes (a chunked prefill, a speculative
verify chunk) has a layout no fixed grid fits, so it ran eagerly: at batch 64 on an H100 its
~1,700 launches cost 21 ms of host time against a 9 ms graph replay, and every streamed token
of that step waited for them. Here such a step of T <= max_tokens rows replays, per token
bucket B >= T, the pieces between attention calls as graphs and runs attention eagerly on the
step's own metadata:

    piece 0: embed .. layer 0's q/k/v, K/V written, q copied to the static q     (graph)
    hole 0:  attention(static q [:B], layer 0's cache, the step's meta) -> static o (eager)
    piece 1: o_proj, MLP, layer 1's norm and q/k/v ..                           (graph)
    ...
    piece L: the last o_proj and MLP, the final norm of all B rows               (graph)
    LM head on the step's logit rows                                             (eager)

Why a replay gives the bits of the eager step:
  * Pieces hold the kernels eager would launch for B rows, and every kernel of the
    deterministic backend computes a row independently of the number of rows (the same
    property the decode graphs rest on), so the T real rows are eager's bits.
  * Padding rows B - T are copies of row 0 (token, position, output slot). The attention
    hole runs on the step's T rows (its metadata's cu_q) and gives the padding rows row 0's
    output, so they stay copies of row 0 through every layer: they compute row 0's K/V bit
    for bit and write those same bits to row 0's slot.
  * Attention runs the eager kernels on the eager metadata: nothing about it changes.

The runner captures a bucket the first time a step of its size comes: that step runs
eagerly on the static inputs (compiling kernels, writing its K/V), then the pieces are
captured (nothing runs while capturing) and replayed, writing the same K/V again. All pieces
of all buckets share one memory pool and the static q / o buffers (pieces run in stream order
and never concurrently). Models whose mixers keep other per-sequence state (linear
attention, latent attention) and tensor-parallel decoders are not taken: `supports`.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lockstep.engine.cuda_graphs import _Staging
from lockstep.models.blocks.attention import Attention
from lockstep.models.decoder import Decoder, KVStorage
from lockstep.models.forward_batch import ForwardBatch
from lockstep.ops.base import AttentionMeta, LayerKV

# Token buckets: steps larger than the last are device-bound (an 8k-token prefill step runs
# ~190 ms of kernels against ~20 ms of launches, which overlap it) and stay eager. The pool
# holds the largest bucket's activations for good (0.15 GiB for Qwen3-8B at 1,024 rows; the
# mixed-step bound cuts steps beside 64 streams to about 250 rows on an H100).
MAX_TOKENS = 1024
DEFAULT_TOKEN_BUCKETS = (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, MAX_TOKENS)


def supports(decoder: Decoder) -> str | None:
    """Why `decoder` cannot run piecewise graphs, or None when it can: every mixer must be
    paged attention (its only per-sequence state the KV cache), no step hooks, one rank."""
    if decoder.plan.tp != 1:
        return f"tensor parallelism (tp={decoder.plan.tp})"
    if decoder.step_hooks:
        return f"step hooks ({', '.join(sorted(k.__name__ for k in decoder.step_hooks))})"
    others = {type(m).__name__ for m in (layer.plan.mixer for layer in decoder.layers)
              if type(m) is not Attention}  # fmt: skip
    if others:
        return f"mixers other than paged attention ({', '.join(sorted(others))})"
    if decoder.device.type != "cuda":
        return f"device {decoder.device} is not CUDA"
    return None


def padded_rows(batch: ForwardBatch, b: int) -> torch.Tensor:
    """int64 [3, b]: the step's token ids, positions and output slots (CPU tensors, T rows),
    each followed by b - T copies of its row 0 (module docstring: they write row 0's K/V bits
    to row 0's slot)."""
    t = batch.num_tokens
    if not 0 < t <= b:
        raise ValueError(f"{t} rows do not fit a bucket of {b}")
    rows = torch.stack((batch.token_ids, batch.positions, batch.out_slots)).to(torch.int64)
    return torch.cat((rows, rows[:, :1].expand(3, b - t)), dim=1)


def attend_into(
    ops: object, q: torch.Tensor, kv: LayerKV, meta: AttentionMeta, scale: float,
    window: int | None, out: torch.Tensor,
) -> None:  # fmt: skip
    """Attention of the step's T rows q [T, Hq, D] into out[:T], and row 0's output into the
    padding rows out[T:] (which keeps them copies of row 0 in every later layer)."""
    t = q.shape[0]
    o = ops.attention(q, kv, meta, scale, window)  # type: ignore[attr-defined]
    out[:t].copy_(o)
    out[t:].copy_(o[:1].expand_as(out[t:]))


def forward_with_holes(
    decoder: Decoder, batch: ForwardBatch, kv: KVStorage, hole: Callable[..., torch.Tensor]
) -> torch.Tensor:
    """`decoder.final_hidden_states(batch, kv)` with every attention call given to
    `hole(q, kv, meta, scale, window)` instead (the decoder's ops restored after)."""
    saved = decoder.ops
    decoder.ops = _HoleOps(saved, hole)  # type: ignore[assignment]
    try:
        return decoder.final_hidden_states(batch, kv)
    finally:
        decoder.ops = saved


@dataclass(frozen=True)
class _Hole:
    """One attention call between two pieces: the layer's cache and its arguments."""

    kv: LayerKV
    scale: float
    window: int | None


@dataclass
class _Bucket:
    pieces: list[torch.cuda.CUDAGraph]  # len(holes) + 1
    holes: list[_Hole]
    hidden: torch.Tensor  # static [B, hidden]: the final-normed rows


class _HoleOps:
    """The decoder's ops while a bucket is warmed up or captured: every call passes through,
    except attention, which `hole` handles (the warm-up runs it into the static o; the
    capture ends the piece there and starts the next); both return the static o [B]."""

    def __init__(self, ops: object, hole: Callable[..., torch.Tensor]) -> None:
        self._ops = ops
        self._hole = hole

    def __getattr__(self, name: str) -> object:
        return getattr(self._ops, name)

    def attention(
        self, q: torch.Tensor, kv: LayerKV, meta: AttentionMeta, scale: float,
        window: int | None = None,
    ) -> torch.Tensor:  # fmt: skip
        return self._hole(q, kv, meta, scale, window)


class PiecewiseGraphRunner:
    """Runs steps of up to `max_tokens` rows (any mix of prompt chunks and decodes) as graph
    pieces around eager attention; see the module docstring.

    Use: `if runner.can_run(batch): logits = runner.run(batch, patch)` (else run eagerly);
    the logits are those of `batch.logit_rows`, as `Decoder.forward` returns them."""

    def __init__(
        self,
        decoder: Decoder,
        kv: KVStorage,
        max_tokens: int,
        token_buckets: tuple[int, ...] = DEFAULT_TOKEN_BUCKETS,
    ) -> None:
        why = supports(decoder)
        if why is not None:
            raise ValueError(f"piecewise CUDA graphs cannot run this decoder: {why}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens} must be >= 1")
        self.decoder = decoder
        self._ops = decoder.ops
        self.kv = kv
        self.device = decoder.device
        self.buckets = sorted({b for b in token_buckets if b < max_tokens} | {max_tokens})
        self._buckets: dict[int, _Bucket] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self._staging = _Staging(self.device)
        spec = decoder.spec
        largest = self.buckets[-1]
        # One q and one o for every layer of every bucket: a piece copies its q in, the hole
        # reads it and writes o, the next piece reads o, all in stream order.
        self._q = torch.zeros((largest, spec.num_heads, spec.head_dim), dtype=decoder.act_dtype,
                              device=self.device)  # fmt: skip
        self._o = torch.zeros_like(self._q)
        self._inputs = torch.zeros(3 * largest, dtype=torch.int64, device=self.device)

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    @property
    def num_graphs(self) -> int:
        """Buckets captured so far."""
        return len(self._buckets)

    def drop_graphs(self) -> None:
        """Forget every captured bucket and free the pool (weights or caches moved)."""
        self._buckets.clear()
        self._pool = torch.cuda.graph_pool_handle()

    def can_run(self, batch: ForwardBatch) -> bool:
        """A step of 1..max_tokens rows, at least one sequence with more than one query row
        (pure decode steps are the decode graphs'), and no per-sequence linear state."""
        t = batch.num_tokens
        return (
            0 < t <= self.max_tokens
            and batch.meta.max_q > 1
            and batch.linear_states is None
            and batch.pooled is None
        )

    def run(
        self, batch: ForwardBatch, patch: tuple[list[tuple[int, int]], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The step's logits: `batch` holds CPU tensors; `patch` = ([(row, index)], tokens):
        rows whose token is still on the device, copied from tokens[index]."""
        if not self.can_run(batch):
            raise ValueError(f"not a piecewise step: {batch.num_tokens} rows (max "
                             f"{self.max_tokens}), max_q={batch.meta.max_q} (need > 1)")  # fmt: skip
        t = batch.num_tokens
        b = self.buckets[bisect.bisect_left(self.buckets, t)]
        self._fill(batch, b, patch)
        meta = batch.meta.to(self.device)
        bucket = self._buckets.get(b)
        if bucket is None:
            bucket = self._capture(t, b, meta)
            self._buckets[b] = bucket
        self._replay(bucket, t, b, meta)
        rows = batch.logit_rows.to(self.device, non_blocking=True)
        return self.decoder.head_logits(bucket.hidden.index_select(0, rows))

    # ----------------------------------------------------------------- inputs
    def _static(self, b: int, meta: AttentionMeta) -> ForwardBatch:
        d = self._inputs
        empty = torch.zeros(0, dtype=torch.int64, device=self.device)
        return ForwardBatch(token_ids=d[0:b], positions=d[b : 2 * b], out_slots=d[2 * b : 3 * b],
                            meta=meta, logit_rows=empty)  # fmt: skip

    def _fill(
        self, batch: ForwardBatch, b: int, patch: tuple[list[tuple[int, int]], torch.Tensor] | None
    ) -> None:
        """Stage token ids, positions and output slots of the step's T rows, then B - T copies
        of row 0, in one transfer; then patch pending tokens on the device (padding rows
        take row 0's)."""
        t = batch.num_tokens
        host, _ = self._staging.buffers(3 * b, 0)
        host[: 3 * b] = padded_rows(batch, b).reshape(-1)
        self._inputs[: 3 * b].copy_(host[: 3 * b], non_blocking=True)
        self._staging.copied()
        if patch is not None:
            pairs, tokens = patch
            pairs = list(pairs)
            row0 = next((i for r, i in pairs if r == 0), None)
            if row0 is not None:
                pairs += [(r, row0) for r in range(t, b)]
            rows = torch.tensor([r for r, _ in pairs], dtype=torch.int64).to(self.device)
            index = torch.tensor([i for _, i in pairs], dtype=torch.int64).to(self.device)
            self._inputs[:b].index_copy_(0, rows, tokens.index_select(0, index))

    # ----------------------------------------------------------------- capture and replay
    def _capture(self, t: int, b: int, meta: AttentionMeta) -> _Bucket:
        decoder = self.decoder
        static = self._static(b, meta)
        pieces: list[torch.cuda.CUDAGraph] = []
        holes: list[_Hole] = []
        q_static, o_static = self._q[:b], self._o[:b]

        def eager(q: torch.Tensor, kv: LayerKV, meta: AttentionMeta, scale: float,
                  window: int | None) -> torch.Tensor:  # fmt: skip
            attend_into(self._ops, q[:t], kv, meta, scale, window, o_static)
            return o_static

        def boundary(q: torch.Tensor, kv: LayerKV, meta: AttentionMeta, scale: float,
                     window: int | None) -> torch.Tensor:  # fmt: skip
            del meta  # the step's own, given at each replay
            q_static.copy_(q)
            pieces[-1].capture_end()
            holes.append(_Hole(kv, scale, window))
            pieces.append(torch.cuda.CUDAGraph())
            pieces[-1].capture_begin(pool=self._pool)
            return o_static

        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            # Warm-up: compiles the kernels and writes this step's K/V (the replay writes
            # the same bits again).
            forward_with_holes(decoder, static, self.kv, eager)
            torch.cuda.synchronize(self.device)
            pieces.append(torch.cuda.CUDAGraph())
            pieces[-1].capture_begin(pool=self._pool)
            hidden = forward_with_holes(decoder, static, self.kv, boundary)
            pieces[-1].capture_end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return _Bucket(pieces, holes, hidden)

    def _replay(self, bucket: _Bucket, t: int, b: int, meta: AttentionMeta) -> None:
        q_static, o_static = self._q[:t], self._o[:b]
        for piece, hole in zip(bucket.pieces, bucket.holes, strict=False):
            piece.replay()
            attend_into(self._ops, q_static, hole.kv, meta, hole.scale, hole.window, o_static)
        bucket.pieces[-1].replay()
