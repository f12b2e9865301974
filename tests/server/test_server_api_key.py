"""`lockstep serve --api-key` and `--admin-api-key` (lockstep/server/auth.py), on a model
served by hub id from an offline Hugging Face cache: one server for the module (a tiny Qwen3
folder, so it starts in seconds), driven with httpx and the official `openai` client."""

from __future__ import annotations

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
]  # fmt: skip
ADMIN_ROUTES = [
    ("POST", "/abort_request", {"abort_all": True}),
    ("GET", "/get_model_info", None),
    ("GET", "/model_info", None),
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
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("hub")
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


async def _echo_app(scope: dict, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _status(api_key: str | None, admin_api_key: str | None, path: str, key: str | None) -> int:
    from lockstep.server.auth import RequireApiKey
    from lockstep.server.metrics import ServerMetrics

    app = RequireApiKey(_echo_app, api_key, admin_api_key, ServerMetrics())
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    transport = httpx.ASGITransport(app=app)

    async def call() -> int:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return (await client.get(path, headers=headers)).status_code

    import asyncio

    return asyncio.run(call())


def test_one_key_guards_the_admin_routes_too_and_an_admin_key_alone_only_them() -> None:
    assert _status("k", None, "/abort_request", None) == 401
    assert _status("k", None, "/abort_request", "k") == 200
    assert _status(None, "a", "/v1/models", None) == 200  # no API key: user routes open
    assert _status(None, "a", "/get_model_info", None) == 401
    assert _status(None, "a", "/get_model_info", "a") == 200


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
