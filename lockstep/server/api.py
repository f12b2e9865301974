"""The HTTP API: the app and its routes. The completion routes live in completions.py and
chat_completions.py, SGLang's native ones in native_api.py.

`build_app(engine)` wraps an already-loaded engine: an `EngineProcess` (engine_process.py;
`cli.py` loads it before the port opens, so a bad model is a start-up error and not a failing
first request) or an engine object served from a thread of this process (tests' fakes). Every
client mistake is refused before any engine work with an OpenAI-style 4xx body (`preparation.py`,
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
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from lockstep.engine.sampling_params import SamplingParams
from lockstep.server.async_engine import AsyncEngine, EngineLink, RequestGroup
from lockstep.server.auth import RequireApiKey
from lockstep.server.chat_completions import chat_completions
from lockstep.server.chat_prompt import ChatOptions, chat_prompt
from lockstep.server.completions import completions
from lockstep.server.delivery import run_to_end
from lockstep.server.engine_loop import EngineThread
from lockstep.server.engine_process import EngineProcess
from lockstep.server.http_errors import (
    HeadAsGet,
    RefuseWhenFull,
    document_errors,
    install_error_handlers,
)
from lockstep.server.metrics import ServerMetrics
from lockstep.server.native_api import add_native_routes
from lockstep.server.preparation import (
    MAX_SEQUENCES_PER_REQUEST,
    Served,
    check_fan_out,
    check_model,
    check_prompt_or_messages,
    check_token_ids,
    log_request,
    max_tokens_for,
    model_card,
    prompts_of,
    text_bound,
)
from lockstep.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ScoreRequest,
    TokenizeRequest,
    cache_namespace,
)
from lockstep.server.request_bodies import (
    MAX_BODY_BYTES,
    BodyReads,
    BodySizeLimit,
    UnfinishedBodies,
    big_body_route,
)
from lockstep.server.responses import ChoiceState, score_entry
from lockstep.server.rl_api import add_rl_routes
from lockstep.server.tool_parser import resolve_tool_call_parser

logger = logging.getLogger(__name__)

# Sequences that may wait for a running slot, per running slot, unless --max-waiting says: a
# deep enough queue to keep the engine busy between arrivals, short enough that a client
# refused with a 429 learns it at once instead of waiting without bound.
DEFAULT_WAITING_PER_RUNNING = 4


def build_app(
    engine: Any,
    max_waiting: int | None = None,
    tool_call_parser: str = "auto",
    api_key: str | None = None,
    admin_api_key: str | None = None,
) -> FastAPI:
    """The app over a loaded engine: an `EngineProcess`, or any object with the `Engine`
    interface, which then steps on a thread of this process. `max_waiting`: sequences admitted
    beyond the engine's `max_running` to wait for a running slot; more are refused with a 429
    (default: `DEFAULT_WAITING_PER_RUNNING` x max_running). `tool_call_parser`:
    `--tool-call-parser` (`tool_parser.resolve_tool_call_parser`). `api_key`, `admin_api_key`:
    the keys routes require (auth.py); None: open."""
    metrics = ServerMetrics()
    link: EngineLink = engine if isinstance(engine, EngineProcess) else EngineThread(engine)
    info = link.info
    max_running = info.config.resolved_max_running
    if max_waiting is None:
        max_waiting = DEFAULT_WAITING_PER_RUNNING * max_running
    async_engine = AsyncEngine(link, metrics, capacity=max_running + max_waiting)
    served = Served(
        engine=async_engine,
        model_name=info.model_name,
        tokenizer=info.tokenizer,
        max_model_len=info.max_model_len,
        vocab_size=info.tokenizer.vocab_size,
        created=int(time.time()),
        system_fingerprint=_system_fingerprint(info.fingerprint),
        kv_tokens=info.kv_slots,
        max_text_chars=text_bound(info.tokenizer, info.max_model_len),
        tool_call_parser=resolve_tool_call_parser(
            tool_call_parser, getattr(info.tokenizer, "chat_template", None)
        ),
        grammars=link.grammars,
        tokenizer_path=info.tokenizer_path,
    )

    def refresh_fingerprint() -> None:
        served.system_fingerprint = _system_fingerprint(async_engine.fingerprint)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            # Uvicorn has already drained (or timed out on) open connections by now.
            await async_engine.stop()

    app = FastAPI(title="Lockstep", version=_version(), lifespan=lifespan)
    body_reads = BodyReads()
    if isinstance(engine, EngineProcess):
        # The engine process (or a tensor-parallel worker) died: a body still arriving is
        # answered now with the 503 of the requests in flight, not when the exit gives up.
        engine.on_failure(body_reads.shed)

    def shed(reason: str) -> None:
        async_engine.shed(reason)
        body_reads.shed(reason)

    app.state.shed = shed  # the end of the shutdown's grace period (cli.py); any thread
    # lockstep_http_errors_total counts each error status where it is written, refusals below
    # the routes included (connections.py; cli.py hands it this).
    app.state.metrics = metrics
    # No list longer than this fits a request: big bodies holding one are refused unvalidated.
    max_list_items = max(served.max_model_len, MAX_SEQUENCES_PER_REQUEST)
    app.router.route_class = big_body_route(max_list_items, body_reads)
    app.add_middleware(BodySizeLimit, max_bytes=MAX_BODY_BYTES)
    app.add_middleware(HeadAsGet)
    app.add_middleware(RefuseWhenFull, engine=async_engine)
    if api_key or admin_api_key:  # outermost: a caller without a key reaches nothing
        app.add_middleware(RequireApiKey, api_key=api_key, admin_api_key=admin_api_key)
    # Outermost of all: it sees every answer, the refusals above included.
    app.add_middleware(UnfinishedBodies, reads=body_reads)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        failure = async_engine.failure
        if failure is not None:  # the engine process or a tensor-parallel worker is gone
            return JSONResponse({"status": "unhealthy", "error": failure}, status_code=503)
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

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics() -> Response:
        stats = await async_engine.stats()
        return Response(metrics.render(stats), media_type="text/plain; version=0.0.4")

    @app.get("/v1/engine")
    async def engine_info() -> dict[str, Any]:
        snap = await async_engine.snapshot()
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
            "kv_budget": snap["kv_budget"],
            "memory": snap["memory"],
            "last_engine_failure": async_engine.last_failure,
        }

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> dict[str, Any]:
        freed = await async_engine.flush_cache()
        return {"flushed_tokens": freed}

    @app.post("/v1/completions", response_model=None)
    async def completion_route(body: CompletionRequest, request: Request) -> Response | dict:
        return await completions(served, body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_route(body: ChatCompletionRequest, request: Request) -> Response | dict:
        return await chat_completions(served, body, request)

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

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return _tokenizer_info(served)

    add_native_routes(app, served, refresh_fingerprint)
    add_rl_routes(app, async_engine, refresh_fingerprint)
    document_errors(app)
    return app


def _system_fingerprint(fingerprint: dict[str, Any]) -> str:
    """OpenAI's `system_fingerprint`: a digest of what the results depend on (the engine's
    fingerprint, the weights served included, so it changes with a weight update)."""
    text = json.dumps(fingerprint, sort_keys=True, default=str)
    return "lockstep-" + hashlib.sha256(text.encode()).hexdigest()[:16]


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
        options = ChatOptions(
            add_generation_prompt=body.add_generation_prompt, add_special_tokens=add_special
        )
        ids = chat_prompt(served, body.messages, options)
    strs = [served.tokenizer.token_str(t) for t in ids] if body.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": served.max_model_len,
        "tokens": ids,
        "token_strs": strs,
    }


def _tokenizer_info(served: Served) -> dict[str, Any]:
    """vLLM's `/tokenizer_info`: the special tokens and the chat template. lm-evaluation-harness
    looks for it (with `/tokenize`) to tokenize through the server instead of loading a
    Hugging Face tokenizer of the served model's name."""
    tok = served.tokenizer
    return {
        "tokenizer_class": type(tok).__name__,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": None,
        "add_bos_token": tok.add_bos,
        "chat_template": getattr(tok, "chat_template", None),
        "model_max_length": served.max_model_len,
    }


def _version() -> str:
    from lockstep import __version__

    return __version__


async def _score(served: Served, body: ScoreRequest, request: Request) -> Any:
    served.engine.refuse_if_full()
    check_model(served, body.model)
    check_prompt_or_messages(body.prompt, body.messages)
    if body.messages is not None:
        # The conversation as the model reads it, without a generation prompt after it.
        no_prompt = ChatOptions(add_generation_prompt=False)
        prompts = [await asyncio.to_thread(chat_prompt, served, body.messages, no_prompt)]
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
    log_request("score", group_id, None, prompts)
    group = RequestGroup(served.engine, group_id)
    await group.add([(ids, params) for ids in prompts], cache_namespace(None, body.cache_salt))
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
