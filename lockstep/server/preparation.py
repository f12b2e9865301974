"""Request preparation: from a validated request body to engine inputs, or a 4xx.

Everything that can be refused is refused here, before the engine sees the request: unknown
model, empty or out-of-vocabulary prompts and stop token ids, prompts that cannot fit the
context with the requested completion, too many sequences in one request.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from lockstep.engine.sampling_params import SamplingParams
from lockstep.server.async_engine import AsyncEngine
from lockstep.server.processing_fields import compile_constraint, processing_options
from lockstep.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    clip,
)
from lockstep.server.sampling import SamplingFields, build_sampling_params

logger = logging.getLogger(__name__)

# One HTTP request may fan out to at most this many engine requests (prompts x n): a bigger
# batch belongs in several requests, and a single one must not flood the scheduler's queue.
MAX_SEQUENCES_PER_REQUEST = 256


@dataclasses.dataclass
class Served:
    """What the routes need to know about the engine, read once at start-up."""

    engine: AsyncEngine
    model_name: str
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    created: int
    system_fingerprint: str
    kv_tokens: int  # the KV pool's slots: a sequence never holds more
    max_text_chars: int = 0  # longer text cannot fit the context (`text_bound`); 0: no bound
    tool_call_parser: str | None = None  # tool_parser.py's name for the model's markup
    grammars: Any = None  # the engine's GrammarCompiler (structured outputs)
    tokenizer_path: str | None = None  # a Hugging Face tokenizer folder (tokenizer_folder.py)


# A tokenizer's normalizer can shorten text before it is split (NFC composes a letter and its
# combining accent into one character): the bound on tokens per character allows for it.
NORMALIZATION_SLACK = 4


def text_bound(tokenizer: Any, max_model_len: int) -> int:
    """The most characters a text can have and still fit `max_model_len` tokens: a token
    stands for at most `longest` bytes, so C characters (>= C bytes) are at least
    C / longest tokens, within the normalizer's slack."""
    longest = max(len(tokenizer.token_bytes(t)) for t in range(tokenizer.vocab_size))
    return max_model_len * max(longest, 1) * NORMALIZATION_SLACK


def check_text_length(served: Served, text: str, param: str) -> None:
    """Refuse text that cannot fit the context before tokenizing it (a 30 MB prompt costs
    its tokenization otherwise, on every request)."""
    if served.max_text_chars and len(text) > served.max_text_chars:
        raise APIError(
            f"The {param} has {len(text)} characters: more tokens than this model's maximum"
            f" context length of {served.max_model_len} tokens.",
            param=param,
            code="context_length_exceeded",
        )


def check_model(served: Served, model: str) -> None:
    if model != served.model_name:
        raise APIError(
            f"The model `{clip(model)}` does not exist; this server serves `{served.model_name}`.",
            param="model",
            code="model_not_found",
            status=404,
        )


def model_card(served: Served) -> dict[str, Any]:
    return {
        "id": served.model_name,
        "object": "model",
        "created": served.created,
        "owned_by": "lockstep",
        "max_model_len": served.max_model_len,
    }


def prompts_of(
    served: Served, prompt: Any, *, add_special_tokens: bool = True, bounded: bool = True
) -> list[list[int]]:
    """A prompt in any of OpenAI's four shapes, as token-id lists (ids checked in range).
    `bounded`: refuse text too long for the context before tokenizing it (off when the
    prompt is to be truncated)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    ids_list = []
    for item in prompt:
        if isinstance(item, str):
            if bounded:
                check_text_length(served, item, "prompt")
            ids = served.tokenizer.encode(item, add_special_tokens=add_special_tokens)
        else:
            ids = list(item)
            check_token_ids(served, ids, "prompt")
        if not ids:
            raise APIError("The prompt is empty (no tokens).", param="prompt", code="invalid_value")
        ids_list.append(ids)
    return ids_list


def check_prompt_or_messages(prompt: Any, messages: Any) -> None:
    """Routes that take a text prompt or chat messages (`/v1/score`, `/tokenize`) take one."""
    if (prompt is None) == (messages is None):
        raise APIError(
            "send exactly one of prompt and messages",
            param="prompt",
            code="missing" if prompt is None else "invalid_value",
        )


def check_token_ids(served: Served, ids: list[int], param: str) -> None:
    """Token ids the client wrote (the protocol has checked them >= 0) must be in the vocabulary."""
    bad = [t for t in ids if t >= served.vocab_size]
    if bad:
        raise APIError(
            f"token id {bad[0]} is out of range: the vocabulary has {served.vocab_size} tokens",
            param=param,
            code="invalid_value",
        )


def truncate_prompt(
    served: Served, ids: list[int], keep: int | None, max_tokens: int | None
) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the last `keep` prompt ids (-1: as many as leave room
    for `max_tokens`, or for one token when it is unset or 0). A `keep` beyond that room is
    refused whatever the prompt's length, as in vLLM; 0 would leave no prompt."""
    if keep is None:
        return ids
    room = served.max_model_len - max(max_tokens or 1, 1)
    if keep == -1:
        keep = room
    if keep == 0 or keep > room:
        raise APIError(
            f"truncate_prompt_tokens={keep} is out of range: expected -1 or 1 to {room}"
            f" (max_model_len {served.max_model_len} minus the tokens to generate)",
            param="truncate_prompt_tokens",
            code="invalid_value",
        )
    return ids[-keep:]


def check_fan_out(served: Served, num_prompts: int, n: int) -> None:
    """At most MAX_SEQUENCES_PER_REQUEST sequences, and never more than the server admits at
    once (a request that could never be admitted is a 400, not a 429 to retry forever)."""
    limit = MAX_SEQUENCES_PER_REQUEST
    if served.engine.capacity is not None:
        limit = min(limit, served.engine.capacity)
    if num_prompts * n > limit:
        raise APIError(
            f"{num_prompts} prompts x n={n} asks for {num_prompts * n} sequences: at most"
            f" {limit} per request",
            param="n" if n > 1 else "prompt",
            code="invalid_value",
        )


def requested_max_tokens(body: CompletionRequest | ChatCompletionRequest) -> tuple[int | None, str]:
    """The completion's token limit as asked, and the field that asked it. `max_tokens` and
    `max_completion_tokens` are one limit: either may be sent, or both with the same value
    (as load generators written for vLLM do, on both routes); two values are refused."""
    given, alias = body.max_tokens, body.max_completion_tokens
    if alias is None:
        return given, "max_tokens"
    if "max_tokens" in body.model_fields_set and given is not None and given != alias:
        raise APIError(
            f"max_tokens={given} and max_completion_tokens={alias} are the same limit: send"
            " one, or the same value in both",
            param="max_tokens",
            code="invalid_value",
        )
    return alias, "max_completion_tokens"


def max_tokens_for(
    served: Served, requested: int | None, prompt_len: int, prompt_param: str, param: str
) -> int:
    """Refuses what cannot fit the context before any work; None means "as many as fit":
    up to the context limit, and within the KV pool (a sequence of n tokens holds n - 1
    slots: the last token's KV is never needed)."""
    limit = served.max_model_len
    if prompt_len >= limit:
        raise APIError(
            f"This model's maximum context length is {limit} tokens, but the prompt has"
            f" {prompt_len} tokens (at least one token must be left to generate).",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        fit = min(limit - prompt_len, served.kv_tokens + 1 - prompt_len)
        if fit < 1:
            raise APIError(
                f"The prompt has {prompt_len} tokens but the KV pool holds {served.kv_tokens}"
                " tokens: it can never run on this server.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        return fit
    if prompt_len + requested > limit:
        raise APIError(
            f"This model's maximum context length is {limit} tokens, but you requested"
            f" {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for"
            f" the completion). Reduce the prompt or {param}.",
            param=param,
            code="context_length_exceeded",
        )
    return requested


async def logits_processing(
    served: Served, body: CompletionRequest | ChatCompletionRequest
) -> dict[str, Any]:
    """The body's penalties, biases, bans and output constraint as SamplingParams keyword
    arguments; the constraint compiled (off the event loop), or a 400 naming its field."""
    options = processing_options(body, served.vocab_size)
    await compile_constraint(served.grammars, options["structured_output"])
    return options


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    *,
    max_tokens: int,
    choice: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    extra_stop: tuple[str, ...] = (),
    processing: dict[str, Any] | None = None,
) -> SamplingParams:
    """An OpenAI body's choice `choice` through the one builder (lockstep/server/sampling.py);
    `extra_stop`: stop strings the server adds (tools.py)."""
    return build_sampling_params(
        openai_fields(body, max_tokens), choice=choice, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, extra_stop=extra_stop, processing=processing,
    )  # fmt: skip


def openai_fields(
    body: CompletionRequest | ChatCompletionRequest, max_tokens: int
) -> SamplingFields:
    """The sampling knobs of a completions or chat completions body (`max_tokens` resolved
    by the route: the body's, or what the context leaves)."""
    return SamplingFields(
        max_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
        min_p=body.min_p, seed=body.seed, seed_param="seed", stop=body.stop,
        stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
        keep_stop_string=body.keeps_stop_string, skip_special_tokens=body.skip_special_tokens,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class StreamUsage:
    """Which usage a stream carries: a last chunk with the whole request's (`final`), and
    each chunk its own choice's so far (`continuous`, vLLM's `continuous_usage_stats`)."""

    final: bool = False
    continuous: bool = False


def stream_usage(body: CompletionRequest | ChatCompletionRequest) -> StreamUsage:
    """The usage a stream asks for, or a 400 for options that contradict each other or need
    a stream. As in vLLM, `continuous_usage_stats` implies `include_usage` unless that is
    false, which asks for no usage at all and is refused here."""
    options = body.stream_options
    if options is not None and not body.stream:
        raise APIError(
            "stream_options is only allowed when stream is true",
            param="stream_options",
            code="invalid_value",
        )
    if body.stream and body.prompt_logprobs is not None:
        raise APIError(
            "prompt_logprobs are not available when streaming: send stream=false",
            param="prompt_logprobs",
            code="invalid_value",
        )
    if options is None:
        return StreamUsage()
    if options.continuous_usage_stats and options.include_usage is False:
        raise APIError(
            "stream_options.continuous_usage_stats needs include_usage (false asks for no usage)",
            param="stream_options.continuous_usage_stats",
            code="invalid_value",
        )
    final = (
        options.continuous_usage_stats if options.include_usage is None else options.include_usage
    )
    return StreamUsage(final=final, continuous=options.continuous_usage_stats)


def log_request(
    kind: str,
    group_id: str,
    user: str | None,
    prompts: list[list[int]],
    rid: str | list[str] | None = None,
) -> None:
    """One log line per admitted request: what it is, whose (`user`), the client's own id
    for it (SGLang's `rid`), how big."""
    logger.info(
        "%s %s user=%r rid=%r prompts=%d prompt_tokens=%d",
        kind,
        group_id,
        user,
        rid,
        len(prompts),
        sum(len(p) for p in prompts),
    )
