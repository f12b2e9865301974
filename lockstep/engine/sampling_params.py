"""Per-request sampling parameters (shaped like vLLM's `SamplingParams`).

Validation happens in `__post_init__`: every bad value raises `RequestError` naming the field,
the value and what is accepted, so the server can answer 400 and the CLI print one line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lockstep.engine.structured_output import StructuredOutput
from lockstep.errors import RequestError

# Smaller temperatures are refused rather than sampled: they are greedy in all but name (vLLM
# treats them as greedy), and far enough down (below ~2e-270) finite logits divided by them
# overflow float64, leaving a row of infinities with no distribution to sample. A refusal
# says so; quietly sampling or quietly switching to greedy would not.
MIN_TEMPERATURE = 1e-5
# OpenAI's limit, which the HTTP server's schema enforces too: one rule for every entry point.
MAX_TEMPERATURE = 2.0


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
    # Logits processing (lockstep/engine/logits_processing.py), vLLM's names and formulas.
    presence_penalty: float = 0.0  # subtracted once from every token the output holds
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of
    # tokens in the prompt or the output
    min_tokens: int = 0  # EOS and stop_token_ids masked (and stop strings ignored) until then
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); a dict ok
    bad_words: tuple[str, ...] = ()  # words (alone or after a space) the output never completes
    structured_output: StructuredOutput | None = None  # the output must match this
    # MoE models: report the experts every position went to (SGLang's routing-replay field;
    # the engine must keep them: `EngineConfig.enable_return_routed_experts`).
    return_routed_experts: bool = False

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
            and (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE),
            "temperature",
            self.temperature,
            f"0 (greedy) or a number from {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}",
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
        self._check_processing()

    def _check_processing(self) -> None:
        """Normalizes logit_bias (a dict or pairs -> pairs sorted by id) and bad_words, and
        checks the logits-processing fields; token ids are checked against the vocabulary
        by the engine, which knows it."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2.0 <= value <= 2.0, name, value, "a number in [-2, 2]")
        _check(
            _finite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 100.0,
            "repetition_penalty",
            self.repetition_penalty,
            "a number in (0, 100] (1 disables it)",
        )
        _check(
            isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            self.min_tokens,
            f"an integer in [0, max_tokens={self.max_tokens}]",
        )
        bias = self.logit_bias
        pairs = list(bias.items()) if isinstance(bias, dict) else list(bias)
        _check(
            all(
                isinstance(p, tuple | list) and len(p) == 2 and isinstance(p[0], int)
                and not isinstance(p[0], bool) and p[0] >= 0 and _finite(p[1])
                and -100.0 <= p[1] <= 100.0
                for p in pairs
            ),
            "logit_bias",
            bias,
            "token id (an integer >= 0) -> bias (a number in [-100, 100])",
        )  # fmt: skip
        ids = [int(p[0]) for p in pairs]
        _check(len(set(ids)) == len(ids), "logit_bias", bias, "each token id once")
        _check(len(ids) <= 1024, "logit_bias", f"{len(ids)} entries", "at most 1024 entries")
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in pairs)))
        words = (self.bad_words,) if isinstance(self.bad_words, str) else tuple(self.bad_words)
        _check(all(isinstance(w, str) and w for w in words), "bad_words", words,
               "non-empty strings")  # fmt: skip
        _check(len(words) <= 64, "bad_words", f"{len(words)} words", "at most 64 words")
        object.__setattr__(self, "bad_words", words)
        _check(
            self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
            "structured_output",
            self.structured_output,
            "None or a StructuredOutput",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes this request's logits before the token choice."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_tokens
            or self.logit_bias
            or self.bad_words
            or self.structured_output is not None
        )


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, name: str, value: object, accepted: str) -> None:
    if not ok:
        raise RequestError(f"{name}={value!r} is invalid: expected {accepted}")
