"""What the engine reports back: per-step deltas for streaming and whole-request outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class TokenLogprob:
    """The logprob of one token at one position, with the top alternatives when asked for
    (`top` is sorted by descending logprob, ties by ascending token id)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class StepOutput:
    """What one engine step produced for one request.

    `new_text` is the detokenized text of `new_token_ids` with stop strings already cut; it is
    safe to stream as is (incomplete UTF-8 sequences are held back until complete); empty
    from an engine that makes no text (`Engine(detokenize=False)`).
    `prompt_logprobs` is set only on the request's first output (position 0 has no logprob:
    it is None there, as in vLLM)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" when finished
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    seed: int
    prompt_logprobs: list[TokenLogprob | None] | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    new_token_logprobs: list[float] = field(default_factory=list)  # always: chosen tokens'
    # The new token's text is no part of the output (an EOS or stop token): what text made
    # outside the engine (`Engine(detokenize=False)`) needs to know.
    hides_token: bool = False
    # On the closing output of a request that asked (`return_routed_experts`): int32
    # [positions, num_hidden_layers, top_k], the experts every position that ran a forward
    # went to (prompt + output - 1 of them; lockstep/cache/routed_experts.py).
    routed_experts: np.ndarray | None = None


@dataclass
class RequestOutput:
    """A finished request as returned by `LLM.generate`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    logprobs: list[float] | None  # logprob of the chosen token at each generated position
    top_logprobs: list[TokenLogprob] | None
    prompt_logprobs: list[TokenLogprob | None] | None
    cached_tokens: int
    finish_reason: str
    seed: int
    stop_reason: str | int | None = None
    extra: dict = field(default_factory=dict)
    routed_experts: np.ndarray | None = None  # as `StepOutput.routed_experts`
