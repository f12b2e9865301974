"""The state of one request as the scheduler and engine see it.

Token layout of a request (P prompt tokens, G generated so far):

    all_ids   = prompt_ids + output_ids            length P + G
    slots[j]  = KV slot holding position j, for j < num_computed
    prefix    : slots[:prefix_len] belong to the radix cache (locked via `prefix_node`);
                slots[prefix_len:num_computed] are the request's own (counted as "in use").

Logprobs by position (p predicts all_ids[p] from the logits of position p-1):
    prompt_logprobs[p]  for 1 <= p < prompt_logprobs_next (requests that asked for them)
    output_logprobs[g]  for the generated token at position P + g (always known)
These are what the request gives the radix cache with its KV (`computed_logprobs`), and a
scored prefix hit fills prompt_logprobs from the cache (`take_cached_logprobs`).

A step computes positions num_computed .. end-1. When end == num_tokens, the logits of the
last row choose the next token. With overlapped decode (Engine.step) a token may be `pending`:
chosen on the device by a launched step, not yet appended to output_ids; it counts in
num_tokens (its position exists and the next step may compute it) but not in all_ids. After
a preemption the request recomputes its KV from the cache/prompt; position invariance makes
the recomputed bits identical, so nothing is re-sampled.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lockstep.cache.stored_logprobs import StoredLogprobs
from lockstep.engine.outputs import TokenLogprob
from lockstep.engine.sampling_params import SamplingParams


class SlotTable:
    """A request's KV slots by position: a list (what the radix cache and the pool take) and
    an int32 array mirror grown in place (what attention metadata takes), so a decode step
    costs O(new slots) on the host instead of O(context)."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self._mirror = np.empty(0, dtype=np.int32)
        self._synced = 0  # mirror[:_synced] equals ids[:_synced]

    def __len__(self) -> int:
        return len(self.ids)

    def extend(self, slots: list[int]) -> None:
        self.ids.extend(slots)

    def replace_prefix(self, slots: list[int]) -> None:
        """Overwrite ids[:len(slots)] (a request adopting the radix cache's slots)."""
        self.ids[: len(slots)] = slots
        k = min(len(slots), self._synced)
        if k:
            self._mirror[:k] = slots[:k]

    def clear(self) -> None:
        self.ids = []
        self._synced = 0

    def truncate(self, n: int) -> None:
        """Keep ids[:n] (a verify step giving back its rejected positions' slots)."""
        del self.ids[n:]
        self._synced = min(self._synced, n)

    def array(self, n: int) -> np.ndarray:
        """ids[:n] as an int32 numpy array (a view of the mirror: read it before the next
        change)."""
        if self._synced < n:
            if self._mirror.size < n:
                grown = np.empty(max(n, 2 * self._mirror.size, 64), dtype=np.int32)
                grown[: self._synced] = self._mirror[: self._synced]
                self._mirror = grown
            self._mirror[self._synced : n] = self.ids[self._synced : n]
            self._synced = n
        return self._mirror[:n]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int  # admission order key (a counter, so scheduling is reproducible)
    namespace: str | None = None
    streams: bool = False  # the caller reads tokens as they come: bound its inter-token gaps
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    slots: SlotTable = field(default_factory=SlotTable)
    num_computed: int = 0
    prefix_len: int = 0  # leading slots owned by the radix cache
    prefix_node: Any = None  # locked radix node covering slots[:prefix_len]
    cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_next: int = 1  # next prompt position whose logprob is still owed
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output_ids
    num_preemptions: int = 0
    prompt_counted: bool = False  # prompt/cached tokens added to the engine's totals
    text_output: Any = None  # TextOutput: detokenization and stop strings (None: not here)
    prompt_logprobs_sent: bool = False
    # Tokens chosen by launched steps, not yet appended: 0 or 1, and 2 between launching a
    # step ahead and completing the step before it.
    pending: int = 0
    # Logits processing (lockstep/engine/logits_processing.py), set by the engine on add.
    grammar: Any = None  # GrammarState of a structured output
    bad_word_ids: list[list[int]] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()  # masked while the output is below min_tokens
    prompt_token_set: list[int] = field(default_factory=list)  # for repetition_penalty
    # Hybrid models: the LinearState at num_computed while running (None otherwise).
    linear_state: Any = None
    # MTP drafting (lockstep/engine/drafters.py): the target's final-normed hidden row that
    # chose the last token, and the token count when it did (a row for an older last token
    # is never used).
    last_hidden: Any = None
    last_hidden_at: int = -1

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without copying the whole prompt (the per-step hot path)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:end] + self.output_ids[: max(0, end - p)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.pending

    @property
    def num_owned_slots(self) -> int:
        """Slots the request holds outside the radix cache."""
        return len(self.slots) - self.prefix_len

    @property
    def owes_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and some are not known yet."""
        return self.prompt_logprobs is not None and self.prompt_logprobs_next < len(self.prompt_ids)

    def computed_logprobs(self, start: int, end: int) -> StoredLogprobs:
        """The logprobs known for positions start..end-1 (end <= len(all_ids)), as the radix
        cache stores them: prompt positions the request scored, every generated token."""
        p = len(self.prompt_ids)
        known = self.prompt_logprobs if self.prompt_logprobs is not None else []
        prompt_end = min(end, p)
        scored_end = min(prompt_end, len(known))
        parts = []
        if start < scored_end:
            parts.append(StoredLogprobs.from_rows(known[start:scored_end]))
        if max(start, scored_end) < prompt_end:
            parts.append(StoredLogprobs.empty(prompt_end - max(start, scored_end)))
        if end > p:
            parts.append(
                StoredLogprobs.from_rows(self.output_logprobs[max(start, p) - p : end - p])
            )
        return StoredLogprobs.cat(parts)

    def take_cached_logprobs(self, stored: StoredLogprobs) -> None:
        """Append prompt logprobs served by the radix cache for positions prompt_logprobs_next
        onwards (one row each, each holding the alternatives this request asks for)."""
        assert self.prompt_logprobs is not None and self.params.prompt_logprobs is not None
        first = self.prompt_logprobs_next
        assert len(self.prompt_logprobs) == first and first + len(stored) <= len(self.prompt_ids)
        for p, (value, top) in enumerate(stored.rows(self.params.prompt_logprobs), first):
            self.prompt_logprobs.append(TokenLogprob(self.prompt_ids[p], value, top))
        self.prompt_logprobs_next = first + len(stored)
