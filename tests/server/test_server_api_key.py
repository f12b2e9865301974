"""`lockstep serve --api-key` and `--admin-api-key` (lockstep/server/auth.py), on a model
served by hub id from an offline Hugging Face cache: one server for the module (a tiny Qwen3
folder, so it starts in seconds), driven with httpx and the official `openai` client. No
answer to a caller without the admin key names a file or folder of the server (the weights
live in that cache, the tokenizer too); the admin key's holder sees them."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from test_server import ServerProcess  # noqa: E402

from tests.support.tiny_hf import save_tiny, write_hub_cache  # noqa: E402

REPO_ID = "tiny-org/tiny-qwen3"
KEY, ADMIN_KEY = "user-key-1", "admin-key-2"
SERVE_ARGS = ["--model", REPO_ID, "--api-key", KEY, "--admin-api-key", ADMIN_KEY,
              "--device", "cpu", "--kv-tokens", "512", "--max-model-len", "256"]  # fmt: skip
USER_ROUTES = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"model": REPO_ID, "prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions",
     {"model": REPO_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("GET", "/v1/engine", None),
    ("GET", "/metrics", None),
    ("GET", "/server_info", None),
    ("GET", "/model_info", None),
]  # fmt: skip
ADMIN_ROUTES = [
    ("POST", "/abort_request", {"abort_all": True}),
    ("POST", "/flush_cache", None),
    ("POST", "/update_weights_from_disk", {"model_path": "/etc/passwd"}),
    ("POST", "/pause_generation", {"mode": "retract"}),
    ("POST", "/continue_generation", None),
    ("POST", "/reset_prefix_cache", None),
    ("POST", "/release_memory_occupation", {"tags": ["kv_cache"]}),
    ("POST", "/resume_memory_occupation", None),
    ("GET", "/is_sleeping", None),
    ("POST", "/update_weight_version", {"new_version": "default"}),
    # Through the guard, then refused for what they ask (a CPU engine, no group joined).
    ("POST", "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
     "rank_offset": 1, "world_size": 2, "backend": "nccl"}),
    ("POST", "/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"],
     "shapes": [[1]]}),
    ("POST", "/destroy_weights_update_group", None),
    ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": ["AA=="],
     "load_format": "safetensors"}),
]  # fmt: skip
REFUSED_FOR_WHAT_THEY_ASK = {"/update_weights_from_disk", "/init_weights_update_group",
                             "/update_weights_from_distributed", "/destroy_weights_update_group",
                             "/update_weights_from_tensor"}  # fmt: skip


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder holding the model and the offline hub cache it is served from."""
    return tmp_path_factory.mktemp("hub")


@pytest.fixture(scope="module")
def server(hub: Path) -> Iterator[ServerProcess]:
    root = hub
    save_tiny("qwen3", root / "model")
    write_hub_cache(root / "hub", REPO_ID, root / "model", "ab" * 20)
    with pytest.MonkeyPatch.context() as env:  # ServerProcess passes os.environ on
        env.setenv("HF_HUB_CACHE", str(root / "hub"))
        env.setenv("HF_HUB_OFFLINE", "1")
        proc = ServerProcess(SERVE_ARGS).start()
    yield proc
    proc.stop()


def _call(server: ServerProcess, method: str, path: str, body: object, key: str | None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, server.base_url + path, json=body, headers=headers, timeout=60)


def _refused(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert KEY not in error["message"] and ADMIN_KEY not in error["message"]


@pytest.mark.parametrize(("method", "path", "body"), USER_ROUTES)
def test_user_routes_need_the_key(server: ServerProcess, method, path, body) -> None:
    for wrong in (None, "nope", ADMIN_KEY[:-1]):
        _refused(_call(server, method, path, body, wrong))
    assert _call(server, method, path, body, KEY).status_code == 200
    assert _call(server, method, path, body, ADMIN_KEY).status_code == 200


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_ROUTES)
def test_admin_routes_need_the_admin_key(server: ServerProcess, method, path, body) -> None:
    for wrong in (None, "nope", KEY):  # the user key is not enough
        _refused(_call(server, method, path, body, wrong))
    answer = _call(server, method, path, body, ADMIN_KEY)
    if path in REFUSED_FOR_WHAT_THEY_ASK:
        assert answer.status_code == 400, answer.text  # through: not refused for who asks
    else:
        assert answer.status_code == 200, answer.text


def test_health_is_open_and_other_schemes_are_refused(server: ServerProcess) -> None:
    assert httpx.get(server.base_url + "/health").status_code == 200
    basic = {"Authorization": f"Basic {KEY}"}
    _refused(httpx.get(server.base_url + "/v1/models", headers=basic))


def test_the_openai_client_with_the_key_and_the_hub_id(server: ServerProcess) -> None:
    assert server.model == REPO_ID  # served under the hub id
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [REPO_ID]
    reply = client.chat.completions.create(
        model=REPO_ID,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        extra_body={"ignore_eos": True},  # a sampled end of sequence would end it sooner
    )
    assert reply.usage.completion_tokens == 3
    stranger = openai.OpenAI(base_url=server.base_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()


def _strings(value: object) -> Iterator[str]:
    """Every string of decoded JSON, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _paths_in(response: httpx.Response, hub: Path) -> list[str]:
    """What in `response` names a file or folder of the server: the hub folder (where the
    weights and the tokenizer are), or any string that is an absolute path (but in the
    OpenAPI schema, whose strings that start with "/" are the routes)."""
    shown = [str(hub)] if str(hub) in response.text else []
    json_typed = response.headers.get("content-type", "").startswith("application/json")
    if json_typed and response.url.path != "/openapi.json":
        shown += [s for s in _strings(response.json()) if s.startswith(("/", "~"))]
    return shown


def test_no_answer_without_the_admin_key_names_a_path(server: ServerProcess, hub: Path) -> None:
    """Every GET route of the schema (/v1/engine's fingerprint and config, /server_info,
    /model_info and their /get_ names among them) and the generation routes, called with the
    user key: none names a file or folder of the server; those that would have one hold null
    there. The control: the admin key's holder sees the paths."""
    schema = _call(server, "GET", "/openapi.json", None, KEY).json()
    paths = [p for p, ops in schema["paths"].items() if "get" in ops and "{" not in p]
    paths.append(f"/v1/models/{REPO_ID}")
    assert {"/v1/engine", "/server_info", "/get_server_info", "/model_info"} <= set(paths)
    refused = []
    for path in paths:
        response = _call(server, "GET", path, None, KEY)
        if response.status_code == 401:
            refused.append(path)
            continue
        assert response.status_code == 200, (path, response.text[:300])
        assert _paths_in(response, hub) == [], (path, _paths_in(response, hub))
    # The admin routes with a GET: the cache flush and RL control's (docs/rl.md).
    assert sorted(refused) == ["/flush_cache", "/is_sleeping", "/reset_prefix_cache"]
    for method, path, body in USER_ROUTES:
        response = _call(server, method, path, body, KEY)
        assert response.status_code == 200 and _paths_in(response, hub) == [], path
    hidden = {
        "/server_info": ("model_path", "weights_path", "tokenizer_path"),
        "/get_model_info": ("model_path", "tokenizer_path"),
    }
    for path, fields in hidden.items():
        user, admin = (_call(server, "GET", path, None, key).json() for key in (KEY, ADMIN_KEY))
        for name in fields:
            assert user[name] is None and admin[name].startswith(str(hub)), (path, name)
        assert user["served_model_name"] == admin["served_model_name"] == REPO_ID
    user, admin = (_call(server, "GET", "/v1/engine", None, key).json() for key in (KEY, ADMIN_KEY))
    assert user["fingerprint"]["weights_source"] is None
    assert admin["fingerprint"]["weights_source"].startswith(str(hub))
    assert user["stats"]["kv_total"] == admin["stats"]["kv_total"] > 0  # the rest is shown
    assert user["config"]["model"] == REPO_ID  # a hub id is no path


async def _echo_app(scope: dict, receive, send) -> None:
    body = json.dumps({"model_path": "/srv/weights", "model": "org/name", "n": 1}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _answer(
    api_key: str | None, admin_api_key: str | None, path: str, key: str | None
) -> httpx.Response:
    from lockstep.server.auth import RequireApiKey

    app = RequireApiKey(_echo_app, api_key, admin_api_key)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    transport = httpx.ASGITransport(app=app)

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get(path, headers=headers)

    import asyncio

    return asyncio.run(call())


def _status(api_key: str | None, admin_api_key: str | None, path: str, key: str | None) -> int:
    return _answer(api_key, admin_api_key, path, key).status_code


def test_one_key_guards_the_admin_routes_too_and_an_admin_key_alone_only_them() -> None:
    assert _status("k", None, "/abort_request", None) == 401
    assert _status("k", None, "/abort_request", "k") == 200
    assert _status(None, "a", "/v1/models", None) == 200  # no API key: user routes open
    assert _status(None, "a", "/abort_request", None) == 401
    assert _status(None, "a", "/abort_request", "a") == 200


def test_paths_are_hidden_from_whoever_lacks_the_admin_key() -> None:
    """The rule of auth.py on its own: a route of PATH_ROUTES answers a caller without the
    admin key with its paths as null (and a Content-Length that fits); with the admin key, or
    where no admin key is set (the API key is then the admin's), as it is; other routes as
    they are."""
    shown = {"model_path": "/srv/weights", "model": "org/name", "n": 1}
    hidden = {**shown, "model_path": None}
    assert _answer(None, "a", "/server_info", None).json() == hidden  # user routes open
    assert _answer("k", "a", "/server_info", "k").json() == hidden
    assert _answer("k", "a", "/v1/engine", "k").json() == hidden
    assert _answer("k", "a", "/server_info", "a").json() == shown
    assert _answer("k", None, "/server_info", "k").json() == shown
    assert _answer("k", "a", "/v1/models", "k").json() == shown  # shows no path: untouched
    from lockstep.server.auth import names_a_path

    assert names_a_path("/srv/x") and names_a_path("~/m.gguf") and names_a_path("./m")
    assert not names_a_path("org/name") and not names_a_path("random:tiny")


def test_listening_beyond_loopback_without_a_key_warns(tmp_path: Path, caplog, monkeypatch) -> None:
    from lockstep import cli

    missing = str(tmp_path / "missing.gguf")  # the command ends right after the warning
    monkeypatch.delenv("LOCKSTEP_API_KEY", raising=False)
    with caplog.at_level(logging.WARNING, logger="lockstep.server"):
        cli.main(["serve", "--host", "0.0.0.0", "--port", "0", "--model", missing])
        assert "without an API key" in caplog.text
        caplog.clear()
        cli.main(["serve", "--host", "127.0.0.1", "--port", "0", "--model", missing])
        cli.main(
            ["serve", "--host", "0.0.0.0", "--port", "0", "--api-key", "k", "--model", missing]
        )
        assert "without an API key" not in caplog.text
