"""Drafters: what proposes the tokens a speculative verify step checks (docs/speculative.md).

A drafter only guesses. Whatever it proposes, the target model's own token at each position
decides what is kept (lockstep/engine/speculative.py), so a drafter changes how many tokens a
step yields, never which tokens or logprobs come out. That is why a drafter needs no test of
its own bits: a wrong guess costs a rejected row, nothing else.

    Drafter.propose(tokens, limit) -> at most `limit` token ids that may follow `tokens`

`NgramDrafter` (prompt lookup) needs no model: it finds the last n tokens earlier in the
prompt and output and proposes what followed them there. A drafter that runs a model of its
own (MTP layers, a small draft model) implements the same method; it would keep its own KV
per sequence, which the method's `tokens` (prompt and output so far) are enough to rebuild.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class Drafter(Protocol):
    """Proposes tokens that may follow a sequence. `propose` must not depend on anything but
    its arguments and the drafter's own fixed configuration, so that a run can be repeated."""

    name: str

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        """At most `limit` (>= 1) token ids that may come after `tokens` (the prompt and the
        output so far); an empty list when the drafter has no guess."""
        ...


class NgramDrafter:
    """Prompt lookup: match the last n tokens (n from `max_n` down to `min_n`, the longest
    first) against the earlier context and propose the tokens that followed the match. Among
    matches, the most recent one that has `limit` tokens after it, else the most recent one:
    copied text tends to continue where it was last seen.

    Costs one vectorised scan of the context per n tried, on the host, per verify step."""

    name = "ngram"

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes min_n={min_n}, max_n={max_n}: expected 1 <= min <= max")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        length = len(tokens)
        if limit < 1 or length < self.min_n + 1:
            return []
        context = np.asarray(tokens, dtype=np.int64)
        # Windows start at 0..length-1-n over context[:-1]: each one has at least one token
        # after it, and the suffix never matches itself.
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)
            starts = np.flatnonzero((windows == context[length - n :]).all(axis=1))
            if starts.size == 0:
                continue
            full = starts[starts + n + limit <= length]
            start = int(full[-1] if full.size else starts[-1]) + n
            return [int(t) for t in context[start : start + limit]]
        return []


def make_drafter(method: str, min_n: int, max_n: int) -> Drafter:
    """The drafter an engine option names (`EngineConfig.speculative`)."""
    if method == "ngram":
        return NgramDrafter(min_n, max_n)
    raise ValueError(f"speculative={method!r} is invalid: expected ngram")
