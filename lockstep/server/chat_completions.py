"""`POST /v1/chat/completions`: chat completions through the model's chat template,
streamed or not (the template rendering and its options: chat_prompt.py; tools and the
parsing of tool calls out of the reply: tools.py, tool_parser.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from lockstep.server.async_engine import RequestGroup
from lockstep.server.chat_prompt import (
    chat_options,
    chat_prompt,
    echoed_text,
    reply_role,
    template_variables,
)
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
from lockstep.server.tool_parser import HermesToolCallParser, ParserOutput, parse_whole
from lockstep.server.tools import (
    delta_tool_calls,
    finish_reason,
    message_tool_calls,
    plan_tools,
    tool_call_id,
    with_tool_constraint,
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
    tools = plan_tools(body, served.tool_call_parser, template_variables(served))
    # A prompt to be truncated may be longer than the context before it is.
    rendering = dataclasses.replace(
        options, bounded=body.truncate_prompt_tokens is None, tools=tools.template_tools
    )
    ids = await asyncio.to_thread(chat_prompt, served, body.messages, rendering)
    ids = truncate_prompt(served, ids, body.truncate_prompt_tokens, requested)
    max_tokens = max_tokens_for(served, requested, len(ids), "messages", limit_param)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    processing = await with_tool_constraint(
        served.grammars, await logits_processing(served, body), tools
    )
    requests = [
        (
            ids,
            sampling_params(
                body,
                max_tokens=max_tokens,
                choice=i,
                logprobs=logprobs,
                prompt_logprobs=body.prompt_logprobs,
                extra_stop=tools.stop,
                processing=processing,
            ),
        )
        for i in range(body.n)
    ]
    choices = [ChoiceState(prompt_index=0, prompt_ids=ids) for _ in range(body.n)]
    group_id = served.engine.new_request_id("chatcmpl")
    log_request("chat", group_id, body.user, [ids], body.rid)
    group = RequestGroup(served.engine, group_id)
    await group.add(requests, body.cache_namespace, stream=bool(body.stream))
    created = int(time.time())
    tok = served.tokenizer
    role = reply_role(body, options)
    prefix = echoed_text(body, options)
    as_ids = body.return_tokens_as_token_ids

    def ended_call(stop_reason: str | int | None) -> str:
        """The end tag a `parallel_tool_calls: false` stop left out of the text."""
        hit = stop_reason in tools.stop and not body.keeps_stop_string
        return str(stop_reason) if hit else ""

    def wrap(obj: str, choice_list: list[dict], **extra: Any) -> dict[str, Any]:
        return envelope(
            obj,
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
            message: dict[str, Any] = {"role": role, "content": prefix + c.text, "refusal": None}
            reason = c.finish_reason
            if tools.parse:
                parsed = parse_whole(HermesToolCallParser(), c.text + ended_call(c.stop_reason))
                text = prefix + parsed.content
                message["content"] = None if parsed.calls and not text else text
                if parsed.calls:
                    call_ids = [tool_call_id() for _ in parsed.calls]
                    message["tool_calls"] = message_tool_calls(parsed.calls, call_ids)
                reason = finish_reason(reason, len(parsed.calls))
            item: dict[str, Any] = {
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(tok, c.logprobs, as_ids) if body.logprobs else None,
                "finish_reason": reason,
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
        parsers = [HermesToolCallParser() for _ in range(body.n)] if tools.parse else []
        async for index, output in group.outputs():
            choices[index].add(output)
            parsed = ParserOutput(content=output.new_text)
            if parsers:
                parsed = parsers[index].feed(output.new_text)
                if output.finished:
                    last = parsers[index].feed(ended_call(output.stop_reason))
                    end = parsers[index].finish()
                    parsed = ParserOutput(
                        parsed.content + last.content + end.content,
                        parsed.calls + last.calls + end.calls,
                    )
            if output.new_text or output.new_token_ids or parsed.content:
                item = {
                    "index": index,
                    "delta": {"content": parsed.content},
                    "logprobs": chat_logprobs(tok, output.new_logprobs or [], as_ids)
                    if body.logprobs
                    else None,
                    "finish_reason": None,
                }
                if body.return_token_ids:
                    item["token_ids"] = output.new_token_ids
                yield chunk(item)
            if parsed.calls:
                call_ids = [tool_call_id() for _ in parsed.calls]
                first = parsers[index].num_calls - len(parsed.calls)
                for delta in delta_tool_calls(first, parsed.calls, call_ids):
                    yield chunk(
                        {
                            "index": index,
                            "delta": {"tool_calls": [delta]},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    )
            if output.finished:
                calls = parsers[index].num_calls if parsers else 0
                yield chunk(
                    {
                        "index": index,
                        "delta": {},
                        "logprobs": None,
                        "finish_reason": finish_reason(output.finish_reason, calls),
                        "stop_reason": output.stop_reason,
                    }
                )
        if usage_options.final:
            yield sse(wrap("chat.completion.chunk", [], usage=usage(choices)))
        yield sse("[DONE]")

    return streaming(chunks(), group)
