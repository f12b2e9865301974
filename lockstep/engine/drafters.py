"""Drafters: what proposes the tokens a speculative verify step checks (docs/speculative.md).

A drafter only guesses. Whatever it proposes, the target model's own token at each position
decides what is kept (lockstep/engine/speculative.py), so a drafter changes how many tokens a
step yields, never which tokens or logprobs come out. That is why a drafter needs no test of
its own bits: a wrong guess costs a rejected row, nothing else.

    Drafter.propose(tokens, limit) -> at most `limit` token ids that may follow `tokens`

`NgramDrafter` (prompt lookup) needs no model: it finds the last n tokens earlier in the
prompt and output and proposes what followed them there. `DraftModelDrafter` runs a small
model of the same tokenizer in an engine of its own, greedily, from the whole context; that
engine's prefix cache keeps what it computed for the sequence, so each proposal computes only
the tokens added since the last one and its own drafts. `MtpDrafter` runs the model's own
multi-token-prediction layer (lockstep/models/mtp.py) from the target's hidden row that chose
the last token: a drafter that `needs_hidden` gets that row as `propose(..., hidden=row)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch

    from lockstep.engine.engine import Engine
    from lockstep.models.mtp import MtpModel

# A text whose token ids a draft model's tokenizer must give as the target's does.
TOKENIZER_PROBE = "Lockstep drafts 123 tokens: naïve café, <tag>, x = y + 1;\n"


class Drafter(Protocol):
    """Proposes tokens that may follow a sequence. `propose` must not depend on anything but
    its arguments and the drafter's own fixed configuration, so that a run can be repeated."""

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        """At most `limit` (>= 1) token ids that may come after `tokens` (the prompt and the
        output so far); an empty list when the drafter has no guess."""
        ...


class NgramDrafter:
    """Prompt lookup: match the last n tokens (n from `max_n` down to `min_n`, the longest
    first) against the earlier context and propose the tokens that followed the match. Among
    matches, the most recent one that has `limit` tokens after it, else the most recent one:
    copied text tends to continue where it was last seen.

    Costs, on the host, per verify step and request: a copy of the context into an array and
    one comparison pass over it, then a check of the n-grams where the last token recurs."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes min_n={min_n}, max_n={max_n}: expected 1 <= min <= max")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        length = len(tokens)
        if limit < 1 or length < self.min_n + 1:
            return []
        context = np.fromiter(tokens, dtype=np.int64, count=length)
        # Where an earlier occurrence of the suffix can end: positions before the last that
        # hold the last token (one pass; the n-grams are then checked at those few places).
        ends = np.flatnonzero(context[: length - 1] == context[length - 1])
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            found = ends[ends >= n - 1]
            if n > 1 and found.size:
                before = context[found[:, None] + np.arange(1 - n, 0)]  # the n - 1 tokens before
                found = found[(before == context[length - n : length - 1]).all(axis=1)]
            if found.size == 0:
                continue
            after = found + 1  # where each match's continuation starts
            full = after[after + limit <= length]
            start = int(full[-1] if full.size else after[-1])
            return [int(t) for t in context[start : start + limit]]
        return []


class DraftModelDrafter:
    """A small model proposes its own greedy continuation, computed by `engine` (an engine
    of the draft model on the same device, used by nothing else). Its tokens are only
    guesses: the target decides, so the draft engine's options (dtype, mode) change how many
    drafts are kept, never an output.

    Costs, per verify step and request: the draft engine's prefill of the tokens the context
    gained since its last proposal (its prefix cache holds the rest) and `limit` - 1 decode
    steps, run one request at a time on the host's thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        from lockstep.engine.sampling_params import SamplingParams

        engine = self.engine
        limit = min(limit, engine.max_model_len - len(tokens))
        if limit < 1:
            return []  # past the draft model's context
        params = SamplingParams(max_tokens=limit, temperature=0.0, ignore_eos=True)
        engine.add_request("draft", list(tokens), params)
        drafted: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                drafted += out.new_token_ids
        return drafted


class MtpDrafter:
    """The model's multi-token-prediction layer drafts greedily from the target's final-normed
    hidden row that chose the last token (`hidden`) and that token; without such a row (a
    request whose last token came from a step before a preemption, say) it has no guess.

    Costs, per verify step and request: `limit` forwards of one row through the MTP layer
    (one decoder layer, the projection over 2 * hidden and the LM head), on the target's
    device and host thread, before the target's step; the engine keeps one hidden row per
    running request. Its attention sees only its own drafts (lockstep/models/mtp.py)."""

    needs_hidden = True

    def __init__(self, model: MtpModel) -> None:
        self.model = model

    def propose(
        self, tokens: Sequence[int], limit: int, hidden: torch.Tensor | None = None
    ) -> list[int]:
        if hidden is None or limit < 1 or not tokens:
            return []
        return self.model.draft(hidden, tokens[-1], limit)


def make_drafter(method: str, min_n: int, max_n: int) -> Drafter:
    """The drafter of prompt lookup (`EngineConfig.speculative` "ngram"); the draft model's
    needs an engine (`Engine` builds it)."""
    if method == "ngram":
        return NgramDrafter(min_n, max_n)
    raise ValueError(f"speculative={method!r} is invalid here: expected ngram")
