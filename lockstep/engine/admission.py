"""Admission's view of the KV pool's future: what the running requests will hold at each coming
step, counting that each releases its slots when it ends (lockstep/engine/scheduler.py).

A request is described by what it still needs beyond the slots it holds now: `prompt_left`
positions of prompt (taken at once, in the view), then one slot a step for `output_left`
steps, ending after `ends_in` steps, when it frees everything it holds, `held` included. The
view is conservative where a real run can be late: prompt positions count from the first step
although they are computed a chunk a step, and each prompt chunk is a step of delay before
the request ends (`ends_in` = prefill steps + output_left). A request that ends early (a stop
token) only frees sooner.

A waiting request fits when, at every step up to its own end, the running requests' needs plus
its own stay within the room the pool has now (free and evictable slots). Requests of equal
lengths admitted together end together, and nobody else enters until they do; requests of
mixed lengths let newcomers in as soon as their peaks and the others' ends allow, which sums of
final sizes would not (`scripts/admission_simulation.py` counts the steps either way:
docs/results.md, "Admission").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Need:
    """One request's future beyond its held slots (see the module docstring)."""

    prompt_left: int
    output_left: int
    ends_in: int
    held: int


class PoolProjection:
    """The running requests' needs, and whether one more fits beside them."""

    def __init__(self, needs: list[Need]) -> None:
        self._needs = list(needs)
        self._tensors: tuple[torch.Tensor, ...] | None = None

    def add(self, need: Need) -> None:
        self._needs.append(need)
        self._tensors = None

    def _columns(self) -> tuple[torch.Tensor, ...]:
        if self._tensors is None:
            rows = [(n.prompt_left, n.output_left, n.ends_in, n.held) for n in self._needs]
            table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)
            self._tensors = tuple(table.unbind(1))
        return self._tensors

    def peak_with(self, new: Need) -> int:
        """The most slots, beyond those held now, that the running requests and `new` need at
        once at any step up to `new`'s end. The peak of a sum of rising lines that drop when
        they end is at one of their ends, so those steps are the only ones looked at."""
        steps = [new.ends_in]
        if self._needs:
            prompt, output, ends, held = self._columns()
            at = torch.cat([ends[ends <= new.ends_in], torch.tensor([new.ends_in])])
            alive = ends[None, :] >= at[:, None]
            rising = prompt[None, :] + torch.minimum(at[:, None], output[None, :])
            running = torch.where(alive, rising, -held[None, :]).sum(1)
            steps = at.tolist()
            totals = running.tolist()
        else:
            totals = [0]
        return max(
            total + new.prompt_left + min(k, new.output_left)
            for k, total in zip(steps, totals, strict=True)
        )
