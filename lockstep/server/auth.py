"""API keys (`--api-key`, `--admin-api-key`): who may call which route.

    route                              needs (when the key is set)
    /health                            nothing: supervisors and load balancers probe it
    ADMIN_ROUTES                       the admin key if one is set, else the API key
    every other route                  the API key (the admin key works too)

A key travels as `Authorization: Bearer <key>`, as OpenAI's clients send it. A missing or
wrong key is a 401 with an OpenAI-style body (`code: invalid_api_key`) and
`WWW-Authenticate: Bearer`, given before the body is read, so a caller without a key costs no
parsing and reaches no route. Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi.responses import JSONResponse

from lockstep.server.metrics import ServerMetrics
from lockstep.server.protocol import APIError

OPEN_ROUTES = frozenset({"/health"})
# Routes that act on other users' requests, the weights or the cache, or that show where the
# weights live on the server's disk (SGLang's admin routes, and the cache flush).
ADMIN_ROUTES = frozenset(
    {
        "/abort_request",
        "/update_weights_from_disk",
        "/flush_cache",
        "/get_model_info",
        "/model_info",
        # RL control (rl_api.py): pauses, weights from a trainer's group, the cache.
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


class RequireApiKey:
    """Plain ASGI middleware that lets a request through only with the key its route needs
    (the table above). With neither key set it is not installed."""

    def __init__(
        self, app: Any, api_key: str | None, admin_api_key: str | None, metrics: ServerMetrics
    ) -> None:
        self.app = app
        # With no API key the user routes are open, even where an admin key guards the rest.
        self.user_keys = [k.encode() for k in (api_key, admin_api_key) if k] if api_key else []
        admin = admin_api_key or api_key
        self.admin_keys = [admin.encode()] if admin else []
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_ROUTES:
            return await self.app(scope, receive, send)
        admin = scope["path"] in ADMIN_ROUTES
        needed = self.admin_keys if admin else self.user_keys
        if not needed or _presented(scope, needed):
            return await self.app(scope, receive, send)
        self.metrics.http_errors.labels("401").inc()
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
