"""Gated DeltaNet layers of hybrid models (Qwen3.5) and the per-sequence state they carry.

A linear-attention layer keeps, per sequence, a convolution window (the last conv_kernel - 1
pre-convolution rows) and a recurrent state S [Hv, Dk, Dv] instead of K/V per token. The
contract (docs/design.md, "Linear attention") asks that both, after token t, be a pure
function of tokens 0..t however the sequence was split. The gated delta rule therefore runs
in chunks of `CHUNK` rows at absolute positions 0, C, 2C, ...:

    positions   0 ........ C-1 | C ....... 2C-1 | 2C .. p ..            (C = CHUNK)
    state       S_0 = 0        | S_C            | S_2C     open rows 2C..p-1
                                 ^ boundary states: computed by one formula only

`LinearState` is one running sequence's working state: the window, the boundary state of
the chunk its next position falls in, and that chunk's rows so far ("open rows"). With the
recurrent kernel (`LinearLayout.kernel`) they are each row's key, cumulative log decay and
corrected value u, and a step of any size continues with the per-row formula of
`Ops.gated_delta_rule`; with the chunked kernel they are the rows as they arrived (key, value,
log gate, beta), and a step recomputes each chunk it touches from the whole chunk tile
(`ChunkedLinearAttentionOps`, lockstep/ops/chunked_delta.py). Either way a decode step gives
the bits of a prefill. The boundaries a step crosses that the radix cache will keep (an engine request's
`keep`, reserved from a `LinearSnapshotPool`: lockstep/cache/linear_snapshots.py; every one for
a state of its own) are captured as `LinearSnapshot`s, which the cache keeps beside the
full-attention layers' KV; a prefix hit resumes from the last snapshot at or below the matched
length and recomputes the rest.

Speculative verify steps (docs/speculative.md) compute rows past the tokens that will be kept;
the state must end as if only the kept ones had been computed. The scheduler keeps a verify
chunk inside one chunk of the rule, never reaching its end boundary, so the boundary state is
untouched by it and the kept rows are exactly the first open rows it wrote (each a function of
the rows before it). `LinearState.begin_verify` keeps the windows before the step and each
layer's convolution inputs of the step; `end_verify(p)` then rebuilds the window at p from
them and clears the open rows past p: the bits decode would have left.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lockstep.models.spec import ModelSpec
from lockstep.numerics import LINEAR_ATTENTION_CHUNK
from lockstep.ops.base import (
    ChunkedLinearAttentionOps,
    PooledChunkedLinearAttentionOps,
    PooledLinearAttentionOps,
    PooledRows,
)

if TYPE_CHECKING:
    from lockstep.models.forward_batch import ForwardBatch
    from lockstep.ops.base import Ops
    from lockstep.parallel.layers import RowParallelWeight, TensorParallel

CHUNK = LINEAR_ATTENTION_CHUNK  # rows per chunk: part of the numerics (lockstep/numerics.py)


@dataclass(frozen=True)
class LinearLayout:
    """Shapes of one sequence's linear-attention state, over the model's linear layers."""

    num_layers: int
    conv_dim: int
    conv_kernel: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    chunk: int
    device: torch.device
    kernel: str = "recurrent"  # the rule's form: config.GDN_KERNELS

    @property
    def chunked(self) -> bool:
        """Whether the layers run the chunked rule (open rows: k, v, g, beta as they came)."""
        return self.kernel == "chunked"

    @classmethod
    def of(
        cls, spec: ModelSpec, device: torch.device, chunk: int = CHUNK, tp: int = 1
    ) -> LinearLayout:
        """The layout of `spec`'s states, or at tensor parallelism `tp` one rank's: its
        1/tp of the key and value heads and of the convolution channels (q | k | v of those
        heads; lockstep/parallel/sharding.py)."""
        lin = spec.linear
        assert lin is not None, "not a hybrid model"
        num = sum(spec.is_linear(i) for i in range(spec.num_layers))
        return cls(num, lin.conv_dim // tp, lin.conv_kernel, lin.num_key_heads // tp,
                   lin.num_value_heads // tp, lin.key_head_dim, lin.value_head_dim, chunk,
                   device)  # fmt: skip

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.float32, device=self.device)

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of one `LinearSnapshot` (float32 window and state, every linear layer)."""
        window = (self.conv_kernel - 1) * self.conv_dim
        state = self.num_value_heads * self.key_head_dim * self.value_head_dim
        return 4 * self.num_layers * (window + state)


@dataclass(eq=False)
class LinearSnapshot:
    """The state after `position` tokens (a multiple of the chunk): conv windows [L, K-1,
    conv_dim] and boundary states [L, Hv, Dk, Dv]. Never modified once complete. `pool`,
    `slot`: the `LinearSnapshotPool` slot it views (lent until `release`), or None, -1 for
    tensors of its own."""

    position: int
    conv: torch.Tensor
    recurrent: torch.Tensor
    pool: Any = None
    slot: int = -1

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * 4 + self.recurrent.numel() * 4

    def release(self) -> None:
        """Give a pooled snapshot's slot back (a no-op for one with tensors of its own)."""
        if self.pool is not None:
            self.pool.release(self)


class LinearStatePool:
    """The working states of the running sequences, one slot each, in device tensors indexed
    by slot (as the KV pool indexes tokens): windows [S, L, K-1, conv_dim], boundary states
    [S, L, Hv, Dk, Dv] and open rows [S, L, C, ...] (`LinearState` says which), float32,
    allocated once. A pooled step
    runs every sequence's linear layer in one launch (`Ops` with `PooledLinearAttentionOps`).
    One more slot, `scratch_slot`, is never handed out: the CUDA graphs' padding rows write
    there."""

    def __init__(self, layout: LinearLayout, num_slots: int) -> None:
        lay, z = layout, layout._zeros
        self.layout = layout
        rows = num_slots + 1
        self.conv = z(rows, lay.num_layers, lay.conv_kernel - 1, lay.conv_dim)
        self.recurrent = z(rows, lay.num_layers, lay.num_value_heads, lay.key_head_dim,
                           lay.value_head_dim)  # fmt: skip
        self.open_k = z(rows, lay.num_layers, lay.chunk, lay.num_key_heads, lay.key_head_dim)
        self.open_gamma = z(rows, lay.num_layers, lay.chunk, lay.num_value_heads)
        self.open_u = z(rows, lay.num_layers, lay.chunk, lay.num_value_heads,
                        lay.value_head_dim)  # fmt: skip
        self.open_beta = z(rows, lay.num_layers, lay.chunk if lay.chunked else 0,
                           lay.num_value_heads)  # fmt: skip
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @staticmethod
    def slot_bytes(layout: LinearLayout) -> int:
        """Bytes of one slot (float32): a snapshot's plus the open rows."""
        lay = layout
        heads = lay.num_value_heads * (2 if lay.chunked else 1)  # log decays (and betas)
        open_rows = lay.chunk * (lay.num_key_heads * lay.key_head_dim + heads
                                 + lay.num_value_heads * lay.value_head_dim)  # fmt: skip
        return lay.snapshot_bytes + 4 * lay.num_layers * open_rows

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise RuntimeError("linear state pool exhausted (more running sequences than slots)")
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def fill(self, slot: int, snapshot: LinearSnapshot | None) -> None:
        """Slot `slot` as the state after the snapshot's tokens (a copy), or after none."""
        if snapshot is None:
            self.conv[slot].zero_()
            self.recurrent[slot].zero_()
        else:
            self.conv[slot].copy_(snapshot.conv)
            self.recurrent[slot].copy_(snapshot.recurrent)
        # As a state of its own starts: rows past the open ones enter the kernels' sums
        # multiplied by zero, so the slot's last owner must leave nothing in them.
        for t in (self.open_k, self.open_gamma, self.open_u, self.open_beta):
            t[slot].zero_()


@dataclass
class VerifyRows:
    """What `LinearState.end_verify` needs: the position and the windows [L, K-1, conv_dim]
    before the verify step, and by linear layer the step's convolution inputs [n, conv_dim]
    (float32), filled by `gated_deltanet`."""

    start: int
    conv: torch.Tensor
    rows: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class LinearState:
    """One sequence's working state at `position` (the next position to compute): windows
    [L, K-1, conv_dim], the boundary state of the chunk holding `position` [L, Hv, Dk, Dv]
    and that chunk's open rows (keys [L, C, Hk, Dk], `open_gamma` [L, C, Hv] and `open_u` [L,
    C, Hv, Dv]: the cumulative log decays and corrected values with the recurrent kernel, the
    log gates g and values v with the chunked one, which also keeps the betas in `open_beta`
    [L, C, Hv] ([L, C, 0] otherwise); rows 0 .. position % C - 1 are meaningful). `captured`:
    snapshots of the boundaries crossed since the owner last took them. `keep`: the snapshots
    reserved for the boundaries to capture, by position (the engine's requests: a step
    captures only those); None: capture every boundary into tensors of its own. A pooled
    state's tensors are its slot's views of a `LinearStatePool`; `release` gives the slot and
    every snapshot the state still holds back."""

    layout: LinearLayout
    position: int
    conv: torch.Tensor
    recurrent: torch.Tensor
    open_k: torch.Tensor
    open_gamma: torch.Tensor
    open_u: torch.Tensor
    open_beta: torch.Tensor
    captured: dict[int, LinearSnapshot] = field(default_factory=dict)
    pool: LinearStatePool | None = None
    slot: int = -1
    keep: dict[int, LinearSnapshot] | None = None
    verify: VerifyRows | None = None  # set between begin_verify and end_verify

    @classmethod
    def resume(
        cls,
        layout: LinearLayout,
        snapshot: LinearSnapshot | None,
        pool: LinearStatePool | None = None,
        keep_all: bool = True,
    ) -> LinearState:
        """A state at the snapshot's position (a copy: the snapshot stays intact), or at
        position 0 from nothing; in a slot of `pool` if given, else in tensors of its own.
        `keep_all`: capture every boundary; else only those reserved in `keep`."""
        state = cls._resume(layout, snapshot, pool)
        state.keep = None if keep_all else {}
        return state

    @classmethod
    def _resume(
        cls, layout: LinearLayout, snapshot: LinearSnapshot | None, pool: LinearStatePool | None
    ) -> LinearState:
        z, lay = layout._zeros, layout
        if pool is not None:
            slot = pool.acquire()
            pool.fill(slot, snapshot)
            return cls.in_slot(pool, slot, 0 if snapshot is None else snapshot.position)
        if snapshot is None:
            conv = z(lay.num_layers, lay.conv_kernel - 1, lay.conv_dim)
            recurrent = z(lay.num_layers, lay.num_value_heads, lay.key_head_dim,
                          lay.value_head_dim)  # fmt: skip
            position = 0
        else:
            conv, recurrent = snapshot.conv.clone(), snapshot.recurrent.clone()
            position = snapshot.position
        return cls(
            layout, position, conv, recurrent,
            z(lay.num_layers, lay.chunk, lay.num_key_heads, lay.key_head_dim),
            z(lay.num_layers, lay.chunk, lay.num_value_heads),
            z(lay.num_layers, lay.chunk, lay.num_value_heads, lay.value_head_dim),
            z(lay.num_layers, lay.chunk if lay.chunked else 0, lay.num_value_heads),
        )  # fmt: skip

    @classmethod
    def in_slot(cls, pool: LinearStatePool, slot: int, position: int) -> LinearState:
        """The state at `position` whose tensors are slot `slot` of `pool` (as they are)."""
        parts = (pool.conv, pool.recurrent, pool.open_k, pool.open_gamma, pool.open_u,
                 pool.open_beta)  # fmt: skip
        return cls(pool.layout, position, *(t[slot] for t in parts), pool=pool, slot=slot)

    def release(self) -> None:
        """Give a pooled state's slot back (once; a no-op for a state of its own), and every
        snapshot it still holds, reserved or captured, to its pool."""
        for snap in [*(self.keep or {}).values(), *self.captured.values()]:
            snap.release()
        self.captured = {}
        if self.keep is not None:
            self.keep = {}
        if self.pool is not None:
            self.pool.release(self.slot)
            self.pool, self.slot = None, -1

    def keeps(self, position: int) -> bool:
        """Whether the boundary at `position` is captured (`keep`)."""
        return self.keep is None or position in self.keep or position in self.captured

    def advance(self, n: int) -> None:
        """Move past a step's n rows; a pooled state that ends on a chunk boundary it keeps
        and the step did not capture takes it from its slot (the pooled path leaves that one
        there)."""
        self.position += n
        p = self.position
        if self.pool is None or not n or p % self.layout.chunk or p in self.captured:
            return
        if self.keep is None:
            self.captured[p] = LinearSnapshot(p, self.conv.clone(), self.recurrent.clone())
        elif p in self.keep:
            snap = self.keep.pop(p)
            snap.conv.copy_(self.conv)
            snap.recurrent.copy_(self.recurrent)
            self.captured[p] = snap

    def begin_verify(self) -> None:
        """The next step is a verify chunk whose last rows may be rejected: keep what
        `end_verify` needs. The caller keeps the chunk off the rule's chunk boundaries: it
        must end before the boundary after `position` (`verify_room`)."""
        self.verify = VerifyRows(self.position, self.conv.clone())

    def verify_room(self) -> int:
        """The most rows a verify chunk from `position` may have: it must end (its next
        position) before the next chunk boundary, so that the boundary state stays that of
        the chunk `position` is in and `end_verify` can cut its open rows."""
        return self.layout.chunk - 1 - self.position % self.layout.chunk

    def end_verify(self, position: int) -> None:
        """After the verify step begun by `begin_verify`: make this the state after
        `position` tokens (between the step's start and end): the window of the rows before
        `position`, and no open rows from `position` on."""
        verify = self.verify
        assert verify is not None, "end_verify without begin_verify"
        self.verify = None
        k1 = self.layout.conv_kernel - 1
        kept = position - verify.start
        assert 0 <= kept <= self.position - verify.start, (position, verify.start, self.position)
        assert position // self.layout.chunk == verify.start // self.layout.chunk
        if position == self.position:
            return
        assert len(verify.rows) == self.layout.num_layers, "a linear layer kept no rows"
        for layer, rows in verify.rows.items():
            seq_rows = torch.cat([verify.conv[layer], rows])  # the window, then the step's rows
            self.conv[layer].copy_(seq_rows[kept : kept + k1])
        open_from = position % self.layout.chunk
        for t in (self.open_k, self.open_gamma, self.open_u, self.open_beta):
            t[:, open_from:].zero_()  # past the open rows: zero, as a fresh state's
        self.position = position

    def take_captured(self) -> dict[int, LinearSnapshot]:
        """Hand over the captured snapshots (the caller keeps or drops them)."""
        taken, self.captured = self.captured, {}
        return taken

    def meaningful(self) -> tuple[torch.Tensor, ...]:
        """The tensors that define the state (open rows cut to those in use), for tests; the
        open betas only where the chunked rule keeps them (the recurrent rule's state is the
        five tensors it always was, so its recorded digests stand)."""
        r = self.position % self.layout.chunk
        state = (self.conv, self.recurrent, self.open_k[:, :r], self.open_gamma[:, :r],
                 self.open_u[:, :r])  # fmt: skip
        return (*state, self.open_beta[:, :r]) if self.layout.chunked else state


@dataclass
class LinearWeights:
    """One Gated DeltaNet layer: the fused input projection (rows q | k | v | z | b | a), the
    conv weight [conv_dim, K], A_log and dt_bias [Hv], the gated norm weight [Dv] (float32)
    and the output projection."""

    in_proj: torch.Tensor
    conv: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor
    out_proj: torch.Tensor | RowParallelWeight  # row-parallel in the engine's decoder


def gated_deltanet(
    ops: Ops,
    x: torch.Tensor,
    w: LinearWeights,
    layer: int,
    batch: ForwardBatch,
    layout: LinearLayout,
    eps: float,
    rows: list[int] | None = None,
    pooled: PooledRows | None = None,
    pool: LinearStatePool | None = None,
    parallel: TensorParallel | None = None,
) -> torch.Tensor:
    """One Gated DeltaNet layer over the step's rows x [T, hidden] -> [T, hidden], continuing
    each sequence's `LinearState` (batch.linear_states, in sequence order) in linear layer
    `layer`. `rows`: each sequence's row count, known on the host (else read from the batch).
    `pooled`: where the sequences sit in `pool` (`pooled_rows`), for a backend with
    `PooledLinearAttentionOps`: all sequences in one launch per kernel (`batch.linear_states`
    may then be None where the step crosses no boundary before a sequence's last row: a CUDA
    graph's decode step); else a loop over the sequences. Every op is row-local except the
    convolution (the sequence's own previous rows) and the delta rule
    (`Ops.gated_delta_rule`, or `ChunkedLinearAttentionOps` where `layout.chunked`), whose rows
    are computed alike either way. `parallel`: out_proj is row-parallel over the value heads
    (`TensorParallel.row_linear`, its weight a `RowParallelWeight`); None: a plain linear."""
    lay = layout
    kd, vd = lay.num_key_heads * lay.key_head_dim, lay.num_value_heads * lay.value_head_dim
    hv, dk = lay.num_value_heads, lay.key_head_dim
    t = x.shape[0]
    proj = ops.linear(x, w.in_proj)
    mixed, z, b, a = proj.split([lay.conv_dim, vd, hv, hv], dim=1)
    g, beta = ops.gdn_gates(a.contiguous(), b.contiguous(), w.a_log, w.dt_bias)
    states = batch.linear_states
    if states is not None and any(s.verify is not None for s in states):
        # Verify chunks (LinearState.begin_verify): keep their convolution inputs.
        cu = batch.meta.cu_q.tolist() if rows is None else [0, *itertools.accumulate(rows)]
        for seq, state in enumerate(states):
            if state.verify is not None:
                state.verify.rows[layer] = mixed[cu[seq] : cu[seq + 1]].to(torch.float32, copy=True)
    if pooled is not None:
        assert isinstance(ops, PooledLinearAttentionOps) and pool is not None
        act = ops.causal_conv_silu_pooled(mixed, pool.conv[:, layer], w.conv, pooled)
        windows = ops.update_conv_windows(mixed, pool.conv[:, layer], w.conv, pooled)
        q, k_, v = act.split([kd, kd, vd], dim=1)
        q = ops.l2_normalize(q.reshape(-1, dk), 1e-6, dk**-0.5).reshape(t, -1, dk)
        k_ = ops.l2_normalize(k_.reshape(-1, dk), 1e-6, 1.0).reshape(t, -1, dk)
        v = v.reshape(t, hv, lay.value_head_dim).contiguous()
        if lay.chunked:
            assert isinstance(ops, PooledChunkedLinearAttentionOps)
            out, bounds = ops.chunked_delta_rule_pooled(
                q, k_, v, g, beta, pool.recurrent[:, layer], pool.open_k[:, layer],
                pool.open_u[:, layer], pool.open_gamma[:, layer], pool.open_beta[:, layer],
                pooled,
            )  # fmt: skip
        else:
            out, bounds = ops.gated_delta_rule_pooled(
                q, k_, v, g, beta, pool.recurrent[:, layer], pool.open_k[:, layer],
                pool.open_gamma[:, layer], pool.open_u[:, layer], pooled,
            )  # fmt: skip
        for i, (seq, position) in enumerate(pooled.boundaries):
            assert states is not None
            snap = _snapshot(states[seq], position)
            snap.conv[layer].copy_(windows[i])
            snap.recurrent[layer].copy_(bounds[i])
    else:
        out = _delta_rule_by_sequence(ops, mixed, g, beta, w, layer, batch, lay, rows)
    normed = ops.rms_norm(out.reshape(-1, lay.value_head_dim), w.norm, eps)
    gated = ops.gate_activation(normed, z.reshape(-1, lay.value_head_dim).contiguous(), "silu")
    gated = gated.reshape(t, vd).to(x.dtype)
    if parallel is None:
        return ops.linear(gated, w.out_proj)
    return parallel.row_linear(gated, w.out_proj, "linear")


def pooled_rows(
    ops: Ops, states: list[LinearState], rows: list[int], layout: LinearLayout
) -> PooledRows | None:
    """The step's `PooledRows` where the backend runs pooled steps and every state sits in
    one pool, else None (the layers then loop over the sequences)."""
    pool = states[0].pool if states else None
    # The convolution's pooled ops, and the rule's for the layout's kernel.
    rule = PooledChunkedLinearAttentionOps if layout.chunked else PooledLinearAttentionOps
    if pool is None or not (isinstance(ops, PooledLinearAttentionOps) and isinstance(ops, rule)):
        return None
    if any(s.pool is not pool for s in states):
        return None
    return PooledRows.build(
        rows, [s.position for s in states], [s.slot for s in states], layout.chunk,
        pool.recurrent.device, keep=lambda seq, position: states[seq].keeps(position),
    )  # fmt: skip


def _snapshot(state: LinearState, position: int) -> LinearSnapshot:
    """The state's snapshot at `position` (one it keeps), taken from `keep` or made (empty)
    on its first layer."""
    snap = state.captured.get(position)
    if snap is None and state.keep is not None:
        snap = state.captured[position] = state.keep.pop(position)
    if snap is None:
        lay = state.layout
        snap = LinearSnapshot(
            position,
            lay._zeros(lay.num_layers, lay.conv_kernel - 1, lay.conv_dim),
            lay._zeros(
                lay.num_layers, lay.num_value_heads, lay.key_head_dim, lay.value_head_dim
            ),  # fmt: skip
        )
        state.captured[position] = snap
    return snap


def _delta_rule_by_sequence(
    ops: Ops,
    mixed: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    w: LinearWeights,
    layer: int,
    batch: ForwardBatch,
    lay: LinearLayout,
    rows: list[int] | None,
) -> torch.Tensor:
    """The conv and the delta rule of `gated_deltanet`, one sequence after another."""
    kd, vd = lay.num_key_heads * lay.key_head_dim, lay.num_value_heads * lay.value_head_dim
    hv, k1, dk = lay.num_value_heads, lay.conv_kernel - 1, lay.key_head_dim
    out = torch.empty((mixed.shape[0], hv, lay.value_head_dim), dtype=torch.float32,
                      device=mixed.device)  # fmt: skip
    cu_q = batch.meta.cu_q.tolist() if rows is None else [0, *itertools.accumulate(rows)]
    states = batch.linear_states
    assert states is not None and len(states) == len(cu_q) - 1, "one LinearState per sequence"
    for seq, state in enumerate(states):
        r0, r1 = cu_q[seq], cu_q[seq + 1]
        n, start = r1 - r0, state.position
        # The window, then this step's rows: row i + k - 1 + 1 of `seq_rows` feeds output i.
        seq_rows = torch.cat([state.conv[layer], mixed[r0:r1].float()])
        conv = seq_rows[0:n] * w.conv[:, 0]
        for k in range(1, k1 + 1):  # ascending taps, one multiply and one add each
            conv = conv + seq_rows[k : k + n] * w.conv[:, k]
        act = ops.silu(conv.contiguous())
        state.conv[layer].copy_(seq_rows[n : n + k1])
        q, k_, v = act.split([kd, kd, vd], dim=1)
        q = ops.l2_normalize(q.reshape(-1, dk), 1e-6, dk**-0.5).reshape(n, -1, dk)
        k_ = ops.l2_normalize(k_.reshape(-1, dk), 1e-6, 1.0).reshape(n, -1, dk)
        v = v.reshape(n, hv, lay.value_head_dim).contiguous()
        gates = g[r0:r1].contiguous(), beta[r0:r1].contiguous()
        if lay.chunked:
            assert isinstance(ops, ChunkedLinearAttentionOps)
            o, boundaries = ops.chunked_delta_rule(
                q, k_, v, *gates, state.recurrent[layer], state.open_k[layer],
                state.open_u[layer], state.open_gamma[layer], state.open_beta[layer], start,
            )  # fmt: skip
        else:
            o, boundaries = ops.gated_delta_rule(
                q, k_, v, *gates, state.recurrent[layer], state.open_k[layer],
                state.open_gamma[layer], state.open_u[layer], start,
            )  # fmt: skip
        out[r0:r1] = o
        for position, s in boundaries:
            if not state.keeps(position):
                continue
            snap = _snapshot(state, position)
            snap.conv[layer].copy_(seq_rows[position - start : position - start + k1])
            snap.recurrent[layer].copy_(s)
    return out
