"""Error handling of the HTTP API: every failure becomes an OpenAI-style error body.

Client mistakes (bad JSON, wrong types, unknown or unsupported fields, oversized bodies, a
method the route does not take) are 4xx with `type: invalid_request_error`, a `code` from
docs/server.md's error table and, where one field is at fault, its name in `param`. A 405
names the allowed methods in `Allow`; HEAD is allowed wherever GET is. A 5xx means a
Lockstep bug.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lockstep.errors import RequestError
from lockstep.server.async_engine import EngineFailure, Overloaded
from lockstep.server.protocol import APIError, StrictModel, clip
from lockstep.server.request_bodies import BodyRefused

logger = logging.getLogger(__name__)


# The routes that admit sequences into the engine: on a full server they are refused before
# their body is read (a burst of 300 must not cost 300 JSON parses on the event loop).
ADMITTING_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/score", "/generate"})


class RefuseWhenFull:
    """Answers a POST to an admitting route with the 429 of `overloaded` while the engine
    admits nothing more, before its body is read or parsed; the route checks again (its
    request may need more sequences than are free). Plain ASGI, as below."""

    def __init__(self, app: Any, engine: Any) -> None:
        self.app = app
        self.engine = engine

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            if scope["path"] in ADMITTING_ROUTES:
                try:
                    self.engine.refuse_if_full()
                except Overloaded as exc:
                    response = JSONResponse(
                        _overloaded_error(exc).body(),
                        status_code=429,
                        headers={"Retry-After": str(exc.retry_after_s)},
                    )
                    return await response(scope, receive, send)
        await self.app(scope, receive, send)


class HeadAsGet:
    """Answers HEAD wherever GET is allowed: the routes see a GET, the client gets its status
    and headers (`content-length` included) without the body. Plain ASGI, as above."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def send_without_body(message: dict) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, send_without_body)


def install_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error body (`lockstep_http_errors_total` counts them as they are
    written: connections.py)."""

    def reply(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return reply(exc)

    @app.exception_handler(RequestError)
    async def request_error(_: Request, exc: RequestError) -> JSONResponse:
        return reply(APIError(str(exc), param=_param_of(str(exc)), code="invalid_value"))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        return reply(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc, BodyRefused):
            return reply(exc.error)
        if exc.status_code == 400:
            # FastAPI's one 400: a body `json.loads` refused for a reason other than syntax
            # (not UTF-8, nested too deep, an integer of more than 4300 digits).
            return reply(_unreadable_body(str(exc.__cause__ or exc.detail)))
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        error = APIError(str(exc.detail), code=code, status=exc.status_code)
        return reply(error, _with_head(exc.headers))

    @app.exception_handler(EngineFailure)
    async def engine_failure(_: Request, exc: EngineFailure) -> JSONResponse:
        return reply(engine_failure_error(exc))

    @app.exception_handler(Overloaded)
    async def overloaded(_: Request, exc: Overloaded) -> JSONResponse:
        return reply(_overloaded_error(exc), {"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return reply(
            APIError(f"internal error: {type(exc).__name__}", status=500, type="server_error")
        )


_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_STATUS_MEANINGS = {
    "400": "a client mistake (docs/server.md, Errors)",
    "404": "unknown model or resource",
    "413": "the body is over the size limit",
    "429": "the server is full: retry after Retry-After seconds",
    "503": "the server is shutting down",
}


def document_errors(app: FastAPI) -> None:
    """Makes the OpenAPI schema name the error statuses the routes answer, with OpenAI's error
    body: every route 429 (the server is full) and 503 (shutting down); a route that takes a
    body or a path parameter 400, 404 and 413 as well. FastAPI's 422 goes: a bad body is a
    400 here. Call after every route is added."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, routes=app.routes, description=None
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.pop("HTTPValidationError", None)
            components.pop("ValidationError", None)
            components["Error"] = _ERROR_SCHEMA
            error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
            for path, operations in schema["paths"].items():
                for operation in operations.values():
                    responses = operation["responses"]
                    responses.pop("422", None)
                    statuses = ["429", "503"]
                    if "requestBody" in operation or "{" in path:
                        statuses += ["400", "404", "413"]
                    for status in statuses:
                        responses[status] = {
                            "description": _STATUS_MEANINGS[status],
                            "content": error,
                        }
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _overloaded_error(exc: Overloaded) -> APIError:
    return APIError(str(exc), status=429, type="rate_limit_error", code="server_overloaded")


def engine_failure_error(exc: EngineFailure) -> APIError:
    if exc.unavailable:
        return APIError(str(exc), status=503, type="server_error", code="unavailable")
    return APIError(str(exc), status=500, type="server_error", code="engine_failure")


def _with_head(headers: dict[str, str] | None) -> dict[str, str] | None:
    """A 405's `Allow` lists the route's methods; `HeadAsGet` adds HEAD to every GET."""
    if not headers or "Allow" not in headers:
        return headers
    allowed = {method.strip() for method in headers["Allow"].split(",")}
    if "GET" in allowed:
        allowed.add("HEAD")
    return {**headers, "Allow": ", ".join(sorted(allowed))}


def _unreadable_body(reason: str) -> APIError:
    return APIError(
        f"We could not parse the JSON body of your request: {reason}", code="invalid_json"
    )


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


def _model_branch_names() -> set[str]:
    """The class names of every request model: how pydantic names a model branch of a union
    in an error's location."""
    names, todo = set(), [StrictModel]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def validation_error(exc: RequestValidationError) -> APIError:
    """pydantic's errors (the first one) as the 400 that names the field the client wrote."""
    errors = exc.errors()
    if not errors:
        return APIError("invalid request body", code="invalid_value")
    first = errors[0]
    kind = first.get("type", "")
    # A request model inside a union is named by its class ("sampling_params.
    # NativeSamplingParams.temprature"): the client wrote no such key, so it is left out.
    loc = [
        str(part)
        for part in first.get("loc", ())
        if part != "body" and part not in _model_branch_names()
    ]
    # Inside a union pydantic names the branch ("prompt.list[int].0", "stop.str"): the field
    # the client wrote is the path before the first branch name.
    branch = next((i for i, p in enumerate(loc) if p == "str" or "[" in p), None)
    param = ".".join(loc[:branch]) or None
    if kind == "json_invalid":
        return _unreadable_body(str(first.get("ctx", {}).get("error", "invalid JSON")))
    if kind == "extra_forbidden":
        return APIError(
            f"Unrecognized request argument supplied: {clip(param or '')}",
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
