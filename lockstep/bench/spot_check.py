"""The throughput benchmark's bitwise spot check: requests re-run alone repeat their bits.

After the timed run, a few of its requests run again in the same engine, one at a time, each
after the prefix cache is flushed: a cold prefill with no batch-mates, where the timed run
had hundreds of them, chunked prefills and (maybe) preemptions. By the contract
(docs/design.md) each must give the same token ids and the same logprobs of its chosen tokens,
bit for bit: logprobs are compared as float64 bit patterns, so 0.0 and -0.0 differ and a NaN
equals only the same NaN. The engine reports every chosen token's logprob (one float per
token), so the timed run needs no logprobs option for this.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lockstep.engine.engine import Engine
from lockstep.engine.sampling_params import SamplingParams


@dataclass
class Generation:
    """What one request generated: token ids and each one's logprob."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Mismatch:
    """The first difference between a request's two runs: at generated position `position`,
    `what` ("token", "logprob" or "length") was `expected` in the timed run and `got` alone."""

    request: int
    position: int
    what: str
    expected: Any
    got: Any

    def describe(self) -> str:
        return (f"request {self.request}, generated position {self.position}: {self.what} "
                f"{self.expected} in the batch, {self.got} alone")  # fmt: skip


def _bits(value: float) -> str:
    return struct.pack("<d", value).hex()


def first_difference(request: int, expected: Generation, got: Generation) -> Mismatch | None:
    """The first position where `got` differs from `expected` in a token id or in the bits of
    a logprob, or where one run is longer; None when they are identical."""
    pairs = zip(expected.token_ids, expected.logprobs, got.token_ids, got.logprobs, strict=False)
    for position, (tok_a, lp_a, tok_b, lp_b) in enumerate(pairs):
        if tok_a != tok_b:
            return Mismatch(request, position, "token", tok_a, tok_b)
        if _bits(lp_a) != _bits(lp_b):
            return Mismatch(request, position, "logprob", f"{lp_a!r} ({lp_a.hex()})",
                            f"{lp_b!r} ({lp_b.hex()})")  # fmt: skip
    if len(expected.token_ids) != len(got.token_ids):
        n = min(len(expected.token_ids), len(got.token_ids))
        return Mismatch(request, n, "length", len(expected.token_ids), len(got.token_ids))
    return None


@dataclass
class SpotCheckResult:
    """Which requests were re-run (indices into the benchmark's requests) and how they
    differed; `passed` when none did."""

    requests: list[int]
    mismatches: list[Mismatch]

    @property
    def passed(self) -> bool:
        return not self.mismatches

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "passed": self.passed,
            "mismatches": [asdict(m) for m in self.mismatches],
        }


def choose_requests(num_requests: int, k: int, seed: int) -> list[int]:
    """k distinct request indices (all of them when k >= num_requests), drawn from `seed`."""
    return sorted(random.Random(seed).sample(range(num_requests), min(k, num_requests)))


def run_alone(
    engine: Engine, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
) -> Generation:
    """Flush the prefix cache, then run one request to its end with nothing beside it."""
    if engine.has_unfinished():
        raise RuntimeError("a request re-run alone needs an idle engine")
    engine.flush_cache()
    engine.add_request(request_id, list(prompt_ids), params)
    out = Generation()
    while engine.has_unfinished():
        for step in engine.step():
            out.token_ids.extend(step.new_token_ids)
            out.logprobs.extend(step.new_token_logprobs)
    return out


def spot_check(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    generations: Sequence[Generation],
    indices: Sequence[int],
) -> SpotCheckResult:
    """Re-run `prompts[i]` with `params[i]` alone for each i in `indices` and compare with
    `generations[i]`, the timed run's output (module docstring)."""
    mismatches = []
    for i in indices:
        alone = run_alone(engine, f"spot-check-{i}", prompts[i], params[i])
        mismatch = first_difference(i, generations[i], alone)
        if mismatch is not None:
            mismatches.append(mismatch)
    return SpotCheckResult(list(indices), mismatches)
