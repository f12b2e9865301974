"""`POST /v1/chat/completions`: chat completions through the model's chat template,
streamed or not (the template rendering and its options: chat_prompt.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from lockstep.server.async_engine import RequestGroup
from lockstep.server.chat_prompt import chat_options, chat_prompt, echoed_text, reply_role
from lockstep.server.delivery import run_to_end, streaming
from lockstep.server.preparation import (
    Served,
    check_fan_out,
    check_model,
    check_token_ids,
    log_request,
    logits_processing,
    max_tokens_for,
    requested_max_tokens,
    sampling_params,
    stream_usage,
    truncate_prompt,
)
from lockstep.server.protocol import APIError, ChatCompletionRequest
from lockstep.server.responses import (
    ChoiceState,
    chat_logprobs,
    chunk_usage,
    envelope,
    sse,
    usage,
    vllm_prompt_logprobs,
)


def _check_logprobs(body: ChatCompletionRequest) -> None:
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(
            "top_logprobs requires logprobs=true", param="top_logprobs", code="invalid_value"
        )


async def chat_completions(served: Served, body: ChatCompletionRequest, request: Request) -> Any:
    served.engine.refuse_if_full()
    check_model(served, body.model)
    usage_options = stream_usage(body)
    check_token_ids(served, body.stop_token_ids or [], "stop_token_ids")
    _check_logprobs(body)
    requested, limit_param = requested_max_tokens(body)
    check_fan_out(served, 1, body.n)
    options = chat_options(body)
    # A prompt to be truncated may be longer than the context before it is.
    rendering = dataclasses.replace(options, bounded=body.truncate_prompt_tokens is None)
    ids = await asyncio.to_thread(chat_prompt, served, body.messages, rendering)
    ids = truncate_prompt(served, ids, body.truncate_prompt_tokens, requested)
    max_tokens = max_tokens_for(served, requested, len(ids), "messages", limit_param)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    processing = await logits_processing(served, body)
    requests = [
        (
            ids,
            sampling_params(
                body,
                max_tokens=max_tokens,
                choice=i,
                logprobs=logprobs,
                prompt_logprobs=body.prompt_logprobs,
                processing=processing,
            ),
        )
        for i in range(body.n)
    ]
    choices = [ChoiceState(prompt_index=0, prompt_ids=ids) for _ in range(body.n)]
    group_id = served.engine.new_request_id("chatcmpl")
    log_request("chat", group_id, body.user, [ids])
    group = RequestGroup(served.engine, group_id)
    await group.add(requests, body.cache_salt)
    created = int(time.time())
    tok = served.tokenizer
    role = reply_role(body, options)
    prefix = echoed_text(body, options)
    as_ids = body.return_tokens_as_token_ids

    def wrap(obj: str, choice_list: list[dict], **extra: Any) -> dict[str, Any]:
        return envelope(
            obj,
            group_id,
            created,
            served.model_name,
            served.system_fingerprint,
            choice_list,
            **extra,
        )

    if not body.stream:
        async with group:
            if not await run_to_end(group, choices, request):
                return Response(status_code=499)
        out = []
        for i, c in enumerate(choices):
            item: dict[str, Any] = {
                "index": i,
                "message": {"role": role, "content": prefix + c.text, "refusal": None},
                "logprobs": chat_logprobs(tok, c.logprobs, as_ids) if body.logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if body.return_token_ids:
                item["token_ids"] = c.token_ids
                item["prompt_token_ids"] = c.prompt_ids
            out.append(item)
        extra: dict[str, Any] = {"usage": usage(choices)}
        if body.prompt_logprobs is not None:
            # vLLM's place for them: the response, as every choice shares the prompt.
            entries = choices[0].prompt_logprobs or [None] * len(ids)
            extra["prompt_logprobs"] = vllm_prompt_logprobs(tok, entries, body.prompt_logprobs)
        return wrap("chat.completion", out, **extra)

    def usage_field(index: int | None) -> dict[str, Any]:
        """A chunk's `usage`: its choice's so far (continuous), or null until the end."""
        if usage_options.continuous and index is not None:
            return {"usage": chunk_usage(len(ids), len(choices[index].token_ids))}
        return {"usage": None} if usage_options.final else {}

    def chunk(choice: dict[str, Any]) -> str:
        return sse(wrap("chat.completion.chunk", [choice], **usage_field(choice["index"])))

    async def chunks() -> AsyncIterator[str]:
        for i in range(body.n):
            delta = {"role": role, "content": ""}
            yield chunk({"index": i, "delta": delta, "logprobs": None, "finish_reason": None})
        if prefix:
            for i in range(body.n):
                delta = {"content": prefix}
                yield chunk({"index": i, "delta": delta, "logprobs": None, "finish_reason": None})
        async for index, output in group.outputs():
            choices[index].add(output)
            if output.new_text or output.new_token_ids:
                item = {
                    "index": index,
                    "delta": {"content": output.new_text},
                    "logprobs": chat_logprobs(tok, output.new_logprobs or [], as_ids)
                    if body.logprobs
                    else None,
                    "finish_reason": None,
                }
                if body.return_token_ids:
                    item["token_ids"] = output.new_token_ids
                yield chunk(item)
            if output.finished:
                yield chunk(
                    {
                        "index": index,
                        "delta": {},
                        "logprobs": None,
                        "finish_reason": output.finish_reason,
                        "stop_reason": output.stop_reason,
                    }
                )
        if usage_options.final:
            yield sse(wrap("chat.completion.chunk", [], usage=usage(choices)))
        yield sse("[DONE]")

    return streaming(chunks(), group)
