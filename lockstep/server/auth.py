"""API keys (`--api-key`, `--admin-api-key`): who may call which route, and who may see where
the server's files are.

    route                              needs (when the key is set)
    /health                            nothing: supervisors and load balancers probe it
    ADMIN_ROUTES                       the admin key if one is set, else the API key
    every other route                  the API key (the admin key works too)

A key travels as `Authorization: Bearer <key>`, as OpenAI's clients send it. A missing or
wrong key is a 401 with an OpenAI-style body (`code: invalid_api_key`) and
`WWW-Authenticate: Bearer`, given before the body is read, so a caller without a key costs no
parsing and reaches no route. Keys are compared in constant time.

Filesystem paths (the weights, the tokenizer folder, `--model` where it names a file or
folder) are shown only to a caller who may call the admin routes. The rule is `PATH_ROUTES`
and `hide_paths`: where `--admin-api-key` is set, the JSON answer of a route in
`PATH_ROUTES` to a caller without that key has every string that names a path
(`names_a_path`) replaced by null; the rest of the answer is unchanged. A route that shows a
path goes in `PATH_ROUTES`, or in `ADMIN_ROUTES` if all it does is for admins.
"""

from __future__ import annotations

import hmac
import json
import os
from typing import Any

from fastapi.responses import JSONResponse

from lockstep.server.protocol import APIError

OPEN_ROUTES = frozenset({"/health"})
# Routes that act on other users' requests, the weights or the cache (SGLang's admin routes,
# the cache flush, and the RL control of rl_api.py: pauses, weights from a trainer's group).
ADMIN_ROUTES = frozenset(
    {
        "/abort_request",
        "/update_weights_from_disk",
        "/flush_cache",
        "/pause_generation",
        "/continue_generation",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/destroy_weights_update_group",
        "/update_weights_from_tensor",
        "/update_weight_version",
        "/reset_prefix_cache",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/sleep",
        "/wake_up",
        "/is_sleeping",
    }
)
# Routes whose answers name files or folders of the server's disk: the weights
# (`fingerprint.weights_source` and `model_source`, `/model_info`'s `model_path`, `/server_info`'s
# `weights_path`), the tokenizer folder (`tokenizer_path`, `/server_info`'s `model_path`) and
# `--model` (`config.model`, `engine_config.model`).
PATH_ROUTES = frozenset(
    {"/v1/engine", "/model_info", "/get_model_info", "/server_info", "/get_server_info"}
)


class RequireApiKey:
    """Plain ASGI middleware that lets a request through only with the key its route needs
    (the table above), and hides paths from the answers of `PATH_ROUTES` to callers without
    the admin key where one is set. With neither key set it is not installed."""

    def __init__(self, app: Any, api_key: str | None, admin_api_key: str | None) -> None:
        self.app = app
        # With no API key the user routes are open, even where an admin key guards the rest.
        self.user_keys = [k.encode() for k in (api_key, admin_api_key) if k] if api_key else []
        admin = admin_api_key or api_key
        self.admin_keys = [admin.encode()] if admin else []
        # With the API key alone, whoever gets through holds the admin key: nothing to hide.
        self.hides_paths = admin_api_key is not None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_ROUTES:
            return await self.app(scope, receive, send)
        admin = scope["path"] in ADMIN_ROUTES
        needed = self.admin_keys if admin else self.user_keys
        if not needed or _presented(scope, needed):
            if (
                scope["path"] in PATH_ROUTES
                and self.hides_paths
                and not _presented(scope, self.admin_keys)
            ):
                send = _hiding_paths(send)
            return await self.app(scope, receive, send)
        what = (
            "this admin route needs the admin API key" if admin else "this route needs the API key"
        )
        error = APIError(
            f"missing or incorrect API key: {what}, sent as 'Authorization: Bearer <key>'",
            status=401,
            code="invalid_api_key",
        )
        response = JSONResponse(
            error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"}
        )
        await response(scope, receive, send)


def names_a_path(text: str) -> bool:
    """Whether `text` names a file or folder of this machine: an absolute path, one from the
    home folder (`~`) or the working folder (`./`, `../`), or any other text with a separator
    or a `.gguf` ending that exists there. Hub ids (`org/name`) and presets (`random:tiny`)
    are not paths."""
    if text.startswith(("/", "~", "./", "../")) or os.path.isabs(text):
        return True
    looks_like_one = os.sep in text or "/" in text or text.lower().endswith(".gguf")
    try:
        return looks_like_one and os.path.exists(text)
    except (OSError, ValueError):  # too long, or a NUL in it
        return False


def hide_paths(value: Any) -> Any:
    """`value` (decoded JSON) with every string that names a path replaced by None."""
    if isinstance(value, str):
        return None if names_a_path(value) else value
    if isinstance(value, dict):
        return {key: hide_paths(item) for key, item in value.items()}
    if isinstance(value, list):
        return [hide_paths(item) for item in value]
    return value


def _hiding_paths(send: Any) -> Any:
    """`send` for an answer whose JSON body is passed through `hide_paths` (its
    `Content-Length` set to fit); other bodies, and a HEAD's empty one, go as they are."""
    start: dict | None = None
    parts: list[bytes] = []

    async def send_hidden(message: dict) -> None:
        nonlocal start
        if message["type"] == "http.response.start":
            start = message
            return
        if message["type"] != "http.response.body" or start is None:
            return await send(message)
        parts.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = b"".join(parts)
        headers = list(start.get("headers", ()))
        content_type = dict(headers).get(b"content-type", b"")
        if body and content_type.startswith(b"application/json"):
            shown = hide_paths(json.loads(body))
            body = json.dumps(shown, ensure_ascii=False, separators=(",", ":")).encode()
            headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return send_hidden


def _presented(scope: dict, keys: list[bytes]) -> bool:
    """Whether the request's `Authorization: Bearer` header holds one of `keys`."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() != b"bearer":
                return False
            token = token.strip()
            # Every key is compared, so the time taken does not tell which one nearly matched.
            return sum(hmac.compare_digest(token, key) for key in keys) > 0
    return False
