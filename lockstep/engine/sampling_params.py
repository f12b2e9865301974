"""Per-request sampling parameters (shaped like vLLM's `SamplingParams`).

Validation happens in `__post_init__`: every bad value raises `RequestError` naming the field,
the value and what is accepted, so the server can answer 400 and the CLI print one line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lockstep.errors import RequestError

# Smaller temperatures are refused rather than sampled: they are greedy in all but name (vLLM
# treats them as greedy), and far enough down (below ~2e-270) finite logits divided by them
# overflow float64, leaving a row of infinities with no distribution to sample. A refusal
# says so; quietly sampling or quietly switching to greedy would not.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # None: the engine draws one and reports it back
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # leave control tokens (EOS, chat markers) out of text
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token plus top-k
    prompt_logprobs: int | None = None  # None: none; k >= 0: every prompt position plus top-k
    # With prompt_logprobs: the first prompt position whose logprob is wanted (the ones
    # before are None, and a prefix-cache hit needs stored logprobs from here on only).
    prompt_logprobs_start: int = 1
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            "max_tokens",
            self.max_tokens,
            "an integer >= 1",
        )
        _check(
            _finite(self.temperature)
            and (self.temperature == 0.0 or self.temperature >= MIN_TEMPERATURE),
            "temperature",
            self.temperature,
            f"0 (greedy) or a number >= {MIN_TEMPERATURE:g}",
        )
        _check(
            isinstance(self.top_k, int) and self.top_k >= 0,
            "top_k",
            self.top_k,
            "an integer >= 0 (0 disables it)",
        )
        _check(
            _finite(self.top_p) and 0.0 < self.top_p <= 1.0,
            "top_p",
            self.top_p,
            "a number in (0, 1]",
        )
        _check(
            _finite(self.min_p) and 0.0 <= self.min_p <= 1.0,
            "min_p",
            self.min_p,
            "a number in [0, 1]",
        )
        _check(
            self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
            "seed",
            self.seed,
            "an integer in [0, 2**63) or None",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "non-empty strings"
        )
        _check(len(self.stop) <= 16, "stop", self.stop, "at most 16 stop strings")
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            "logprobs",
            self.logprobs,
            "None or an integer in [0, 20]",
        )
        _check(
            self.prompt_logprobs is None
            or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
            "prompt_logprobs",
            self.prompt_logprobs,
            "None or an integer in [0, 20]",
        )
        _check(
            isinstance(self.prompt_logprobs_start, int) and self.prompt_logprobs_start >= 0,
            "prompt_logprobs_start",
            self.prompt_logprobs_start,
            "an integer >= 0",
        )
        _check(isinstance(self.n, int) and 1 <= self.n <= 64, "n", self.n, "an integer in [1, 64]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, name: str, value: object, accepted: str) -> None:
    if not ok:
        raise RequestError(f"{name}={value!r} is invalid: expected {accepted}")
