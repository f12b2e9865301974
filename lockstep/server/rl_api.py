"""The RL control routes SGLang's RL frameworks call (slime, Miles, AReaL, verl; docs/rl.md),
all admin routes (auth.py):

    POST /pause_generation        {"mode": "abort" | "retract" | "in_place"}
    POST /continue_generation
    POST /init_weights_update_group      {master_address, master_port, rank_offset,
                                          world_size, group_name, backend}
    POST /update_weights_from_distributed  {names, dtypes, shapes, group_name, flush_cache,
                                            abort_all_requests, weight_version}
    POST /destroy_weights_update_group   {group_name}
    POST /update_weights_from_tensor     {serialized_named_tensors: [base64 safetensors],
                                          load_format: "safetensors", weight_version, ...}
    POST /update_weight_version   {new_version, abort_all_requests}: rename the weights
    POST /reset_prefix_cache      vLLM's name for /flush_cache
    POST /release_memory_occupation, /resume_memory_occupation   {"tags": [...] | null}
    POST /sleep, /wake_up, GET /is_sleeping                      vLLM's names for the same

A pause stops the engine's steps (engine_loop.py): "abort" ends every request with finish
reason abort and the tokens it has; "retract" sends running requests back to the queue (their
KV to the radix cache), to be recomputed after `/continue_generation`; "in_place" keeps them
and their KV. New requests wait in the queue while paused. Position invariance makes a
retracted or paused request's output the bits it would have had unpaused.

A weight update runs one at a time, with admission paused: paused or not, SGLang's semantics
(`abort_all_requests`: requests in flight end with what they have; otherwise they finish on
the old weights first, unless generation is paused).
"""

from __future__ import annotations

import base64
import binascii
import logging
from typing import Any, Literal

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse
from pydantic import Field

from lockstep.errors import LockstepError
from lockstep.server.async_engine import AsyncEngine
from lockstep.server.protocol import INT64_MAX, APIError, RequestBody

logger = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 600.0  # how long a rank waits for the others in a weights update group
MAX_TENSORS = 100_000  # names in one update (a 1T-parameter MoE has ~100k tensors)


class PauseGenerationRequest(RequestBody):
    """SGLang's `POST /pause_generation`."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationRequest(RequestBody):
    """SGLang's `POST /continue_generation`."""

    torch_empty_cache: bool = Field(True, description="accepted: the allocator's cache stays")


class MemoryOccupationRequest(RequestBody):
    """SGLang's `POST /release_memory_occupation` and `/resume_memory_occupation`."""

    tags: list[Literal["kv_cache", "weights"]] | None = Field(
        None, min_length=1, max_length=2, description="null: both"
    )


class InitWeightsUpdateGroupRequest(RequestBody):
    """SGLang's `POST /init_weights_update_group`: the engine joins the trainer's group as
    rank `rank_offset` (the trainer is rank 0)."""

    master_address: str = Field(min_length=1, max_length=256)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, le=INT64_MAX)
    world_size: int = Field(ge=2, le=1 << 20)
    group_name: str = Field("weight_update_group", min_length=1, max_length=256)
    backend: Literal["gloo", "nccl"] = "nccl"


class DestroyWeightsUpdateGroupRequest(RequestBody):
    """SGLang's `POST /destroy_weights_update_group`."""

    group_name: str = Field("weight_update_group", min_length=1, max_length=256)


class UpdateWeightsFromDistributedRequest(RequestBody):
    """SGLang's `POST /update_weights_from_distributed`: tensors broadcast by rank 0 of the
    group, in the order of `names`."""

    names: list[str] = Field(min_length=1, max_length=MAX_TENSORS)
    dtypes: list[str] = Field(min_length=1, max_length=MAX_TENSORS)
    shapes: list[list[int]] = Field(min_length=1, max_length=MAX_TENSORS)
    group_name: str = Field("weight_update_group", min_length=1, max_length=256)
    flush_cache: bool = Field(True, description="must be true: the cached KV is the old model's")
    abort_all_requests: bool = False
    weight_version: str | None = Field(None, max_length=256)
    load_format: str | None = Field(None, description="None: the tensors as sent")
    torch_empty_cache: bool = Field(False, description="accepted")


class UpdateWeightVersionRequest(RequestBody):
    """SGLang's `POST /update_weight_version`: a new name for the weights served."""

    new_version: str = Field(min_length=1, max_length=256)
    abort_all_requests: bool = False


class UpdateWeightsFromTensorRequest(RequestBody):
    """SGLang's `POST /update_weights_from_tensor`, in the one serialisation Lockstep takes: a
    safetensors file of the tensors (Hugging Face names), base64 text, `load_format`
    'safetensors'."""

    serialized_named_tensors: list[str] = Field(min_length=1, max_length=64)
    load_format: str | None = Field(None, description="must be 'safetensors'")
    flush_cache: bool = Field(True, description="must be true: the cached KV is the old model's")
    abort_all_requests: bool = False
    weight_version: str | None = Field(None, max_length=256)


def add_rl_routes(app: FastAPI, engine: AsyncEngine, refresh_fingerprint: Any) -> None:
    """Register the RL control routes on `app`. `refresh_fingerprint` recomputes the served
    system fingerprint after a weight update."""

    @app.post("/pause_generation")
    async def pause_generation(body: PauseGenerationRequest | None = None) -> dict[str, Any]:
        mode = (body or PauseGenerationRequest()).mode
        async with engine.control_lock:
            count = await engine.pause_generation(mode)
        logger.info("generation paused (%s): %d request(s)", mode, count)
        return {"success": True, "message": f"Generation paused ({mode}).", "mode": mode,
                "num_paused_requests": count}  # fmt: skip

    @app.post("/continue_generation")
    async def continue_generation(body: ContinueGenerationRequest | None = None) -> dict:
        async with engine.control_lock:
            await engine.continue_generation()
        logger.info("generation continued")
        return {"success": True, "message": "Generation continued."}

    @app.post("/init_weights_update_group", response_model=None)
    async def init_weights_update_group(body: InitWeightsUpdateGroupRequest) -> JSONResponse:
        args = (body.master_address, body.master_port, body.rank_offset, body.world_size,
                body.group_name, body.backend, GROUP_TIMEOUT_S)  # fmt: skip
        return await _answer(
            engine.engine_call("init_weights_update_group", *args),
            f"Joined the weights update group {body.group_name!r}.",
        )

    @app.post("/destroy_weights_update_group", response_model=None)
    async def destroy_weights_update_group(
        body: DestroyWeightsUpdateGroupRequest | None = None,
    ) -> JSONResponse:
        name = (body or DestroyWeightsUpdateGroupRequest()).group_name
        return await _answer(
            engine.engine_call("destroy_weights_update_group", name),
            f"Left the weights update group {name!r}.",
        )

    async def update(abort_all: bool, call: str, args: tuple, source: str) -> JSONResponse:
        """One weight update: admission paused, the requests in flight handled SGLang's way
        (`AsyncEngine.quiesce_for_weights`), the engine call, the fingerprint refreshed."""
        async with engine.control_lock:
            engine.pause_admission()
            try:
                await engine.quiesce_for_weights(abort_all)
                try:
                    engine.fingerprint = await engine.engine_call(call, *args)
                except LockstepError as exc:
                    logger.warning("weight update refused: %s", exc)
                    return _refused(str(exc))
                except Exception as exc:  # the group failed (a rank gone, a timeout)
                    logger.error("weight update failed: %s", exc)
                    return _refused(f"the transfer failed: {exc}", status=500)
                refresh_fingerprint()
            finally:
                engine.resume_admission()
        return JSONResponse(
            {
                "success": True,
                "message": f"Succeeded to update model weights from {source}.",
                "num_paused_requests": 0,
                "weight_version": engine.weight_version,
            }
        )

    @app.post("/update_weights_from_distributed", response_model=None)
    async def update_weights_from_distributed(
        body: UpdateWeightsFromDistributedRequest,
    ) -> JSONResponse:
        _check_tensor_list(body)
        args = (body.group_name, body.names, body.dtypes, body.shapes, body.weight_version)
        return await update(body.abort_all_requests, "update_weights_from_distributed", args,
                            f"group {body.group_name!r}")  # fmt: skip

    @app.post("/update_weights_from_tensor", response_model=None)
    async def update_weights_from_tensor(body: UpdateWeightsFromTensorRequest) -> JSONResponse:
        blob = _safetensors_payload(body)
        return await update(body.abort_all_requests, "update_weights_from_tensor",
                            (blob, body.weight_version), "tensors")  # fmt: skip

    async def occupation(kind: str, tags: list[str] | None) -> JSONResponse:
        async with engine.control_lock:
            try:
                if kind == "release":
                    released = await engine.release_memory(tags)
                else:
                    released = await engine.resume_memory(tags)
            except LockstepError as exc:
                return _refused(str(exc))
        logger.info("memory %sd (%s): released now %s", kind, tags or "all", released)
        return JSONResponse({"success": True, "message": f"Memory {kind}d.",
                             "released_tags": released})  # fmt: skip

    @app.post("/release_memory_occupation", response_model=None)
    async def release_memory_occupation(
        body: MemoryOccupationRequest | None = None,
    ) -> JSONResponse:
        return await occupation("release", (body or MemoryOccupationRequest()).tags)

    @app.post("/resume_memory_occupation", response_model=None)
    async def resume_memory_occupation(body: MemoryOccupationRequest | None = None) -> JSONResponse:
        return await occupation("resume", (body or MemoryOccupationRequest()).tags)

    @app.post("/sleep", response_model=None)
    async def sleep(level: int = 1) -> JSONResponse:
        """vLLM's: every level releases the KV cache and the weights (level 2's dropping of
        the weights is not done: they are kept on the host, and come back on wake-up)."""
        if level not in (1, 2):
            raise APIError(f"level={level} is invalid: expected 1 or 2", param="level",
                           code="invalid_value")  # fmt: skip
        return await occupation("release", None)

    @app.post("/wake_up", response_model=None)
    async def wake_up(tags: list[str] | None = Query(None)) -> JSONResponse:  # noqa: B008
        return await occupation("resume", tags)

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": bool(engine.memory_released)}

    @app.post("/update_weight_version")
    async def update_weight_version(body: UpdateWeightVersionRequest) -> dict[str, Any]:
        async with engine.control_lock:
            if body.abort_all_requests:
                engine.finish_aborted(None)
            engine.fingerprint = await engine.engine_call("update_weight_version", body.new_version)
            refresh_fingerprint()
        return {"success": True, "message": f"Weight version updated to {body.new_version!r}.",
                "weight_version": engine.weight_version}  # fmt: skip

    @app.api_route("/reset_prefix_cache", methods=["GET", "POST"])
    async def reset_prefix_cache() -> dict[str, Any]:
        freed = await engine.flush_cache()
        return {"success": True, "flushed_tokens": freed}


def _safetensors_payload(body: UpdateWeightsFromTensorRequest) -> bytes:
    """The one safetensors file the body carries, decoded; a 400 for SGLang's other payloads
    (pickles, CUDA IPC handles), for more than one entry and for text that is not base64."""
    if body.load_format != "safetensors":
        raise APIError(
            f"load_format={body.load_format!r} is refused: SGLang's pickled tensors and CUDA IPC"
            " handles are not taken (unpickling a request runs its code); send load_format"
            " 'safetensors' with one base64 safetensors file (docs/rl.md)",
            param="load_format",
            code="unsupported_parameter",
        )
    if len(body.serialized_named_tensors) != 1:
        raise APIError(
            f"serialized_named_tensors has {len(body.serialized_named_tensors)} entries: expected"
            " 1 (one per tensor-parallel rank; this engine takes one)",
            param="serialized_named_tensors",
            code="invalid_value",
        )
    if not body.flush_cache:
        raise APIError(
            "flush_cache=false is refused: the prefix cache holds KV the old weights computed,"
            " which the new weights would read as theirs",
            param="flush_cache",
            code="invalid_value",
        )
    try:
        return base64.b64decode(body.serialized_named_tensors[0], validate=True)
    except binascii.Error:
        raise APIError(
            "serialized_named_tensors[0] is not base64 text",
            param="serialized_named_tensors",
            code="invalid_value",
        ) from None


def _check_tensor_list(body: UpdateWeightsFromDistributedRequest) -> None:
    """The declared tensors, checked before anything is received (a 400 here leaves the
    trainer's broadcasts to wait for the group's timeout: send what `update_request` makes)."""
    counts = {len(body.names), len(body.dtypes), len(body.shapes)}
    if len(counts) != 1:
        raise APIError(
            f"names, dtypes and shapes have {len(body.names)}, {len(body.dtypes)} and"
            f" {len(body.shapes)} entries: expected one of each per tensor",
            param="shapes",
            code="invalid_value",
        )
    for shape in body.shapes:
        if any(not 0 <= d <= INT64_MAX for d in shape):
            raise APIError(f"shape {shape} is invalid: expected sizes >= 0", param="shapes",
                           code="invalid_value")  # fmt: skip
    if not body.flush_cache:
        raise APIError(
            "flush_cache=false is refused: the prefix cache holds KV the old weights computed,"
            " which the new weights would read as theirs",
            param="flush_cache",
            code="invalid_value",
        )
    if body.load_format not in (None, "auto"):
        raise APIError(f"load_format={body.load_format!r} is not supported: send null",
                       param="load_format", code="unsupported_parameter")  # fmt: skip


async def _answer(call: Any, message: str) -> JSONResponse:
    """SGLang's `{success, message}` answer to an engine call: 400 with the engine's one
    line when it refuses, 500 when the group itself failed."""
    try:
        await call
    except LockstepError as exc:
        return _refused(str(exc))
    except Exception as exc:
        logger.error("%s", exc)
        return _refused(f"{type(exc).__name__}: {exc}", status=500)
    return JSONResponse({"success": True, "message": message})


def _refused(message: str, status: int = 400) -> JSONResponse:
    """SGLang's refusal (`success`, `message`) with OpenAI's error object beside it, so that
    either kind of client reads it."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    error = APIError(message, status=status, type=kind, code="refused")
    return JSONResponse(
        {"success": False, "message": message, "num_paused_requests": 0, **error.body()},
        status_code=status,
    )
