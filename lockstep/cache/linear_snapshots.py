"""Radix snapshots of linear-attention state: a pool of fixed slots, and which chunk
boundaries a request keeps.

A snapshot (`LinearSnapshot`: every linear layer's conv window and recurrent state after a
chunk boundary) costs as much as thousands of tokens of KV, so the prefix cache keeps them in a
budget of their own: `LinearSnapshotPool` preallocates `num_slots` snapshots once, at start-up,
and never allocates another. Each slot is, at any time, exactly one of:

    free        in the pool's free list
    reserved    by a running request for a boundary its next step crosses (`LinearState.keep`)
    captured    filled by that step, held by the request until it goes to the cache
                (`LinearState.captured`, handed over by `Scheduler.cache_prefix`)
    cached      in a radix node (`Node.states`) until the node is evicted

so free + reserved + captured + cached == num_slots (`Scheduler.check_integrity`). A request
whose boundary finds the pool empty and nothing evictable does not keep that snapshot (the
cache then resumes from an earlier one); it never allocates more.

Which boundaries are kept (`SnapshotPolicy.kept`): a prefix hit resumes from the last snapshot
at or below the matched length and recomputes the rest, so the tree needs snapshots where
matches end:
  - at the end of a prompt: the last boundary at or below it (a later prompt that extends it,
    the next turn of a chat) and the last one at or below its last token (the same prompt
    again, as RL sends it n times: a match covers at most prompt_len - 1 tokens);
  - every `interval` tokens (a multiple of the chunk), so a request branching from a shared
    prefix resumes at most interval - 1 tokens before the branch point;
  - at the end of the generated text (`SnapshotPolicy.latest`): each step that crosses a
    boundary past the prompt keeps its last one, and the request gives back the one it held
    from an earlier step, so a finished request leaves the last boundary at or below its end
    (the next turn of a chat resumes there) at the cost of one slot per decoding request.

    positions  0 .... 512 .... 1024 .. 1184 | 1200 (prompt end) .... 1536 .. 1600 | 1610 (end)
    kept             ^512      ^1024    ^1184                        ^1536   ^1600
                                                         (interval 512, chunk 32)

The default interval (`EngineConfig.linear_snapshot_interval`) is 512: a snapshot of
random:qwen3.5-9b costs the KV of about 1,600 tokens, and a hit recomputes at most 511 tokens
past the last one, a sixteenth of a default CUDA step (8,192 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from lockstep.cache.kv_pool import CacheIntegrityError
from lockstep.models.linear_attention import LinearLayout, LinearSnapshot


@dataclass(frozen=True)
class SnapshotPolicy:
    """Which chunk boundaries of a sequence the radix cache keeps (module docstring)."""

    chunk: int
    interval: int

    def __post_init__(self) -> None:
        if self.interval < 1 or self.interval % self.chunk:
            raise ValueError(f"interval={self.interval}: expected a multiple of {self.chunk}")

    def fixed(self, prompt_len: int, position: int) -> bool:
        """Whether a sequence whose prompt holds `prompt_len` tokens keeps the boundary at
        `position` for good: an interval point or one of its prompt's ends."""
        c = self.chunk
        ends = (prompt_len // c * c, (prompt_len - 1) // c * c)
        return position % self.interval == 0 or position in ends

    def kept(self, prompt_len: int, start: int, end: int) -> list[int]:
        """The boundaries p in (start, end] (a step computing positions start..end-1 crosses
        them) kept for good (`fixed`), ascending."""
        first = (start // self.chunk + 1) * self.chunk
        return [p for p in range(first, end + 1, self.chunk) if self.fixed(prompt_len, p)]

    def latest(self, prompt_len: int, start: int, end: int) -> int | None:
        """The last boundary in (start, end] when it lies past the prompt and is not kept for
        good: the end of the generated text so far, kept until a later step replaces it."""
        p = end // self.chunk * self.chunk
        if p <= max(start, prompt_len) or self.fixed(prompt_len, p):
            return None
        return p


class LinearSnapshotPool:
    """`num_slots` snapshots preallocated as float32 tensors, windows [N, L, K-1, conv_dim]
    and states [N, L, Hv, Dk, Dv]; `acquire` lends one (a `LinearSnapshot` viewing its slot)
    and `release` takes it back. Lending never allocates: an empty pool lends nothing."""

    def __init__(self, layout: LinearLayout, num_slots: int) -> None:
        lay, z = layout, layout._zeros
        self.layout = layout
        self.num_slots = num_slots
        self.conv = z(num_slots, lay.num_layers, lay.conv_kernel - 1, lay.conv_dim)
        self.recurrent = z(num_slots, lay.num_layers, lay.num_value_heads, lay.key_head_dim,
                           lay.value_head_dim)  # fmt: skip
        self._free = list(range(num_slots - 1, -1, -1))
        self._lent = [False] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        """The pool's memory: num_slots x `LinearLayout.snapshot_bytes`."""
        return self.num_slots * self.layout.snapshot_bytes

    def acquire(self, position: int) -> LinearSnapshot | None:
        """A free slot as the snapshot after `position` tokens (its contents are whatever the
        last holder left: the step that captures it overwrites every element), or None when
        every slot is lent."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._lent[slot] = True
        return LinearSnapshot(position, self.conv[slot], self.recurrent[slot], self, slot)

    def release(self, snapshot: LinearSnapshot) -> None:
        """Take a lent snapshot's slot back; the snapshot must not be read afterwards. Raises
        ValueError for a snapshot this pool did not lend or already took back."""
        slot = snapshot.slot
        if snapshot.pool is not self or not 0 <= slot < self.num_slots or not self._lent[slot]:
            raise ValueError(f"release of a snapshot this pool has not lent: slot {slot}")
        self._lent[slot] = False
        self._free.append(slot)
        snapshot.pool, snapshot.slot = None, -1

    def check_integrity(self, held: list[LinearSnapshot]) -> None:
        """`held`: every snapshot of this pool outside it (requests' and the tree's). Raises
        `CacheIntegrityError` unless they are distinct lent slots and free + held == total."""
        slots = [s.slot for s in held]
        problems = []
        if len(set(slots)) != len(slots):
            problems.append(f"{len(slots) - len(set(slots))} slot(s) held twice")
        if any(not 0 <= s < self.num_slots or not self._lent[s] for s in slots):
            problems.append("a held snapshot's slot is free in the pool")
        if self.num_free + len(held) != self.num_slots:
            problems.append(f"free {self.num_free} + held {len(held)} != {self.num_slots} slots")
        if problems:
            raise CacheIntegrityError("LinearSnapshotPool: " + "; ".join(problems))

    def __repr__(self) -> str:
        return f"LinearSnapshotPool(slots={self.num_slots}, free={self.num_free})"
