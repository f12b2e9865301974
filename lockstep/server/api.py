"""The OpenAI-compatible HTTP API: routes, request preparation and error mapping.

`build_app(engine)` wraps an already-loaded engine (loading happens in `cli.py`, before the
port opens, so a bad model is a start-up error and not a failing first request). Every client
mistake is refused before any engine work with an OpenAI-style 4xx body; a request whose
client goes away, streaming or not, is aborted so its KV slots return to the pool at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from lockstep.engine.outputs import TokenLogprob
from lockstep.engine.sampling_params import SamplingParams
from lockstep.errors import RequestError
from lockstep.server.async_engine import AsyncEngine, EngineFailure, RequestGroup
from lockstep.server.metrics import ServerMetrics
from lockstep.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ScoreRequest,
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

_DISCONNECT_POLL_S = 0.25
# One HTTP request may fan out to at most this many engine requests (prompts x n): a bigger
# batch belongs in several requests, and a single one must not flood the scheduler's queue.
MAX_SEQUENCES_PER_REQUEST = 256
MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclasses.dataclass
class _Served:
    """What the routes need to know about the engine, read once at start-up."""

    engine: AsyncEngine
    model_name: str
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    created: int
    system_fingerprint: str


def build_app(engine: Any) -> FastAPI:
    metrics = ServerMetrics()
    async_engine = AsyncEngine(engine, metrics)
    fingerprint = json.dumps(engine.fingerprint(), sort_keys=True, default=str)
    served = _Served(
        engine=async_engine,
        model_name=engine.model_name,
        tokenizer=engine.tokenizer,
        max_model_len=engine.max_model_len,
        vocab_size=engine.tokenizer.vocab_size,
        created=int(time.time()),
        system_fingerprint="lockstep-" + hashlib.sha256(fingerprint.encode()).hexdigest()[:16],
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            # Uvicorn has already drained (or timed out on) open connections by now.
            await asyncio.to_thread(async_engine.stop)

    app = FastAPI(title="Lockstep", version=_version(), lifespan=lifespan)
    app.add_middleware(_BodySizeLimit, max_bytes=MAX_BODY_BYTES)
    _install_error_handlers(app, metrics)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not async_engine.alive:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(served)]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        _check_model(served, model)
        return _model_card(served)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        stats = await async_engine.call(lambda e: e.stats())
        return Response(metrics.render(stats), media_type="text/plain; version=0.0.4")

    @app.get("/v1/engine")
    async def engine_info() -> dict[str, Any]:
        def snapshot(e: Any) -> dict[str, Any]:
            return {"stats": e.stats(), "fingerprint": e.fingerprint(), "config": e.config}

        snap = await async_engine.call(snapshot)
        config = dataclasses.asdict(snap["config"])
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

    @app.post("/flush_cache")
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

    return app


def _version() -> str:
    from lockstep import __version__

    return __version__


class _BodySizeLimit:
    """Refuses a body over `max_bytes` (413) before it is read into memory. Plain ASGI, not
    `BaseHTTPMiddleware`, which would hide client disconnects from the routes."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"0")
        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise APIError(self._message(), status=413, code="request_too_large")
            return message

        if not declared.isdigit() or int(declared) > self.max_bytes:
            error = APIError(self._message(), status=413, code="request_too_large")
            response = JSONResponse(error.body(), status_code=413)
            return await response(scope, receive, send)
        return await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return f"The request body is larger than {self.max_bytes} bytes."


# -- errors ------------------------------------------------------------------------------


def _install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def reply(error: APIError) -> JSONResponse:
        metrics.http_errors.labels(str(error.status)).inc()
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return reply(exc)

    @app.exception_handler(RequestError)
    async def request_error(_: Request, exc: RequestError) -> JSONResponse:
        return reply(APIError(str(exc), param=_param_of(str(exc))))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return reply(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return reply(APIError(str(exc.detail), code=code, status=exc.status_code))

    @app.exception_handler(EngineFailure)
    async def engine_failure(_: Request, exc: EngineFailure) -> JSONResponse:
        return reply(_engine_failure_error(exc))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return reply(
            APIError(f"internal error: {type(exc).__name__}", status=500, type="server_error")
        )


def _engine_failure_error(exc: EngineFailure) -> APIError:
    if exc.unavailable:
        return APIError(str(exc), status=503, type="server_error", code="unavailable")
    return APIError(str(exc), status=500, type="server_error", code="engine_failure")


def _param_of(message: str) -> str | None:
    """`SamplingParams` and the engine start messages with `name=value`."""
    match = re.match(r"([a-z_]+)=", message)
    return match.group(1) if match else None


# Fields whose pydantic errors name a union branch ("prompt.list[int].0"): one clear message.
_UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids (integers >= 0) or a list of"
    " token-id lists, none of them empty",
    "stop": "a string or a list of at most 16 strings",
    "content": "a string or a list of text parts",
}


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError("invalid request body")
    first = errors[0]
    kind = first.get("type", "")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # Inside a union pydantic names the branch ("prompt.list[int].0", "stop.str"): the field
    # the client wrote is the path before the first branch name.
    branch = next((i for i, p in enumerate(loc) if p == "str" or "[" in p), None)
    param = ".".join(loc[:branch]) or None
    if kind == "json_invalid":
        return APIError(
            "We could not parse the JSON body of your request: "
            + str(first.get("ctx", {}).get("error", "invalid JSON")),
            code="invalid_json",
        )
    if kind == "extra_forbidden":
        return APIError(
            f"Unrecognized request argument supplied: {param}",
            param=param,
            code="unknown_parameter",
        )
    if kind == "missing":
        if param is None:
            return APIError("The request has no body: expected a JSON object.", code="missing")
        return APIError(f"Missing required parameter: {param!r}.", param=param, code="missing")
    if branch is not None and branch > 0 and loc[branch - 1] in _UNION_FIELDS:
        return APIError(
            f"Invalid value for {param!r}: expected {_UNION_FIELDS[loc[branch - 1]]}",
            param=param,
            code="invalid_value",
        )
    detail = first.get("msg", "invalid value")
    shown = json.dumps(first.get("input"), default=str)[:200]
    return APIError(
        f"Invalid value for {param or 'body'!r}: {detail} (got {shown})",
        param=param,
        code="invalid_type" if kind.endswith("_type") else "invalid_value",
    )


# -- request preparation -----------------------------------------------------------------


def _check_model(served: _Served, model: str) -> None:
    if model != served.model_name:
        raise APIError(
            f"The model `{model}` does not exist; this server serves `{served.model_name}`.",
            param="model",
            code="model_not_found",
            status=404,
        )


def _model_card(served: _Served) -> dict[str, Any]:
    return {
        "id": served.model_name,
        "object": "model",
        "created": served.created,
        "owned_by": "lockstep",
        "max_model_len": served.max_model_len,
    }


def _prompts(served: _Served, prompt: Any, *, add_special_tokens: bool = True) -> list[list[int]]:
    """A prompt in any of OpenAI's four shapes, as token-id lists (ids checked in range)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    ids_list = []
    for item in prompt:
        if isinstance(item, str):
            ids = served.tokenizer.encode(item, add_special_tokens=add_special_tokens)
        else:
            ids = list(item)
            bad = [t for t in ids if t >= served.vocab_size]
            if bad:
                raise APIError(
                    f"token id {bad[0]} is out of range: the vocabulary has"
                    f" {served.vocab_size} tokens",
                    param="prompt",
                    code="invalid_value",
                )
        if not ids:
            raise APIError("The prompt is empty (no tokens).", param="prompt")
        ids_list.append(ids)
    return ids_list


def _chat_prompt(
    served: _Served, messages: list[ChatMessage], add_generation_prompt: bool = True
) -> list[int]:
    """Applies the model's chat template; `developer` is OpenAI's newer name for `system`."""
    rendered = served.tokenizer.apply_chat_template(
        [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in messages
        ],
        add_generation_prompt=add_generation_prompt,
    )
    # The template already spells out the special tokens.
    ids = served.tokenizer.encode(rendered, add_special_tokens=False)
    if not ids:
        raise APIError("The messages render to an empty prompt.", param="messages")
    return ids


def _check_fan_out(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_SEQUENCES_PER_REQUEST:
        raise APIError(
            f"{num_prompts} prompts x n={n} asks for {num_prompts * n} sequences: at most"
            f" {MAX_SEQUENCES_PER_REQUEST} per request",
            param="n" if n > 1 else "prompt",
        )


def _max_tokens(
    served: _Served, requested: int | None, prompt_len: int, prompt_param: str, param: str
) -> int:
    """Refuses what cannot fit the context before any work; None means "up to the context"."""
    limit = served.max_model_len
    if prompt_len >= limit:
        raise APIError(
            f"This model's maximum context length is {limit} tokens, but the prompt has"
            f" {prompt_len} tokens (at least one token must be left to generate).",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return limit - prompt_len
    if prompt_len + requested > limit:
        raise APIError(
            f"This model's maximum context length is {limit} tokens, but you requested"
            f" {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for"
            f" the completion). Reduce the prompt or {param}.",
            param=param,
            code="context_length_exceeded",
        )
    return requested


def _sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    *,
    max_tokens: int,
    choice: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    seed = None if body.seed is None else body.seed + choice
    if seed is not None and seed >= 2**63:
        raise APIError(f"seed + n - 1 must be below 2**63 (seed={body.seed})", param="seed")
    stop = () if body.stop is None else (body.stop,) if isinstance(body.stop, str) else body.stop
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_k=max(body.top_k, 0),  # -1 is vLLM's spelling of "disabled"
        top_p=body.top_p,
        min_p=body.min_p,
        seed=seed,
        stop=tuple(stop),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


async def _run_to_end(group: RequestGroup, choices: list[ChoiceState], request: Request) -> bool:
    """Feeds every output into its choice until all finish. Returns False if the client went
    away first; the caller's `async with group` then aborts what is left."""

    async def consume() -> None:
        async for index, output in group.outputs():
            choices[index].add(output)

    task = asyncio.ensure_future(consume())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                task.result()
                return True
            if await request.is_disconnected():
                return False
    finally:
        task.cancel()


def _log_request(kind: str, group_id: str, user: str | None, prompts: list[list[int]]) -> None:
    logger.info(
        "%s %s user=%r prompts=%d prompt_tokens=%d",
        kind,
        group_id,
        user,
        len(prompts),
        sum(len(p) for p in prompts),
    )


def _streaming(chunks: AsyncIterator[str], group: RequestGroup) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except EngineFailure as exc:
            # The status line is long gone: report in-band, as OpenAI's streams do.
            yield sse(_engine_failure_error(exc).body())
        finally:
            # Client gone (the stream is cancelled) or done: free whatever still runs.
            group.abort()

    return StreamingResponse(
        body(), media_type="text/event-stream", background=BackgroundTask(group.abort)
    )


# -- routes ------------------------------------------------------------------------------


def _check_stream_options(body: CompletionRequest | ChatCompletionRequest) -> None:
    if body.stream_options is not None and not body.stream:
        raise APIError("stream_options is only allowed when stream is true", param="stream_options")


async def _completions(served: _Served, body: CompletionRequest, request: Request) -> Any:
    _check_model(served, body.model)
    _check_stream_options(body)
    # Tokenizing a long text takes a while: off the event loop, so other requests stream on.
    prompts = await asyncio.to_thread(_prompts, served, body.prompt)
    _check_fan_out(len(prompts), body.n)
    choices: list[ChoiceState] = []
    requests = []
    for p_index, ids in enumerate(prompts):
        max_tokens = _max_tokens(served, body.max_tokens, len(ids), "prompt", "max_tokens")
        for i in range(body.n):
            params = _sampling_params(
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
        return {
            "id": group_id,
            "object": "text_completion",
            "created": created,
            "model": served.model_name,
            "system_fingerprint": served.system_fingerprint,
            "choices": choice_list,
            **extra,
        }

    if not body.stream:
        async with group:
            if not await _run_to_end(group, choices, request):
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

    return _streaming(chunks(), group)


async def _chat(served: _Served, body: ChatCompletionRequest, request: Request) -> Any:
    _check_model(served, body.model)
    _check_stream_options(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError("top_logprobs requires logprobs=true", param="top_logprobs")
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise APIError(
            "max_tokens and max_completion_tokens are the same limit: send only one",
            param="max_tokens",
        )
    ids = await asyncio.to_thread(_chat_prompt, served, body.messages)
    limit_param = "max_tokens" if body.max_tokens is not None else "max_completion_tokens"
    requested = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
    max_tokens = _max_tokens(served, requested, len(ids), "messages", limit_param)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    requests = [
        (ids, _sampling_params(body, max_tokens=max_tokens, choice=i, logprobs=logprobs))
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
        return {
            "id": group_id,
            "object": obj,
            "created": created,
            "model": served.model_name,
            "system_fingerprint": served.system_fingerprint,
            "choices": choice_list,
            **extra,
        }

    if not body.stream:
        async with group:
            if not await _run_to_end(group, choices, request):
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

    return _streaming(chunks(), group)


async def _score(served: _Served, body: ScoreRequest, request: Request) -> Any:
    _check_model(served, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError("send exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        # The conversation as the model reads it, without a generation prompt after it.
        prompts = [await asyncio.to_thread(_chat_prompt, served, body.messages, False)]
        prompt_param = "messages"
    else:
        prompts = await asyncio.to_thread(
            _prompts, served, body.prompt, add_special_tokens=body.add_special_tokens
        )
        prompt_param = "prompt"
    _check_fan_out(len(prompts), 1)
    # Scoring runs the prompt plus one (discarded) greedy token.
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=body.top_logprobs)
    for ids in prompts:
        _max_tokens(served, 1, len(ids), prompt_param, prompt_param)
    choices = [ChoiceState(prompt_index=i, prompt_ids=ids) for i, ids in enumerate(prompts)]
    group_id = served.engine.new_request_id("score")
    _log_request("score", group_id, None, prompts)
    group = RequestGroup(served.engine, group_id)
    await group.add([(ids, params) for ids in prompts], body.cache_salt)
    async with group:
        if not await _run_to_end(group, choices, request):
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
