"""Exact speculative decoding: draft k tokens, verify them in one forward, keep what the target
itself would have chosen (docs/speculative.md).

Why nothing changes: by the contract the logits at position t are a function of tokens 0..t
whatever the chunking, and a chosen token is a function of (logits_t, seed, t). A verify
chunk is an extend over the request's KV of k + 1 rows,

    position   s = P+G-1   s+1        ...   s+k          (P prompt tokens, G generated)
    token      last        draft[0]   ...   draft[k-1]
    chooses    target[0]   target[1]  ...   target[k]    (the decode sampler, at s+1+i)

and row i computes exactly what a one-token decode of that position would, provided the
tokens before it are the real ones: draft[0..i-1] == target[0..i-1]. So target[0] is always
kept, and target[i] (i >= 1) is kept while every draft before it matched. Each kept token goes
through the engine's usual append (stop tokens, stop strings, max_tokens), and a stop ends the
run there, exactly as plain decode would have ended.

KV: the chunk wrote k + 1 entries. Those of kept positions (s .. s+m-1 for m kept tokens) hold
the real tokens' bits; the rest are given back to the pool (`Scheduler.discard_unverified`)
before anything caches the request's prefix, so the radix cache never holds a rejected token.
A hybrid model's linear state is cut back to position s+m there too (`LinearState.end_verify`).
"""

from __future__ import annotations

from dataclasses import dataclass

from lockstep.engine.drafters import Drafter
from lockstep.engine.request import Request


@dataclass
class SpeculationCounters:
    """Since start: draft tokens proposed and kept, verify chunks computed, and proposals a
    linear-attention chunk boundary shortened (hybrid models)."""

    drafted: int = 0
    accepted: int = 0
    verify_chunks: int = 0
    boundary_limited: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class Speculator:
    """Chooses the drafts of each decoding request (for the scheduler) and tracks which of a
    verify step's tokens are kept (for the engine)."""

    def __init__(self, drafter: Drafter, num_draft_tokens: int) -> None:
        self.drafter = drafter
        self.num_draft_tokens = num_draft_tokens
        self.counters = SpeculationCounters()

    def propose(self, request: Request, limit: int) -> tuple[int, ...]:
        """Draft tokens to verify after `request`'s last token: at most `limit` (the step's
        rows and free KV slots the scheduler can spare), `num_draft_tokens`, and one less than
        the tokens max_tokens still allows (a verify yields at most drafts + 1 tokens; so the
        last position computed stays below max_model_len, as add_request checks); on a hybrid
        model, few enough that the verify chunk ends before the next linear-attention chunk
        boundary. No drafts for a request whose logits are processed: penalties, grammars and
        min_tokens read the tokens before each position, which a draft row would need before
        they are known. A drafter that `needs_hidden` (MTP) gets the target's hidden row that
        chose the last token, or None where the engine holds none for it."""
        if request.params.processes_logits or request.pending:
            return ()
        left = request.params.max_tokens - len(request.output_ids) - 1
        limit = min(limit, self.num_draft_tokens, left)
        if request.linear_state is not None:
            # A hybrid model's verify chunk (1 + drafts rows) stays inside one chunk of the
            # linear-attention rule, so that rejected rows can be cut (lockstep/models/
            # linear_attention.py, LinearState.end_verify).
            room = request.linear_state.verify_room() - 1
            if room < limit:
                self.counters.boundary_limited += 1
                limit = room
        if limit < 1:
            return ()
        if getattr(self.drafter, "needs_hidden", False):
            # The row that chose the last token, or none (then no guess).
            fresh = request.last_hidden_at == request.num_tokens
            hidden = request.last_hidden if fresh else None
            drafted = self.drafter.propose(request.all_ids, limit, hidden=hidden)  # type: ignore[call-arg]
        else:
            drafted = self.drafter.propose(request.all_ids, limit)
        return tuple(drafted[:limit])

    def start_verify(self, drafts: dict[int, tuple[int, ...]]) -> VerifyRuns:
        """The bookkeeping of one completed step whose verify chunks had `drafts` (keyed by
        id(request))."""
        self.counters.verify_chunks += len(drafts)
        self.counters.drafted += sum(len(d) for d in drafts.values())
        return VerifyRuns(drafts, self.counters)


class VerifyRuns:
    """Which chosen tokens of a step's verify chunks are kept, entry by entry in the order the
    step lists them (target[0], target[1], ...). Requests without drafts pass through."""

    def __init__(self, drafts: dict[int, tuple[int, ...]], counters: SpeculationCounters):
        self.drafts = drafts
        self.counters = counters
        self._seen: dict[int, int] = {}  # entries of each run looked at so far
        self._closed: set[int] = set()  # runs ended by a mismatch or a finish

    def keeps(self, request: Request) -> bool:
        """Whether the next chosen token of `request` is kept: always for the first entry of
        a run; for entry i >= 1 only while the run is open and the token kept before it (the
        last appended) equals draft[i - 1], the token row i was computed after."""
        key = id(request)
        draft = self.drafts.get(key)
        if draft is None:
            return True
        i = self._seen.get(key, 0)
        self._seen[key] = i + 1
        if key in self._closed:
            return False
        if i > 0 and request.output_ids[-1] != draft[i - 1]:
            self._closed.add(key)
            return False
        if i > 0:
            self.counters.accepted += 1
        return True

    def kept(self, request: Request, finished: bool) -> None:
        """A kept token was appended; `finished`: it ended the request (the run ends)."""
        if finished:
            self._closed.add(id(request))
