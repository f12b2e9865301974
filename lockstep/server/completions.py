"""`POST /v1/completions`: text completions, streamed or not, and scoring by echo.

Scoring is lm-evaluation-harness's and vLLM's convention: `echo` with `logprobs` returns the
prompt's logprobs (null at position 0) before the completion's; with `max_tokens: 0` there is
no completion. The engine needs one computed position after the prompt, so such a request
runs one greedy token, as `/v1/score` does, and the answer leaves it out: by the engine's
contract the prompt's logprobs are the bits `/v1/score` and generation give.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from lockstep.engine.outputs import TokenLogprob
from lockstep.engine.sampling_params import SamplingParams
from lockstep.server.async_engine import RequestGroup
from lockstep.server.delivery import run_to_end, streaming
from lockstep.server.preparation import (
    Served,
    check_fan_out,
    check_model,
    check_token_ids,
    log_request,
    logits_processing,
    max_tokens_for,
    prompts_of,
    requested_max_tokens,
    sampling_params,
    stream_usage,
    truncate_prompt,
)
from lockstep.server.protocol import APIError, CompletionRequest
from lockstep.server.responses import (
    ChoiceState,
    chunk_usage,
    completion_logprobs,
    envelope,
    sse,
    usage,
    vllm_prompt_logprobs,
)


def _check_scoring_fields(body: CompletionRequest, requested: int | None) -> None:
    if requested == 0 and not body.echo:
        raise APIError(
            "max_tokens=0 generates nothing: it is for scoring the prompt, with echo=true"
            " (and logprobs)",
            param="max_tokens",
            code="invalid_value",
        )
    if body.best_of is not None and body.best_of != body.n:
        reason = (
            "best_of > n asks for best_of candidates of which the n with the highest"
            " logprob are returned; Lockstep does not rank candidates"
            if body.best_of > body.n
            else "best_of must be at least n"
        )
        raise APIError(
            f"best_of={body.best_of} with n={body.n}: {reason}. Send best_of equal to n, or"
            " leave it out",
            param="best_of",
            code="unsupported_parameter" if body.best_of > body.n else "invalid_value",
        )


def _engine_prompt_logprobs(body: CompletionRequest) -> int | None:
    """Alternatives per prompt position the engine must compute: for the echo's logprobs and
    for `prompt_logprobs`, whichever asks more (each answer shows its own number)."""
    asks = [
        k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None
    ]
    return max(asks) if asks else None


async def completions(served: Served, body: CompletionRequest, request: Request) -> Any:
    served.engine.refuse_if_full()
    check_model(served, body.model)
    usage_options = stream_usage(body)
    check_token_ids(served, body.stop_token_ids or [], "stop_token_ids")
    requested, limit_param = requested_max_tokens(body)
    _check_scoring_fields(body, requested)
    scoring = requested == 0
    # Tokenizing a long text takes a while: off the event loop, so other requests stream on.
    prompts = await asyncio.to_thread(
        prompts_of,
        served,
        body.prompt,
        add_special_tokens=body.add_special_tokens,
        bounded=body.truncate_prompt_tokens is None,
    )
    prompts = [
        truncate_prompt(served, ids, body.truncate_prompt_tokens, requested) for ids in prompts
    ]
    check_fan_out(served, len(prompts), body.n)
    prompt_k = _engine_prompt_logprobs(body)
    processing = await logits_processing(served, body)
    choices: list[ChoiceState] = []
    requests = []
    for p_index, ids in enumerate(prompts):
        if scoring:
            max_tokens_for(served, 1, len(ids), "prompt", limit_param)
        else:
            max_tokens = max_tokens_for(served, requested, len(ids), "prompt", limit_param)
        for i in range(body.n):
            if scoring:
                params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=prompt_k)
            else:
                params = sampling_params(
                    body,
                    max_tokens=max_tokens,
                    choice=i,
                    logprobs=body.logprobs,
                    prompt_logprobs=prompt_k,
                    processing=processing,
                )
            requests.append((ids, params))
            choices.append(ChoiceState(prompt_index=p_index, prompt_ids=ids, scores_only=scoring))
    group_id = served.engine.new_request_id("cmpl")
    log_request("completion", group_id, body.user, prompts, body.rid)
    group = RequestGroup(served.engine, group_id)
    await group.add(requests, body.cache_namespace, stream=bool(body.stream))
    created = int(time.time())
    tok = served.tokenizer

    def choice_body(
        index: int,
        c: ChoiceState,
        text: str,
        new_ids: list[int],
        lps: list[TokenLogprob],
        first: bool,
        offset: int,
    ) -> dict[str, Any]:
        """A choice (or a stream's delta of it); `offset` is where `text` starts in the
        choice's whole text, for `text_offset`."""
        out_text, ids, entries = text, list(new_ids), list(lps)
        if first and body.echo:
            out_text = tok.decode(c.prompt_ids) + out_text
            ids = c.prompt_ids + ids
            entries = list(c.prompt_logprobs or [None] * len(c.prompt_ids)) + entries
        result: dict[str, Any] = {"index": index, "text": out_text, "logprobs": None}
        if body.logprobs is not None:
            result["logprobs"] = completion_logprobs(
                tok,
                ids,
                entries,
                offset,
                num_top=body.logprobs,
                as_token_ids=body.return_tokens_as_token_ids,
            )
        if first and body.prompt_logprobs is not None:
            result["prompt_logprobs"] = vllm_prompt_logprobs(
                tok, c.prompt_logprobs or [None] * len(c.prompt_ids), body.prompt_logprobs
            )
        if body.return_token_ids:
            result["token_ids"] = list(new_ids)
            if first:
                result["prompt_token_ids"] = c.prompt_ids
        return result

    def wrap(choice_list: list[dict], **extra: Any) -> dict[str, Any]:
        return envelope(
            "text_completion",
            group_id,
            created,
            served.model_name,
            served.system_fingerprint,
            choice_list,
            metadata={"weight_version": served.engine.weight_version},  # as SGLang's
            **extra,
        )

    if not body.stream:
        async with group:
            if not await run_to_end(group, choices, request):
                return Response(status_code=499)
        out = []
        for i, c in enumerate(choices):
            item = choice_body(i, c, c.text, c.token_ids, c.logprobs, True, 0)
            item["finish_reason"] = c.finish_reason
            item["stop_reason"] = c.stop_reason
            out.append(item)
        return wrap(out, usage=usage(choices))

    async def chunks() -> AsyncIterator[str]:
        async for index, output in group.outputs():
            c = choices[index]
            new_text, new_ids, new_lps = c.add(output)
            first = not c.started
            c.started = True
            echoed = len(tok.decode(c.prompt_ids)) if body.echo else 0
            offset = 0 if first else echoed + len(c.text) - len(new_text)
            item = choice_body(index, c, new_text, new_ids, new_lps, first, offset)
            item["finish_reason"] = c.finish_reason if output.finished else None
            extra: dict[str, Any] = {}
            if usage_options.continuous:
                extra["usage"] = chunk_usage(len(c.prompt_ids), len(c.token_ids))
            elif usage_options.final:
                extra["usage"] = None
            # A token whose text is held back (half a UTF-8 character) still sends its chunk:
            # its logprobs and token id belong to this position.
            yield sse(wrap([item], **extra))
        if usage_options.final:
            yield sse(wrap([], usage=usage(choices)))
        yield sse("[DONE]")

    return streaming(chunks(), group)
