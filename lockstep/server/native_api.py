"""SGLang's native HTTP API, the one RL frameworks drive their rollout engine through.

    POST /generate                  token ids or text in; text, output_ids, meta_info out
    POST /abort_request             finish one request (by rid) or all, with what they have
    POST /update_weights_from_disk  new weights of the same architecture, no restart
    GET  /model_info, /server_info  (and their older names /get_model_info, /get_server_info)
    GET  /get_load, /health_generate

Shapes follow SGLang's (docs/server.md, "SGLang-native API"): a logprob entry is
`[logprob, token_id, text or null]`; `input_token_logprobs` covers prompt positions
`logprob_start_len..` and its first entry's logprob is null; `finish_reason` is an object
(`{"type": "length", "length": n}`, `{"type": "stop", "matched": id or string}`,
`{"type": "abort", ...}`); streams repeat the whole output so far in every event.

By the engine's contract a sampled token's logprob equals, bit for bit, the logprob that
scoring the same tokens gives: `output_token_logprobs` of a rollout and `input_token_logprobs`
of the rollout sent back are the same floats (the "true on-policy" check).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lockstep.engine.outputs import StepOutput, TokenLogprob
from lockstep.engine.sampling_params import SamplingParams
from lockstep.errors import ModelLoadError, RequestError, UnreadableWeights
from lockstep.server import routed_experts_field
from lockstep.server.async_engine import AsyncEngine, Overloaded, RequestGroup
from lockstep.server.delivery import run_to_end, streaming
from lockstep.server.native_protocol import (
    AbortRequest,
    GenerateRequest,
    NativeSamplingParams,
    UpdateWeightsFromDiskRequest,
)
from lockstep.server.preparation import (
    Served,
    check_fan_out,
    check_text_length,
    check_token_ids,
    max_tokens_for,
)
from lockstep.server.processing_fields import compile_constraint, native_processing_options
from lockstep.server.protocol import INT64_MAX, APIError, cache_namespace, clip
from lockstep.server.responses import json_logprob, sse
from lockstep.server.sampling import SamplingFields, build_sampling_params

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0


@dataclass
class _Item:
    """One engine request of a `/generate` call and everything it produced."""

    rid: str
    base_rid: str  # the prompt's rid (the same as `rid` unless n > 1)
    prompt_ids: list[int]
    params: NativeSamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    return_routed_experts: bool = False
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cached_tokens: int = 0
    # Logprob entries rendered by earlier events of a stream (`_render` adds only new ones).
    rendered_output: list[list[Any]] = field(default_factory=list)
    rendered_top: list[list[list[Any]] | None] = field(default_factory=list)
    rendered_prompt: tuple[object, list[list[Any]], list[Any]] | None = None
    routed_experts: np.ndarray | None = None  # on the closing output (StepOutput's)

    def add(self, output: StepOutput) -> None:
        self.text += output.new_text
        self.output_ids.extend(output.new_token_ids)
        self.output_logprobs.extend(output.new_token_logprobs)
        self.output_top.extend(output.new_logprobs or ())
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.cached_tokens = output.cached_tokens
        if output.finished:
            self.finish_reason = output.finish_reason
            self.stop_reason = output.stop_reason
            self.routed_experts = output.routed_experts

    @property
    def scores_only(self) -> bool:
        """max_new_tokens=0: the engine samples one token (it must compute a last position)
        and the response leaves it out."""
        return self.params.max_new_tokens == 0


def add_native_routes(
    app: FastAPI, served: Served, refresh_fingerprint: Callable[[], None]
) -> None:
    """Register SGLang's native routes on `app`. `refresh_fingerprint` recomputes the served
    system fingerprint after a weight update."""
    engine: AsyncEngine = served.engine
    active: dict[str, tuple[RequestGroup, list[int]]] = {}  # rid -> its group and indices

    @app.post("/generate", response_model=None)
    async def generate(body: GenerateRequest, request: Request) -> Response | dict | list:
        engine.refuse_if_full()
        body = _seed_from_header(body, request.headers.get(SEED_HEADER))
        items, batched = await _prepare(served, body, active)
        group = RequestGroup(engine, engine.new_request_id("generate"))
        requests = [
            (item.prompt_ids, _sampling_params(item, j, served.vocab_size)) for item, j in items
        ]
        for _, params in requests:  # off the event loop; each distinct spec once (cached)
            await compile_constraint(served.grammars, params.structured_output)
        await group.add(
            requests, cache_namespace(body.extra_key, body.cache_salt), stream=bool(body.stream)
        )
        flat = [item for item, _ in items]
        for index, item in enumerate(flat):
            for rid in {item.rid, item.base_rid}:  # a sample, and the prompt's n samples
                active.setdefault(rid, (group, []))[1].append(index)
        started = time.perf_counter()
        logger.info("generate %s prompts=%d", group.request_ids[0], len(flat))

        def forget() -> None:
            for item in flat:
                for rid in (item.rid, item.base_rid):
                    if rid in active and active[rid][0] is group:
                        del active[rid]

        def render(index: int) -> dict[str, Any]:
            return _render(served, flat[index], started, body.return_text_in_logprobs)

        if not body.stream:
            try:
                async with group:
                    if not await run_to_end(group, flat, request):
                        return Response(status_code=499)
            finally:
                forget()
            outputs = [render(i) for i in range(len(flat))]
            return outputs if batched else outputs[0]

        async def chunks() -> AsyncIterator[str]:
            try:
                async for index, output in group.outputs():
                    flat[index].add(output)
                    event = render(index)
                    if batched:
                        event["index"] = index
                    yield sse(event)
                yield sse("[DONE]")
            finally:
                forget()

        return streaming(chunks(), group)

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest) -> dict[str, Any]:
        if body.abort_all:
            engine.finish_aborted(None)
            return {"aborted": "all"}
        entry = active.get(body.rid)
        if entry is None:
            return {"aborted": []}  # finished already, or never known: nothing to do (SGLang)
        group, indices = entry
        engine.finish_aborted([group.request_ids[i] for i in indices])
        return {"aborted": [body.rid]}

    @app.get("/model_info")  # SGLang's current name; routers ask it first
    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return {
            "model_path": engine.fingerprint["weights_source"],
            "tokenizer_path": served.tokenizer_path,
            "served_model_name": served.model_name,
            "is_generation": True,
            "model_type": engine.info.model_type,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
            "max_model_len": served.max_model_len,
        }

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        snap = await engine.snapshot()
        config, stats = snap["config"], snap["stats"]
        from lockstep import __version__

        return {
            "version": __version__,
            "served_model_name": served.model_name,
            # SGLang's routers load their tokenizer from this field (they read no other over
            # HTTP, docs/scale-out.md): a tokenizer folder, the weights' own where they are
            # one. `weights_path` and /model_info's `model_path` name the weights.
            "model_path": served.tokenizer_path or snap["fingerprint"]["weights_source"],
            "weights_path": snap["fingerprint"]["weights_source"],
            "tokenizer_path": served.tokenizer_path,
            "weight_version": snap["fingerprint"]["weight_version"],
            "context_length": served.max_model_len,
            "max_total_num_tokens": stats["kv_total"],
            "max_running_requests": config.max_running,
            "max_prefill_tokens": config.max_batch_tokens,
            "chunked_prefill_size": config.chunk_size,
            "disable_radix_cache": not config.enable_prefix_cache,
            "mode": config.mode,
            "device": config.resolved_device,
            "dtype": config.resolved_dtype,
            "engine_config": dataclasses.asdict(config),
            "fingerprint": snap["fingerprint"],
            "internal_states": [
                {"num_running_reqs": stats["num_running"], "num_waiting_reqs": stats["num_waiting"]}
            ],
        }

    @app.get("/get_load")
    async def get_load() -> list[dict[str, int]]:
        """SGLang's load report (one entry per data-parallel rank; Lockstep has one), which
        load-aware router policies read: requests running and waiting, KV tokens in use."""
        stats = await engine.stats()
        return [{"dp_rank": 0, "num_reqs": stats["num_running"],
                 "num_waiting_reqs": stats["num_waiting"], "num_tokens": stats["kv_in_use"]}]  # fmt: skip

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """A one-token generation through the engine (SGLang's deep health check). While
        generation is paused or memory released (docs/rl.md) no step runs: healthy, said so,
        without waiting (a supervisor must not restart a server in a weight sync)."""
        held = engine.generation_paused or engine.memory_released
        if held:
            what = "paused" if engine.generation_paused else "memory released"
            return JSONResponse({"status": "ok", "detail": f"generation {what}"})
        group = RequestGroup(engine, engine.new_request_id("health"))
        try:
            async with group:
                await group.add([([0], SamplingParams(max_tokens=1, temperature=0.0))], None)
                async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
                    async for _ in group.outputs():
                        pass
        except Overloaded:
            return JSONResponse({"status": "ok", "detail": "at capacity"})  # busy, serving
        except TimeoutError:
            error = APIError(
                f"a one-token generation did not finish in {HEALTH_GENERATE_TIMEOUT_S:g} s",
                status=503,
                type="server_error",
                code="engine_unhealthy",
            )
            return JSONResponse(error.body(), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.post("/update_weights_from_disk", response_model=None)
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest) -> Response:
        _check_update_options(body)
        async with engine.control_lock:
            engine.pause_admission()
            try:
                await engine.quiesce_for_weights(body.abort_all_requests)
                path, version = body.model_path, body.weight_version
                try:
                    await engine.update_weights_from_disk(path, version)
                except (ModelLoadError, RequestError) as exc:
                    logger.warning("weight update refused: %s", exc)
                    message = str(exc)
                    if isinstance(exc, UnreadableWeights):  # never tell what exists on disk
                        message = (
                            "model_path names no model this server can load (a Hugging Face "
                            "folder, a .gguf file, a hub id or a random: preset); the server's "
                            "log says why"
                        )
                    return JSONResponse(
                        {"success": False, "message": message, "num_paused_requests": 0},
                        status_code=400,
                    )
                refresh_fingerprint()
            finally:
                engine.resume_admission()
        return JSONResponse(
            {
                "success": True,
                "message": f"Succeeded to update model weights from {path}.",
                "num_paused_requests": 0,
                "weight_version": engine.weight_version,
            }
        )


def _check_update_options(body: UpdateWeightsFromDiskRequest) -> None:
    if body.load_format not in (None, "auto"):
        raise APIError(
            f"load_format={body.load_format!r} is not supported: the format is detected"
            " (a Hugging Face folder, a .gguf file or a random: preset); send null or 'auto'",
            param="load_format",
            code="unsupported_parameter",
        )
    if not body.flush_cache:
        raise APIError(
            "flush_cache=false is refused: the prefix cache holds KV the old weights computed,"
            " which the new weights would read as theirs",
            param="flush_cache",
            code="invalid_value",
        )
    for name in ("is_async", "keep_pause"):
        if getattr(body, name):
            raise APIError(
                f"{name}=true is not supported by Lockstep; leave it out",
                param=name,
                code="unsupported_parameter",
            )


# A request's seed as an HTTP header, for routers that rebuild `/generate` bodies from a
# fixed set of fields and drop `sampling_seed` (vllm-router 0.1.17; docs/scale-out.md).
SEED_HEADER = "X-Sampling-Seed"


def _seed_from_header(body: GenerateRequest, header: str | None) -> GenerateRequest:
    """`body` with `SEED_HEADER`'s seed as the `sampling_seed` of every prompt that has none;
    a 400 when the header is not a seed or disagrees with a seed the body gives."""
    if header is None:
        return body
    try:
        seed = int(header.strip())
    except ValueError:
        seed = -1
    if not 0 <= seed <= INT64_MAX:
        raise APIError(f"{SEED_HEADER}: {clip(repr(header))} is not a seed: expected an "
                       "integer from 0 to 2**63-1", param=SEED_HEADER, code="invalid_value")  # fmt: skip
    given = body.sampling_params
    params = given if isinstance(given, list) else [given or NativeSamplingParams()]
    for p in params:
        if p.sampling_seed is not None and p.sampling_seed != seed:
            raise APIError(f"sampling_params.sampling_seed={p.sampling_seed} and {SEED_HEADER}: "
                           f"{seed} disagree: send one, or the same seed in both",
                           param=SEED_HEADER, code="invalid_value")  # fmt: skip
    seeded = [p.model_copy(update={"sampling_seed": seed}) for p in params]
    return body.model_copy(
        update={"sampling_params": seeded if isinstance(given, list) else seeded[0]}
    )


def _per_item(value: Any, count: int, name: str, default: Any) -> list[Any]:
    """A per-request field given once for all, or as a list with one per prompt."""
    if value is None:
        return [default] * count
    if isinstance(value, list):
        if len(value) != count:
            raise APIError(
                f"{name} has {len(value)} entries for {count} prompt(s): expected one per prompt",
                param=name,
                code="invalid_value",
            )
        return [default if v is None else v for v in value]
    return [value] * count


async def _prepare(
    served: Served, body: GenerateRequest, active: dict[str, Any]
) -> tuple[list[tuple[_Item, int]], bool]:
    """The engine requests of a `/generate` body, one per prompt and sample (each with its
    sample index), and whether the response is a list; every mistake is a 400 first."""
    if (body.text is None) == (body.input_ids is None):
        raise APIError(
            "send exactly one of text and input_ids",
            param="text" if body.input_ids is None else "input_ids",
            code="missing" if body.text is None else "invalid_value",
        )
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        for text in texts:
            check_text_length(served, text, "text")
        prompts = await asyncio.to_thread(lambda: [served.tokenizer.encode(t) for t in texts])
        prompt_param, batched = "text", isinstance(body.text, list)
        if any(not ids for ids in prompts):
            raise APIError("The text is empty (no tokens).", param="text", code="invalid_value")
    else:
        assert body.input_ids is not None
        batched = isinstance(body.input_ids[0], list)
        prompts = body.input_ids if batched else [body.input_ids]  # type: ignore[assignment]
        prompt_param = "input_ids"
        for ids in prompts:
            check_token_ids(served, ids, "input_ids")
    count = len(prompts)
    params = _per_item(body.sampling_params, count, "sampling_params", NativeSamplingParams())
    return_logprob = _per_item(body.return_logprob, count, "return_logprob", False)
    starts = _per_item(body.logprob_start_len, count, "logprob_start_len", -1)
    tops = _per_item(body.top_logprobs_num, count, "top_logprobs_num", 0)
    routed = _per_item(body.return_routed_experts, count, "return_routed_experts", False)
    rids = _rids(body.rid, count, batched)
    check_fan_out(served, count, max(p.n for p in params))
    items: list[tuple[_Item, int]] = []
    for i, ids in enumerate(prompts):
        p = params[i]
        max_tokens_for(served, max(p.max_new_tokens, 1), len(ids), prompt_param,
                       "sampling_params.max_new_tokens")  # fmt: skip
        check_token_ids(served, list(p.stop_token_ids or ()), "sampling_params.stop_token_ids")
        if not -1 <= starts[i] < len(ids):
            raise APIError(
                f"logprob_start_len={starts[i]} is out of range for a prompt of {len(ids)}"
                f" tokens: expected -1 (output logprobs only) to {len(ids) - 1}",
                param="logprob_start_len",
                code="invalid_value",
            )
        if not 0 <= tops[i] <= 20:
            raise APIError(
                f"top_logprobs_num={tops[i]} is out of range: expected 0 to 20",
                param="top_logprobs_num",
                code="invalid_value",
            )
        for j in range(p.n):
            rid = rids[i] if p.n == 1 else f"{rids[i]}_{j}"
            if rid in active or rids[i] in active:
                raise APIError(
                    f"rid {clip(repr(rid))} is already in use", param="rid", code="invalid_value"
                )
            item = _Item(rid, rids[i], list(ids), p, return_logprob[i], starts[i], tops[i],
                         routed[i])  # fmt: skip
            items.append((item, j))
    if len({item.rid for item, _ in items}) < len(items):
        raise APIError("rid values must be distinct", param="rid", code="invalid_value")
    return items, batched or len(items) > 1


def _rids(rid: str | list[str] | None, count: int, batched: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if isinstance(rid, list):
        return _per_item(rid, count, "rid", None)
    return [f"{rid}_{i}" for i in range(count)] if batched else [rid]


def _sampling_params(item: _Item, sample: int, vocab_size: int) -> SamplingParams:
    """Sample `sample` of an item through the one builder (lockstep/server/sampling.py)."""
    wants_top = item.return_logprob and item.top_logprobs_num > 0
    wants_input = item.return_logprob and item.logprob_start_len >= 0
    return build_sampling_params(
        native_fields(item.params),
        choice=sample,
        logprobs=item.top_logprobs_num if wants_top else None,
        prompt_logprobs=item.top_logprobs_num if wants_input else None,
        # SGLang leaves the first returned position's logprob out: not computed either, so a
        # rollout's cached prompt serves the scoring of its output.
        prompt_logprobs_start=item.logprob_start_len + 1,
        processing=native_processing_options(item.params, vocab_size),
        return_routed_experts=item.return_routed_experts,
    )


def native_fields(p: NativeSamplingParams) -> SamplingFields:
    """The sampling knobs of SGLang's `sampling_params` (at least one new token, as SGLang
    generates one where max_new_tokens is 0)."""
    return SamplingFields(
        max_tokens=max(p.max_new_tokens, 1), temperature=p.temperature, top_k=p.top_k,
        top_p=p.top_p, min_p=p.min_p, seed=p.sampling_seed,
        seed_param="sampling_params.sampling_seed", stop=p.stop,
        stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos,
        keep_stop_string=p.no_stop_trim, skip_special_tokens=p.skip_special_tokens,
        error_param="sampling_params",
    )  # fmt: skip


def _render(served: Served, item: _Item, started: float, with_text: bool) -> dict[str, Any]:
    """One output object as SGLang shapes it (the whole output so far while streaming). The
    logprob entries of earlier events are kept on the item, so an event renders only the
    tokens that are new since the last one (the prompt's once)."""
    tok = served.tokenizer
    ids, text = item.output_ids, item.text
    if item.scores_only:
        ids, text = [], ""
    meta: dict[str, Any] = {
        "id": item.rid,
        "finish_reason": _finish_reason(item, len(ids)),
        "prompt_tokens": len(item.prompt_ids),
        "completion_tokens": len(ids),
        "cached_tokens": item.cached_tokens,
        "weight_version": served.engine.weight_version,
        "e2e_latency": time.perf_counter() - started,
    }

    def entry(logprob: float | None, token_id: int) -> list[Any]:
        text_of = tok.decode([token_id], False) if with_text else None
        return [None if logprob is None else json_logprob(logprob), token_id, text_of]

    def alternatives(e: TokenLogprob | None) -> list[list[Any]] | None:
        return None if e is None else [entry(lp, t) for t, lp in e.top]

    if item.return_logprob:
        start = item.logprob_start_len
        if item.rendered_prompt is None or item.rendered_prompt[0] is not item.prompt_logprobs:
            prompt: list[TokenLogprob | None] = []
            if start >= 0:
                prompt = list(item.prompt_logprobs or [None] * len(item.prompt_ids))[start:]
                prompt[0] = None  # SGLang's shape: the first returned position has no logprob
            entries = [
                entry(None if e is None else e.logprob, t)
                for e, t in zip(prompt, item.prompt_ids[max(start, 0) :], strict=False)
            ]
            tops = [alternatives(e) for e in prompt] if item.top_logprobs_num else []
            item.rendered_prompt = (item.prompt_logprobs, entries, tops)
        done, lps = item.rendered_output, item.output_logprobs
        done.extend(entry(lps[i], ids[i]) for i in range(len(done), len(ids)))
        meta["input_token_logprobs"] = item.rendered_prompt[1]
        meta["output_token_logprobs"] = done[: len(ids)]
        if item.top_logprobs_num:
            top, source = item.rendered_top, [] if item.scores_only else item.output_top
            top.extend(alternatives(source[i]) for i in range(len(top), len(source)))
            meta["input_top_logprobs"] = item.rendered_prompt[2]
            meta["output_top_logprobs"] = top[: len(source)]
    if item.routed_experts is not None:
        # SGLang's rows: every position that ran a forward, prompt + output - 1 (a scoring
        # call's one sampled token is no output, so its position is left out too).
        rows = len(item.prompt_ids) + len(ids) - 1
        meta["routed_experts"] = routed_experts_field.encode(item.routed_experts[:rows])
    return {"text": text, "output_ids": list(ids), "meta_info": meta}


def _finish_reason(item: _Item, completion_tokens: int) -> dict[str, Any] | None:
    if item.finish_reason is None:
        return None
    if item.scores_only or item.finish_reason == "length":
        return {"type": "length", "length": completion_tokens}
    if item.finish_reason == "abort":
        return {"type": "abort", "message": "aborted before it finished"}
    matched = item.stop_reason if item.stop_reason is not None else item.output_ids[-1]
    return {"type": "stop", "matched": matched}
