"""Comparison of two runs of the same sequence, and the per-scenario tally of comparisons.

Comparisons are exact by default: token ids (or token strings where a server gives no ids)
must be equal, and logprobs must be equal as the floats the server wrote in JSON. `atol` lets
people checking other engines allow a tolerance; it defaults to 0.

Once the tokens of two runs differ at position t, positions after t are conditioned on
different text and say nothing about determinism, so comparison stops at the first flip.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass(frozen=True)
class PairDiff:
    """How a run differs from its reference.

    positions: positions compared (up to and including the first token flip).
    flip_at: the first position whose token differs (a run that stops earlier or later than
        the reference flips where the shorter one ends), or None.
    first_divergence: the first position whose token differs or whose |delta logprob| exceeds
        atol, or None.
    deltas: |delta logprob| at each compared position with equal tokens (inf when only one
        side has a logprob there)."""

    positions: int
    flip_at: int | None
    first_divergence: int | None
    deltas: tuple[float, ...]

    @property
    def max_abs_delta(self) -> float:
        return max(self.deltas, default=0.0)


def compare_runs(
    ref_keys: Sequence[Any],
    ref_logprobs: Sequence[float | None],
    keys: Sequence[Any],
    logprobs: Sequence[float | None],
    atol: float = 0.0,
) -> PairDiff:
    """Compare a run (`keys`, `logprobs`) with its reference, position by position."""
    n = min(len(ref_keys), len(keys))
    deltas: list[float] = []
    flip_at: int | None = None
    first_div: int | None = None
    for i in range(n):
        if ref_keys[i] != keys[i]:
            flip_at = i
            break
        delta = _abs_delta(_at(ref_logprobs, i), _at(logprobs, i))
        deltas.append(delta)
        if first_div is None and not delta <= atol:
            first_div = i
    else:
        if len(ref_keys) != len(keys):
            flip_at = n
    if flip_at is not None and first_div is None:
        first_div = flip_at
    positions = n if flip_at is None else min(flip_at + 1, n)
    return PairDiff(positions, flip_at, first_div, tuple(deltas))


def _at(values: Sequence[float | None], i: int) -> float | None:
    return values[i] if i < len(values) else None


def _abs_delta(a: float | None, b: float | None) -> float:
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        return math.inf
    if a == b:
        # Covers -0.0 == 0.0, which JSON writers may spell differently for the same result.
        return 0.0
    return abs(a - b)


@dataclass
class ScenarioResult:
    """What one scenario did and found. `status` starts as PASS; `fail` sets FAIL with the
    first reason (later reasons become notes); `finish` turns any divergence into a FAIL."""

    name: str
    requests: int = 0
    positions: int = 0
    flips: int = 0
    first_divergence: int | None = None
    max_abs_delta: float = 0.0
    cached_tokens: int = 0
    status: str = PASS
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    truncated: bool = False
    elapsed_s: float = 0.0
    max_delta_by_position: dict[int, float] = field(default_factory=dict)
    _diverged_pairs: int = 0
    _pairs: int = 0

    def add_pair(self, diff: PairDiff) -> None:
        self._pairs += 1
        self.positions += diff.positions
        if diff.flip_at is not None:
            self.flips += 1
        if diff.first_divergence is not None:
            self._diverged_pairs += 1
            if self.first_divergence is None or diff.first_divergence < self.first_divergence:
                self.first_divergence = diff.first_divergence
        self.max_abs_delta = max(self.max_abs_delta, diff.max_abs_delta)
        for pos, d in enumerate(diff.deltas):
            if d > self.max_delta_by_position.get(pos, -1.0):
                self.max_delta_by_position[pos] = d

    def add_cached(self, cached_tokens: int | None) -> None:
        self.cached_tokens += cached_tokens or 0

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def fail(self, reason: str) -> None:
        if self.status == FAIL:
            self.notes.append(reason)
            return
        self.status = FAIL
        self.reason = reason

    def skip(self, reason: str) -> None:
        self.status = SKIP
        self.reason = reason

    def finish(self, atol: float) -> None:
        """Turn divergences into a FAIL whose reason says how many runs differed and where."""
        if self._diverged_pairs:
            bound = "exactly" if atol == 0 else f"within atol={atol:g}"
            self.fail(
                f"{self._diverged_pairs} of {self._pairs} runs differ from their reference"
                f" (not {bound}): {self.flips} token flips, first divergence at position"
                f" {self.first_divergence}, max |delta logprob| {self.max_abs_delta:.3g}"
            )
        elif self.status == PASS and self._pairs == 0 and not self.reason:
            self.reason = "nothing compared"

    @property
    def pairs(self) -> int:
        return self._pairs

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "reason": self.reason,
            "requests": self.requests,
            "runs_compared": self._pairs,
            "positions_compared": self.positions,
            "greedy_flips": self.flips,
            "first_divergence": self.first_divergence,
            "max_abs_delta_logprob": _finite_or_str(self.max_abs_delta),
            "cached_tokens": self.cached_tokens,
            "truncated_by_budget": self.truncated,
            "elapsed_s": round(self.elapsed_s, 3),
            "notes": list(self.notes),
            "max_abs_delta_by_position": [
                _finite_or_str(self.max_delta_by_position[p])
                for p in sorted(self.max_delta_by_position)
            ],
        }


def _finite_or_str(x: float) -> float | str:
    # Strict JSON has no Infinity; write it as a string that readers can still recognize.
    return x if math.isfinite(x) else str(x)
