"""The one builder of a request's `SamplingParams`, for every route (OpenAI's completions and
chat completions, SGLang's /generate): each dialect reads its own body into `SamplingFields`
(its field names, its defaults), and `build_sampling_params` applies the rules they share:

    seed        choice (sample) i of n uses seed + i; a 400 naming the dialect's seed field
                where that leaves int64
    stop        a string or a list of strings, then the server's own stops (tool calls),
                each once, in order
    top_k       -1 (vLLM's spelling of "disabled") becomes 0
    errors      a `RequestError` of `SamplingParams` (its own checks) becomes a 400 naming
                `SamplingFields.error_param` where the dialect names one (SGLang:
                "sampling_params"); else it propagates to the server's handler, which names
                the field its message starts with
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lockstep.engine.sampling_params import SamplingParams
from lockstep.errors import RequestError
from lockstep.server.protocol import APIError


@dataclass(frozen=True)
class SamplingFields:
    """A request body's sampling knobs in the engine's terms; `seed_param` is the body's name
    for the seed (for messages), `keep_stop_string` vLLM's include_stop_str_in_output or
    SGLang's no_stop_trim."""

    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int | None
    seed_param: str
    stop: str | list[str] | tuple[str, ...] | None
    stop_token_ids: list[int] | tuple[int, ...] | None
    ignore_eos: bool
    keep_stop_string: bool
    skip_special_tokens: bool
    error_param: str | None = None


def choice_seed(seed: int | None, choice: int, param: str) -> int | None:
    """Choice (sample) i of n samples with seed + i; a 400 where that leaves int64."""
    if seed is None:
        return None
    if seed + choice >= 2**63:
        raise APIError(
            f"{param} + n - 1 must be below 2**63 ({param}={seed})",
            param=param,
            code="invalid_value",
        )
    return seed + choice


def build_sampling_params(
    fields: SamplingFields,
    *,
    choice: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    prompt_logprobs_start: int = 1,
    extra_stop: tuple[str, ...] = (),
    processing: dict[str, Any] | None = None,
    return_routed_experts: bool = False,
) -> SamplingParams:
    """Choice `choice` of a request's samples (module docstring). `extra_stop`: stop strings
    the server adds (tools.py); `processing`: the logits-processing keyword arguments
    (processing_fields.py); `prompt_logprobs_start`: the first prompt position whose logprob
    is computed (`SamplingParams`' default, 1, unless the dialect asks);
    `return_routed_experts`: keep the routing for the answer (SGLang's routing replay)."""
    seed = choice_seed(fields.seed, choice, fields.seed_param)
    given = fields.stop
    stop = () if given is None else (given,) if isinstance(given, str) else tuple(given)
    stop = stop + tuple(s for s in extra_stop if s not in stop)
    try:
        return SamplingParams(
            max_tokens=fields.max_tokens,
            temperature=fields.temperature,
            top_k=max(fields.top_k, 0),  # -1 is vLLM's spelling of "disabled"
            top_p=fields.top_p,
            min_p=fields.min_p,
            seed=seed,
            stop=stop,
            stop_token_ids=tuple(fields.stop_token_ids or ()),
            ignore_eos=fields.ignore_eos,
            include_stop_str_in_output=fields.keep_stop_string,
            skip_special_tokens=fields.skip_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            prompt_logprobs_start=prompt_logprobs_start,
            return_routed_experts=return_routed_experts,
            **(processing or {}),
        )
    except RequestError as exc:
        if fields.error_param is None:
            raise
        raise APIError(str(exc), param=fields.error_param, code="invalid_value") from None
