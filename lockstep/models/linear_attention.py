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
the chunk its next position falls in, and that chunk's rows so far ("open rows": key, the
cumulative log decay and the corrected value u of each). A step of any size continues from
it with the per-row formula of `Ops.gated_delta_rule`, so a decode step gives the bits of a
prefill. Each boundary a step crosses is captured as a `LinearSnapshot`, which the radix cache
keeps beside the full-attention layers' KV; a prefix hit resumes from the last snapshot at or
below the matched length and recomputes the rest.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from lockstep.models.spec import ModelSpec

if TYPE_CHECKING:
    from lockstep.models.forward_batch import ForwardBatch
    from lockstep.ops.base import Ops

# Rows per chunk of the gated delta rule. Part of the numerics: changing it changes the bits.
CHUNK = 32


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

    @classmethod
    def of(cls, spec: ModelSpec, device: torch.device, chunk: int = CHUNK) -> LinearLayout:
        lin = spec.linear
        assert lin is not None, "not a hybrid model"
        num = sum(spec.is_linear(i) for i in range(spec.num_layers))
        return cls(num, lin.conv_dim, lin.conv_kernel, lin.num_key_heads, lin.num_value_heads,
                   lin.key_head_dim, lin.value_head_dim, chunk, device)  # fmt: skip

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.float32, device=self.device)

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of one `LinearSnapshot` (float32 window and state, every linear layer)."""
        window = (self.conv_kernel - 1) * self.conv_dim
        state = self.num_value_heads * self.key_head_dim * self.value_head_dim
        return 4 * self.num_layers * (window + state)


@dataclass
class LinearSnapshot:
    """The state after `position` tokens (a multiple of the chunk): conv windows [L, K-1,
    conv_dim] and boundary states [L, Hv, Dk, Dv]. Never modified once complete."""

    position: int
    conv: torch.Tensor
    recurrent: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * 4 + self.recurrent.numel() * 4


@dataclass
class LinearState:
    """One sequence's working state at `position` (the next position to compute): windows
    [L, K-1, conv_dim], the boundary state of the chunk holding `position` [L, Hv, Dk, Dv]
    and that chunk's open rows (keys [L, C, Hk, Dk], cumulative log decays [L, C, Hv],
    corrected values [L, C, Hv, Dv]; rows 0 .. position % C - 1 are meaningful). `captured`:
    snapshots of the boundaries crossed since the owner last took them."""

    layout: LinearLayout
    position: int
    conv: torch.Tensor
    recurrent: torch.Tensor
    open_k: torch.Tensor
    open_gamma: torch.Tensor
    open_u: torch.Tensor
    captured: dict[int, LinearSnapshot] = field(default_factory=dict)

    @classmethod
    def resume(cls, layout: LinearLayout, snapshot: LinearSnapshot | None) -> LinearState:
        """A state at the snapshot's position (a copy: the snapshot stays intact), or at
        position 0 from nothing."""
        z, lay = layout._zeros, layout
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
        )  # fmt: skip

    def take_captured(self) -> dict[int, LinearSnapshot]:
        """Hand over the captured snapshots (the caller keeps or drops them)."""
        taken, self.captured = self.captured, {}
        return taken

    def meaningful(self) -> tuple[torch.Tensor, ...]:
        """The tensors that define the state (open rows cut to those in use), for tests."""
        r = self.position % self.layout.chunk
        return (self.conv, self.recurrent, self.open_k[:, :r], self.open_gamma[:, :r],
                self.open_u[:, :r])  # fmt: skip


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
    out_proj: torch.Tensor


def gated_deltanet(
    ops: Ops,
    x: torch.Tensor,
    w: LinearWeights,
    layer: int,
    batch: ForwardBatch,
    layout: LinearLayout,
    eps: float,
    rows: list[int] | None = None,
) -> torch.Tensor:
    """One Gated DeltaNet layer over the step's rows x [T, hidden] -> [T, hidden], continuing
    each sequence's `LinearState` (batch.linear_states, in sequence order) in linear layer
    `layer`. `rows`: each sequence's row count, known on the host (else read from the batch).
    Every op is row-local except the convolution (the sequence's own previous rows)
    and the delta rule (`Ops.gated_delta_rule`)."""
    lay = layout
    kd, vd = lay.num_key_heads * lay.key_head_dim, lay.num_value_heads * lay.value_head_dim
    hv, k1 = lay.num_value_heads, lay.conv_kernel - 1
    t = x.shape[0]
    proj = ops.linear(x, w.in_proj)
    mixed, z, b, a = proj.split([lay.conv_dim, vd, hv, hv], dim=1)
    g, beta = ops.gdn_gates(a.contiguous(), b.contiguous(), w.a_log, w.dt_bias)
    out = torch.empty((t, hv, lay.value_head_dim), dtype=torch.float32, device=x.device)
    cu_q = batch.meta.cu_q.tolist() if rows is None else [0, *itertools.accumulate(rows)]
    states = batch.linear_states
    assert states is not None and len(states) == len(cu_q) - 1, "one LinearState per sequence"
    for seq, state in enumerate(states):
        r0, r1 = cu_q[seq], cu_q[seq + 1]
        n, start = r1 - r0, state.position
        # The window, then this step's rows: row i + k - 1 + 1 of `rows` feeds output i.
        rows = torch.cat([state.conv[layer], mixed[r0:r1].float()])
        conv = rows[0:n] * w.conv[:, 0]
        for k in range(1, k1 + 1):  # ascending taps, one multiply and one add each
            conv = conv + rows[k : k + n] * w.conv[:, k]
        act = ops.silu(conv.contiguous())
        state.conv[layer].copy_(rows[n : n + k1])
        q, k_, v = act.split([kd, kd, vd], dim=1)
        dk = lay.key_head_dim
        q = ops.l2_normalize(q.reshape(-1, dk), 1e-6, dk**-0.5).reshape(n, -1, dk)
        k_ = ops.l2_normalize(k_.reshape(-1, dk), 1e-6, 1.0).reshape(n, -1, dk)
        v = v.reshape(n, hv, lay.value_head_dim).contiguous()
        o, boundaries = ops.gated_delta_rule(
            q, k_, v, g[r0:r1].contiguous(), beta[r0:r1].contiguous(), state.recurrent[layer],
            state.open_k[layer], state.open_gamma[layer], state.open_u[layer], start,
        )  # fmt: skip
        out[r0:r1] = o
        for position, s in boundaries:
            snap = state.captured.get(position)
            if snap is None:
                snap = LinearSnapshot(
                    position,
                    lay._zeros(lay.num_layers, k1, lay.conv_dim),
                    lay._zeros(lay.num_layers, hv, dk, lay.value_head_dim),
                )
                state.captured[position] = snap
            snap.conv[layer].copy_(rows[position - start : position - start + k1])
            snap.recurrent[layer].copy_(s)
    normed = ops.rms_norm(out.reshape(-1, lay.value_head_dim), w.norm, eps)
    gated = ops.gate_activation(normed, z.reshape(-1, lay.value_head_dim).contiguous(), "silu")
    return ops.linear(gated.reshape(t, vd).to(x.dtype), w.out_proj)
