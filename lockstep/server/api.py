"""The HTTP API: the app and its OpenAI-compatible routes (SGLang's native ones: native_api.py).

`build_app(engine)` wraps an already-loaded engine (loading happens in `cli.py`, before the
port opens, so a bad model is a start-up error and not a failing first request). Every client
mistake is refused before any engine work with an OpenAI-style 4xx body (`preparation.py`,
`http_errors.py`); a request whose client goes away, streaming or not, is aborted so its KV
slots return to the pool at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lockstep.engine.outputs import TokenLogprob
from lockstep.engine.sampling_params import SamplingParams
from lockstep.server.async_engine import AsyncEngine, RequestGroup
from lockstep.server.delivery import run_to_end, streaming
from lockstep.server.http_errors import (
    MAX_BODY_BYTES,
    BodySizeLimit,
    HeadAsGet,
    install_error_handlers,
)
from lockstep.server.metrics import ServerMetrics
from lockstep.server.native_api import add_native_routes
from lockstep.server.preparation import (
    Served,
    chat_prompt,
    check_fan_out,
    check_model,
    check_prompt_or_messages,
    check_stream_options,
    check_token_ids,
    max_tokens_for,
    model_card,
    prompts_of,
    requested_max_tokens,
    sampling_params,
    text_bound,
)
from lockstep.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ScoreRequest,
    TokenizeRequest,
)
from lockstep.server.responses import (
    ChoiceState,
    chat_logprobs,
    completion_logprobs,
    score_entry,
    sse,
    usage,
)

logger = logging.getLogger(__name__)

# Sequences that may wait for a running slot, per running slot, unless --max-waiting says: a
# deep enough queue to keep the engine busy between arrivals, short enough that a client
# refused with a 429 learns it at once instead of waiting without bound.
DEFAULT_WAITING_PER_RUNNING = 4


def build_app(engine: Any, max_waiting: int | None = None) -> FastAPI:
    """The app over a loaded engine. `max_waiting`: sequences admitted beyond the engine's
    `max_running` to wait for a running slot; more are refused with a 429 (default:
    `DEFAULT_WAITING_PER_RUNNING` x max_running)."""
    metrics = ServerMetrics()
    max_running = engine.config.resolved_max_running
    if max_waiting is None:
        max_waiting = DEFAULT_WAITING_PER_RUNNING * max_running
    async_engine = AsyncEngine(engine, metrics, capacity=max_running + max_waiting)
    served = Served(
        engine=async_engine,
        model_name=engine.model_name,
        tokenizer=engine.tokenizer,
        max_model_len=engine.max_model_len,
        vocab_size=engine.tokenizer.vocab_size,
        created=int(time.time()),
        system_fingerprint=_system_fingerprint(engine),
        kv_tokens=engine.pool.num_slots,
        max_text_chars=text_bound(engine.tokenizer, engine.max_model_len),
    )

    def refresh_fingerprint() -> None:
        served.system_fingerprint = _system_fingerprint(engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            # Uvicorn has already drained (or timed out on) open connections by now.
            await asyncio.to_thread(async_engine.stop)

    app = FastAPI(title="Lockstep", version=_version(), lifespan=lifespan)
    app.state.async_engine = async_engine  # for the shutdown's grace deadline (cli.py)
    app.add_middleware(BodySizeLimit, max_bytes=MAX_BODY_BYTES)
    app.add_middleware(HeadAsGet)
    install_error_handlers(app, metrics)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not async_engine.alive:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(served)]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        check_model(served, model)
        return model_card(served)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        stats = await async_engine.call(lambda e: e.stats())
        return Response(metrics.render(stats), media_type="text/plain; version=0.0.4")

    @app.get("/v1/engine")
    async def engine_info() -> dict[str, Any]:
        def snapshot(e: Any) -> dict[str, Any]:
            return {"stats": e.stats(), "fingerprint": e.fingerprint(), "config": e.config}

        snap = await async_engine.call(snapshot)
        config = snap["config"].resolved_options()
        return {
            "model": served.model_name,
            "max_model_len": served.max_model_len,
            "mode": config["mode"],
            "device": snap["config"].resolved_device,
            "dtype": snap["config"].resolved_dtype,
            "config": config,
            "fingerprint": snap["fingerprint"],
            "system_fingerprint": served.system_fingerprint,
            "stats": snap["stats"],
            "last_engine_failure": async_engine.last_failure,
        }

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> dict[str, Any]:
        freed = await async_engine.call(lambda e: e.flush_cache())
        return {"flushed_tokens": freed}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response | dict:
        return await _completions(served, body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response | dict:
        return await _chat(served, body, request)

    @app.post("/v1/score", response_model=None)
    async def score(body: ScoreRequest, request: Request) -> Response | dict:
        return await _score(served, body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await asyncio.to_thread(_tokenize, served, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            check_model(served, body.model)
        check_token_ids(served, body.tokens, "tokens")
        return {"prompt": await asyncio.to_thread(served.tokenizer.decode, body.tokens, False)}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    add_native_routes(app, served, refresh_fingerprint)
    return app


def _system_fingerprint(engine: Any) -> str:
    """OpenAI's `system_fingerprint`: a digest of what the results depend on (the weights
    served included, so it changes with a weight update)."""
    fingerprint = json.dumps(engine.fingerprint(), sort_keys=True, default=str)
    return "lockstep-" + hashlib.sha256(fingerprint.encode()).hexdigest()[:16]


def _tokenize(served: Served, body: TokenizeRequest) -> dict[str, Any]:
    """vLLM's `/tokenize` response: the ids the completion or chat route would send."""
    if body.model is not None:
        check_model(served, body.model)
    check_prompt_or_messages(body.prompt, body.messages)
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = served.tokenizer.encode(body.prompt, add_special_tokens=add_special)
    else:
        assert body.messages is not None
        add_special = bool(body.add_special_tokens)
        ids = chat_prompt(served, body.messages, body.add_generation_prompt, add_special)
    strs = [served.tokenizer.token_str(t) for t in ids] if body.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": served.max_model_len,
        "tokens": ids,
        "token_strs": strs,
    }


def _version() -> str:
    from lockstep import __version__

    return __version__


def _log_request(kind: str, group_id: str, user: str | None, prompts: list[list[int]]) -> None:
    logger.info(
        "%s %s user=%r prompts=%d prompt_tokens=%d",
        kind,
        group_id,
        user,
        len(prompts),
        sum(len(p) for p in prompts),
    )


async def _completions(served: Served, body: CompletionRequest, request: Request) -> Any:
    served.engine.refuse_if_full()
    check_model(served, body.model)
    check_stream_options(body)
    check_token_ids(served, body.stop_token_ids or [], "stop_token_ids")
    # Tokenizing a long text takes a while: off the event loop, so other requests stream on.
    prompts = await asyncio.to_thread(prompts_of, served, body.prompt)
    check_fan_out(served, len(prompts), body.n)
    choices: list[ChoiceState] = []
    requests = []
    requested, limit_param = requested_max_tokens(body)
    for p_index, ids in enumerate(prompts):
        max_tokens = max_tokens_for(served, requested, len(ids), "prompt", limit_param)
        for i in range(body.n):
            params = sampling_params(
                body,
                max_tokens=max_tokens,
                choice=i,
                logprobs=body.logprobs,
                prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None,
            )
            requests.append((ids, params))
            choices.append(ChoiceState(prompt_index=p_index, prompt_ids=ids))
    group_id = served.engine.new_request_id("cmpl")
    _log_request("completion", group_id, body.user, prompts)
    group = RequestGroup(served.engine, group_id)
    await group.add(requests, body.cache_salt)
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
            result["logprobs"] = completion_logprobs(tok, ids, entries, offset)
        if body.return_token_ids:
            result["token_ids"] = list(new_ids)
            if first:
                result["prompt_token_ids"] = c.prompt_ids
        return result

    def envelope(choice_list: list[dict], **extra: Any) -> dict[str, Any]:
        return _envelope("text_completion", group_id, created, served, choice_list, **extra)

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
        return envelope(out, usage=usage(choices))

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def chunks() -> AsyncIterator[str]:
        async for index, output in group.outputs():
            c = choices[index]
            c.add(output)
            first = not c.started
            c.started = True
            echoed = len(tok.decode(c.prompt_ids)) if body.echo else 0
            offset = 0 if first else echoed + len(c.text) - len(output.new_text)
            item = choice_body(
                index,
                c,
                output.new_text,
                output.new_token_ids,
                output.new_logprobs or [],
                first,
                offset,
            )
            item["finish_reason"] = output.finish_reason if output.finished else None
            # A token whose text is held back (half a UTF-8 character) still sends its chunk:
            # its logprobs and token id belong to this position.
            yield sse(envelope([item], **({"usage": None} if include_usage else {})))
        if include_usage:
            yield sse(envelope([], usage=usage(choices)))
        yield sse("[DONE]")

    return streaming(chunks(), group)


async def _chat(served: Served, body: ChatCompletionRequest, request: Request) -> Any:
    served.engine.refuse_if_full()
    check_model(served, body.model)
    check_stream_options(body)
    check_token_ids(served, body.stop_token_ids or [], "stop_token_ids")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(
            "top_logprobs requires logprobs=true", param="top_logprobs", code="invalid_value"
        )
    requested, limit_param = requested_max_tokens(body)
    check_fan_out(served, 1, body.n)
    ids = await asyncio.to_thread(chat_prompt, served, body.messages)
    max_tokens = max_tokens_for(served, requested, len(ids), "messages", limit_param)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    requests = [
        (ids, sampling_params(body, max_tokens=max_tokens, choice=i, logprobs=logprobs))
        for i in range(body.n)
    ]
    choices = [ChoiceState(prompt_index=0, prompt_ids=ids) for _ in range(body.n)]
    group_id = served.engine.new_request_id("chatcmpl")
    _log_request("chat", group_id, body.user, [ids])
    group = RequestGroup(served.engine, group_id)
    await group.add(requests, body.cache_salt)
    created = int(time.time())
    tok = served.tokenizer

    def envelope(obj: str, choice_list: list[dict], **extra: Any) -> dict[str, Any]:
        return _envelope(obj, group_id, created, served, choice_list, **extra)

    if not body.stream:
        async with group:
            if not await run_to_end(group, choices, request):
                return Response(status_code=499)
        out = []
        for i, c in enumerate(choices):
            item: dict[str, Any] = {
                "index": i,
                "message": {"role": "assistant", "content": c.text, "refusal": None},
                "logprobs": chat_logprobs(tok, c.logprobs) if body.logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if body.return_token_ids:
                item["token_ids"] = c.token_ids
                item["prompt_token_ids"] = c.prompt_ids
            out.append(item)
        return envelope("chat.completion", out, usage=usage(choices))

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    usage_field = {"usage": None} if include_usage else {}

    async def chunks() -> AsyncIterator[str]:
        for i in range(body.n):
            opening = {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            yield sse(envelope("chat.completion.chunk", [opening], **usage_field))
        async for index, output in group.outputs():
            choices[index].add(output)
            if output.new_text or output.new_token_ids:
                item = {
                    "index": index,
                    "delta": {"content": output.new_text},
                    "logprobs": chat_logprobs(tok, output.new_logprobs or [])
                    if body.logprobs
                    else None,
                    "finish_reason": None,
                }
                if body.return_token_ids:
                    item["token_ids"] = output.new_token_ids
                yield sse(envelope("chat.completion.chunk", [item], **usage_field))
            if output.finished:
                final = {
                    "index": index,
                    "delta": {},
                    "logprobs": None,
                    "finish_reason": output.finish_reason,
                    "stop_reason": output.stop_reason,
                }
                yield sse(envelope("chat.completion.chunk", [final], **usage_field))
        if include_usage:
            yield sse(envelope("chat.completion.chunk", [], usage=usage(choices)))
        yield sse("[DONE]")

    return streaming(chunks(), group)


async def _score(served: Served, body: ScoreRequest, request: Request) -> Any:
    served.engine.refuse_if_full()
    check_model(served, body.model)
    check_prompt_or_messages(body.prompt, body.messages)
    if body.messages is not None:
        # The conversation as the model reads it, without a generation prompt after it.
        prompts = [await asyncio.to_thread(chat_prompt, served, body.messages, False)]
        prompt_param = "messages"
    else:
        prompts = await asyncio.to_thread(
            prompts_of, served, body.prompt, add_special_tokens=body.add_special_tokens
        )
        prompt_param = "prompt"
    check_fan_out(served, len(prompts), 1)
    # Scoring runs the prompt plus one (discarded) greedy token.
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=body.top_logprobs)
    for ids in prompts:
        max_tokens_for(served, 1, len(ids), prompt_param, prompt_param)
    choices = [ChoiceState(prompt_index=i, prompt_ids=ids) for i, ids in enumerate(prompts)]
    group_id = served.engine.new_request_id("score")
    _log_request("score", group_id, None, prompts)
    group = RequestGroup(served.engine, group_id)
    await group.add([(ids, params) for ids in prompts], body.cache_salt)
    async with group:
        if not await run_to_end(group, choices, request):
            return Response(status_code=499)
    tok = served.tokenizer
    prompt_tokens = sum(len(ids) for ids in prompts)
    return {
        "object": "score",
        "model": served.model_name,
        "system_fingerprint": served.system_fingerprint,
        "data": [score_entry(tok, i, c, body.top_logprobs) for i, c in enumerate(choices)],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 0,
            "total_tokens": prompt_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in choices)},
        },
    }


def _envelope(
    obj: str, group_id: str, created: int, served: Served, choices: list[dict], **extra: Any
) -> dict[str, Any]:
    """The fields every completion and chat completion body (or chunk) carries."""
    return {
        "id": group_id,
        "object": obj,
        "created": created,
        "model": served.model_name,
        "system_fingerprint": served.system_fingerprint,
        "choices": choices,
        **extra,
    }
