"""Gated DeltaNet states of a tensor-parallel hybrid engine, on every rank.

Each rank keeps its heads' share of every running sequence's linear-attention state and of
every radix snapshot (lockstep/parallel/sharding.py): a `LinearStatePool` and a
`LinearSnapshotPool` of its own, as many slots as rank 0's. Rank 0's allocators decide every
slot, as its KV pool's allocator decides the KV slots of every rank, so a slot number names
the same sequence or snapshot on every rank and only numbers cross the pipes:

    rank 0 (the engine)                           a worker (`RankStates`)
    LinearState.resume(snapshot) in slot s   ->   ("linear_resume", (s, snapshot's slot))
                                                  the same copy into its slot s
    a step's states                          ->   `StateWire`s: slot, position, the
                                                  snapshot slots reserved (`keep`) and held
                                                  (`captured`) by position
                                                  `LinearState`s over its own slots, which the
                                                  step continues and advances as rank 0's

Everything else rank 0 does with states and snapshots (reserving, handing to the radix
cache, evicting, releasing) moves slot numbers only, so the workers need not hear of it.
Only pooled states cross (the engine's); a cold prefill runs on every rank with states of
their own, gathered afterwards (`gather_state`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import torch

from lockstep.cache.linear_snapshots import LinearSnapshotPool
from lockstep.models.linear_attention import (
    LinearLayout,
    LinearSnapshot,
    LinearState,
    LinearStatePool,
)

if TYPE_CHECKING:
    from lockstep.parallel.collectives import Collectives


class StateWire(NamedTuple):
    """One sequence's state in a step, as a worker needs it: its slot and position, and the
    snapshot slots it reserved (`keep`) or holds captured, by position."""

    slot: int
    position: int
    keep: dict[int, int] | None
    captured: dict[int, int]


def wire_states(states: list[LinearState]) -> list[StateWire]:
    """Rank 0's states of a step as `StateWire`s. Raises ValueError for a state or snapshot
    outside the engine's pools (its tensors live on rank 0 only)."""
    wires = []
    for state in states:
        held = [*(state.keep or {}).values(), *state.captured.values()]
        if state.pool is None or any(snap.pool is None for snap in held):
            raise ValueError(
                "a tensor-parallel hybrid step needs the engine's pooled linear states; "
                "expected states from the engine's state pool"
            )
        keep = None if state.keep is None else {p: s.slot for p, s in state.keep.items()}
        captured = {p: s.slot for p, s in state.captured.items()}
        wires.append(StateWire(state.slot, state.position, keep, captured))
    return wires


class RankStates:
    """A worker's state and snapshot pools (the slot counts rank 0's), and the states of a
    step built over them from rank 0's `StateWire`s."""

    def __init__(self, layout: LinearLayout, state_slots: int, snapshot_slots: int) -> None:
        self.states = LinearStatePool(layout, state_slots)
        self.snapshots = LinearSnapshotPool(layout, snapshot_slots)

    def resume(self, slot: int, snapshot_slot: int | None) -> None:
        """Rank 0 resumed slot `slot` from its snapshot slot `snapshot_slot` (None: from
        nothing): the same copy here."""
        snapshot = None if snapshot_slot is None else self._snapshot(0, snapshot_slot)
        self.states.fill(slot, snapshot)

    def step_states(self, wires: list[StateWire]) -> list[LinearState]:
        """The step's states over this rank's slots. Its slot bookkeeping is rank 0's: these
        states are dropped after the step (their tensors are the pools')."""
        states = []
        for wire in wires:
            state = LinearState.in_slot(self.states, wire.slot, wire.position)
            state.captured = {p: self._snapshot(p, s) for p, s in wire.captured.items()}
            if wire.keep is not None:
                state.keep = {p: self._snapshot(p, s) for p, s in wire.keep.items()}
            states.append(state)
        return states

    def _snapshot(self, position: int, slot: int) -> LinearSnapshot:
        # A view of the slot; never released here (the pool's free list is rank 0's).
        pool = self.snapshots
        return LinearSnapshot(position, pool.conv[slot], pool.recurrent[slot])


def gather_state(state: LinearState, collectives: Collectives) -> LinearState:
    """Every rank's share of one sequence's state (its heads) joined into the state of
    every head, laid out as at TP 1, its captured snapshots too. A collective: every rank
    calls it with the same sequence's state; all get the result."""
    lay, size = state.layout, collectives.size
    full = dataclasses.replace(lay, conv_dim=lay.conv_dim * size,
                               num_key_heads=lay.num_key_heads * size,
                               num_value_heads=lay.num_value_heads * size)  # fmt: skip
    q_width = lay.num_key_heads * lay.key_head_dim

    def channels(t: torch.Tensor) -> torch.Tensor:
        # The convolution's channels q | k | v of each rank's heads -> q | k | v of all.
        parts = [p.split([q_width, q_width, p.shape[-1] - 2 * q_width], dim=-1)
                 for p in collectives.all_gather(t)]  # fmt: skip
        return torch.cat([torch.cat([p[i] for p in parts], dim=-1) for i in range(3)], dim=-1)

    def heads(t: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat(collectives.all_gather(t), dim=dim)

    joined = LinearState(
        full, state.position, channels(state.conv), heads(state.recurrent, 1),
        heads(state.open_k, 2), heads(state.open_gamma, 2), heads(state.open_u, 2),
        heads(state.open_beta, 2),
    )  # fmt: skip
    joined.captured = {
        p: LinearSnapshot(p, channels(s.conv), heads(s.recurrent, 1))
        for p, s in sorted(state.captured.items())
    }
    return joined
