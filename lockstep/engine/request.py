"""The state of one request as the scheduler and engine see it.

Token layout of a request (P prompt tokens, G generated so far):

    all_ids   = prompt_ids + output_ids            length P + G
    slots[j]  = KV slot holding position j, for j < num_computed
    prefix    : slots[:prefix_len] belong to the radix cache (locked via `prefix_node`);
                slots[prefix_len:num_computed] are the request's own (counted as "in use").

A step computes positions num_computed .. end-1. When end == len(all_ids), the logits of the
last row choose the next token. After a preemption the request recomputes its KV from the
cache/prompt; position invariance makes the recomputed bits identical, so nothing is re-sampled.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from lockstep.engine.outputs import TokenLogprob
from lockstep.engine.sampling_params import SamplingParams


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
    prompt_text: str | None = None
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    num_computed: int = 0
    prefix_len: int = 0  # leading slots owned by the radix cache
    prefix_node: Any = None  # locked radix node covering slots[:prefix_len]
    cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_next: int = 1  # next prompt position whose logprob is still owed
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    prompt_counted: bool = False  # prompt/cached tokens added to the engine's totals
    text_output: Any = None  # TextOutput: detokenization and stop strings
    prompt_logprobs_sent: bool = False

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_owned_slots(self) -> int:
        """Slots the request holds outside the radix cache."""
        return len(self.slots) - self.prefix_len

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    @property
    def max_total_tokens(self) -> int:
        """Most KV slots this request can ever need (the last generated token has no KV)."""
        return len(self.prompt_ids) + self.params.max_tokens - 1
