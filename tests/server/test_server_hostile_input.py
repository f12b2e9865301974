"""The server under hostile input: text that is not valid Unicode, absurd integers, methods a
route does not take. Every such request gets a 4xx in OpenAI's error shape with the `code` that
docs/server.md's error table documents, the kept-alive connection keeps working, and nothing
reaches the engine.

One real `lockstep serve` process (test_server.py's arguments) is started for the module and
driven over raw HTTP. A lone UTF-16 surrogate arrives as a JSON escape (`\\ud800`, which
`json.dumps` writes for it) or as its three UTF-8-style bytes, which Python's json reads as one.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx
import test_server
from fastapi.responses import JSONResponse
from test_server import REPO, ServerProcess, _bad_cases

from lockstep.server.protocol import APIError

TIMEOUT_S = 120  # a hang guard only
# test_server.py's fixtures: a server of this module's own, and a kept-alive client.
server, http = test_server.server, test_server.http


def _post(http: httpx.Client, path: str, body: object) -> httpx.Response:
    """`body` as JSON bytes; a str or bytes body is sent as is."""
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return http.post(path, content=content, headers={"content-type": "application/json"})


def _documented_codes() -> set[str]:
    """The `code` column of docs/server.md's error table."""
    text = (REPO / "docs" / "server.md").read_text()
    table = text.split("| case | status | `code` |", 1)[1].split("\n\n", 1)[0]
    rows = table.strip().splitlines()[1:]  # after the |---| line
    return {code for row in rows for code in re.findall(r"`([a-z_]+)`", row.split("|")[3])}


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# -- text that is not valid Unicode --------------------------------------------------------


def _invalid_text_cases(model: str) -> list[tuple[str, dict | bytes, str]]:
    """(path, body, the field the 400 must name); each body holds one lone surrogate."""
    comp = {"model": model, "prompt": "hi", "max_tokens": 2}
    chat = {"model": model, "messages": _user("hi"), "max_tokens": 2}
    part = [{"type": "text", "text": "fine"}, {"type": "text", "text": "\udc00 low"}]
    return [
        ("/v1/completions", {**comp, "prompt": "hi \ud800"}, "prompt"),
        ("/v1/completions", {**comp, "prompt": ["fine", "hi \udfff"]}, "prompt.1"),
        # Python's json reads a surrogate written as UTF-8 bytes (ED A0 80) as one, too.
        ("/v1/completions", b'{"model": "m", "prompt": "\xed\xa0\x80"}', "prompt"),
        ("/v1/completions", {**comp, "stop": "\ud800"}, "stop"),
        ("/v1/completions", {**comp, "stop": ["ok", "x\ud800"]}, "stop.1"),
        ("/v1/completions", {"model": "\ud800", "prompt": "hi"}, "model"),
        ("/v1/completions", {**comp, "user": "\ud800"}, "user"),
        ("/v1/completions", {**comp, "x\ud800": 1}, "x\\ud800"),
        ("/v1/chat/completions", {**chat, "messages": _user("hi \ud800")}, "messages.0.content"),
        (
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "user", "content": part}]},
            "messages.0.content.1.text",
        ),
        (
            "/v1/chat/completions",
            {**chat, "messages": [*_user("fine"), {"role": "assistant", "content": "\ud800"}]},
            "messages.1.content",
        ),
        ("/v1/score", {"model": model, "prompt": "hi \ud800"}, "prompt"),
        ("/v1/score", {"model": model, "messages": _user("\ud800")}, "messages.0.content"),
    ]


def _refused_400(http: httpx.Client, path: str, body: dict, param: str) -> dict:
    """POST `body`; it must be a 400 invalid_value naming `param`. Returns the error."""
    response = _post(http, path, body)
    assert response.status_code == 400, (path, body, response.text)
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error", (body, error)
    assert error["param"] == param, (body, error)
    assert error["code"] == "invalid_value", (body, error)
    return error


def test_invalid_unicode_is_a_400_naming_the_field(
    server: ServerProcess, http: httpx.Client
) -> None:
    before = server.engine_stats()
    for path, body, param in _invalid_text_cases(server.model):
        error = _refused_400(http, path, body, param)
        assert "Unicode" in error["message"], (body, error)
        # The connection the error came on still serves the next request.
        assert http.get("/v1/models").status_code == 200, body
    assert server.engine_stats()["prompt_tokens_total"] == before["prompt_tokens_total"]
    # A surrogate pair is one valid character, not invalid text.
    pair = _post(
        http, "/v1/completions", {"model": server.model, "prompt": "hi \U0001f600", "max_tokens": 1}
    )
    assert pair.status_code == 200, pair.text


def test_error_bodies_with_unencodable_text_still_encode() -> None:
    error = APIError("The model `\ud800` does not exist", param="x\ud800")
    body = json.loads(JSONResponse(error.body(), status_code=404).body)
    assert body["error"]["message"] == "The model `\\ud800` does not exist"
    assert body["error"]["param"] == "x\\ud800"


# -- methods: 405 with Allow, HEAD wherever GET -------------------------------------------


def _allowed(response: httpx.Response) -> set[str]:
    return {m.strip() for m in response.headers.get("allow", "").split(",") if m.strip()}


def test_405_names_the_allowed_methods_and_head_answers(
    server: ServerProcess, http: httpx.Client
) -> None:
    for method, path, allowed in [
        ("GET", "/v1/completions", {"POST"}),
        ("HEAD", "/v1/chat/completions", {"POST"}),
        ("POST", "/health", {"GET", "HEAD"}),
        ("DELETE", "/v1/models", {"GET", "HEAD"}),
    ]:
        response = http.request(method, path)
        assert response.status_code == 405, (method, path, response.text)
        assert _allowed(response) == allowed, (method, path, response.headers)
        if method != "HEAD":
            assert response.json()["error"]["code"] == "method_not_allowed"
    for path in ("/health", "/v1/models", f"/v1/models/{server.model}", "/metrics", "/v1/engine"):
        response = http.head(path)
        assert response.status_code == 200, (path, response.status_code)
        assert response.content == b"", path
        assert int(response.headers["content-length"]) > 0, path  # what GET would send
    assert http.head("/no/such/route").status_code == 404
    assert http.get("/health").json() == {"status": "ok"}


# -- integers ------------------------------------------------------------------------------


def _absurd_integer_cases(model: str) -> list[tuple[str, dict, str]]:
    """(path, body, the field the 400 must name)."""
    comp = {"model": model, "prompt": "hi", "max_tokens": 2}
    chat = {"model": model, "messages": _user("hi"), "max_tokens": 2}
    huge = 2**70
    return [
        ("/v1/completions", {**comp, "top_k": huge}, "top_k"),
        ("/v1/completions", {**comp, "top_k": 2**63}, "top_k"),
        ("/v1/chat/completions", {**chat, "top_k": huge}, "top_k"),
        ("/v1/completions", {**comp, "stop_token_ids": [huge]}, "stop_token_ids.0"),
        ("/v1/completions", {**comp, "stop_token_ids": [2, 10**9]}, "stop_token_ids"),
        ("/v1/chat/completions", {**chat, "stop_token_ids": [huge]}, "stop_token_ids.0"),
        ("/v1/completions", {**comp, "max_tokens": huge}, "max_tokens"),
        ("/v1/chat/completions", {**chat, "max_tokens": huge}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"model": model, "messages": _user("hi"), "max_completion_tokens": huge},
            "max_completion_tokens",
        ),
        ("/v1/completions", {**comp, "seed": huge}, "seed"),
        ("/v1/completions", {**comp, "n": huge}, "n"),
        ("/v1/completions", {**comp, "logprobs": huge}, "logprobs"),
        ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": huge}, "top_logprobs"),
        ("/v1/completions", {**comp, "prompt": [1, huge]}, "prompt"),
        ("/v1/score", {"model": model, "prompt": "hi", "top_logprobs": huge}, "top_logprobs"),
        ("/v1/score", {"model": model, "prompt": [huge]}, "prompt"),
    ]


def test_absurd_integers_are_a_400_naming_the_field(
    server: ServerProcess, http: httpx.Client
) -> None:
    before = server.engine_stats()
    for path, body, param in _absurd_integer_cases(server.model):
        _refused_400(http, path, body, param)
    assert server.engine_stats()["prompt_tokens_total"] == before["prompt_tokens_total"]
    # The largest accepted values still serve (top_k beyond the vocabulary disables it).
    edge = {
        "model": server.model,
        "prompt": "hi",
        "max_tokens": 1,
        "top_k": 2**63 - 1,
        "seed": 2**63 - 1,
        "stop_token_ids": [0],
    }
    response = _post(http, "/v1/completions", edge)
    assert response.status_code == 200, response.text


# -- every 4xx has its documented code -----------------------------------------------------


def _coded_cases(model: str) -> list[tuple[str, object, int, str]]:
    """(path, body, status, code) for refusals beyond test_server.py's bad cases."""
    comp = {"model": model, "prompt": "hi", "max_tokens": 2}
    chat = {"model": model, "messages": _user("hi"), "max_tokens": 2}
    return [
        ("/v1/completions", b'{"model": "m", "prompt": "\xff"}', 400, "invalid_json"),
        ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json"),
        ("/v1/completions", b'{"max_tokens": ' + b"9" * 5000 + b"}", 400, "invalid_json"),
        ("/v1/completions", "{not json", 400, "invalid_json"),
        ("/v1/completions", {**comp, "prompt": ""}, 400, "invalid_value"),
        ("/v1/completions", {**comp, "temperature": 1e-6}, 400, "invalid_value"),
        (
            "/v1/completions",
            {**comp, "stream_options": {"include_usage": True}},
            400,
            "invalid_value",
        ),
        ("/v1/completions", {**comp, "prompt": ["a"] * 17, "n": 16}, 400, "invalid_value"),
        ("/v1/completions", {**comp, "seed": 2**63 - 1, "n": 2}, 400, "invalid_value"),
        ("/v1/chat/completions", {**chat, "top_logprobs": 2}, 400, "invalid_value"),
        ("/v1/chat/completions", {**chat, "max_completion_tokens": 3}, 400, "invalid_value"),
        ("/v1/score", {"model": model}, 400, "missing"),
        (
            "/v1/score",
            {"model": model, "prompt": "hi", "messages": _user("hi")},
            400,
            "invalid_value",
        ),
        ("/v1/completions", {**comp, "model": "gpt-4"}, 404, "model_not_found"),
    ]


def test_every_refusal_has_its_documented_code(server: ServerProcess, http: httpx.Client) -> None:
    documented = _documented_codes()
    assert {"invalid_json", "invalid_value", "missing", "model_not_found"} <= documented
    before = server.engine_stats()
    cases: list[tuple[str, object, int, str | None]]
    cases = [(p, b, s, None) for p, b, s, _ in _bad_cases(server.model)]
    cases += _coded_cases(server.model)
    for path, body, status, code in cases:
        response = _post(http, path, body)
        assert response.status_code == status, (path, body, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error", (body, error)
        assert error["code"] in documented, (body, error)
        if code is not None:
            assert error["code"] == code, (body, error)
    assert server.engine_stats()["prompt_tokens_total"] == before["prompt_tokens_total"]


def test_error_messages_clip_what_they_quote(server: ServerProcess, http: httpx.Client) -> None:
    """A megabyte field name, value or model name is refused with a short body that still
    says what was wrong; the control, the same mistake at a normal size, quotes it whole."""
    huge = "x" * (1 << 20)
    comp = {"model": server.model, "prompt": "hi", "max_tokens": 2}
    cases = [
        ({**comp, huge: 1}, "unknown_parameter", "Unrecognized request argument"),
        ({**comp, "logit_bias": {huge: 1}}, "invalid_value", "logit_bias: key"),
        ({**comp, "model": huge}, "model_not_found", "does not exist"),
    ]
    for body, code, words in cases:
        response = _post(http, "/v1/completions", body)
        assert response.status_code in (400, 404), response.text[:300]
        assert len(response.content) < 4096, len(response.content)
        error = response.json()["error"]
        assert error["code"] == code and words in error["message"], error
        assert "more characters" in error["message"]
    control = _post(http, "/v1/completions", {**comp, "no_such_field": 1}).json()["error"]
    assert control["message"] == "Unrecognized request argument supplied: no_such_field"


def test_text_too_long_for_the_context_is_refused_before_tokenizing(
    server: ServerProcess, http: httpx.Client
) -> None:
    """Text longer than any that fits the context is a 400 at once, without tokenizing it,
    on every route that takes text; nothing reaches the engine."""
    before = server.engine_stats()["prompt_tokens_total"]
    big = "word " * (5 << 20)  # 25 MB
    comp = {"model": server.model, "max_tokens": 2}
    bodies = [
        ("/v1/completions", {**comp, "prompt": big}, "prompt"),
        ("/v1/chat/completions", {**comp, "messages": _user(big)}, "messages"),
        ("/v1/score", {"model": server.model, "prompt": big}, "prompt"),
        ("/generate", {"text": big}, "text"),
    ]
    for path, body, param in bodies:
        started = time.monotonic()
        response = _post(http, path, body)
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == param, error
        assert error["code"] == "context_length_exceeded" and "characters" in error["message"]
        assert time.monotonic() - started < 5.0  # parsing 25 MB of JSON, not tokenizing it
    assert server.engine_stats()["prompt_tokens_total"] == before


def test_a_chunked_body_over_the_limit_is_a_413(server: ServerProcess, http: httpx.Client) -> None:
    """A body without a declared length is counted as it arrives: past 32 MiB it is a 413,
    as a declared one is, not a 400 about unparseable JSON."""

    def chunks(total_mb: int):  # noqa: ANN202
        for _ in range(total_mb):
            yield b" " * (1 << 20)

    headers = {"content-type": "application/json"}
    response = http.post("/v1/completions", content=chunks(40), headers=headers)
    assert "content-length" not in response.request.headers  # it went chunked
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "request_too_large"
    # Control: a chunked body under the limit is read and answered on its merits.
    body = json.dumps({"model": server.model, "prompt": "hi", "max_tokens": 1}).encode()
    small = http.post("/v1/completions", content=iter([body]), headers=headers)
    assert small.status_code == 200, small.text


def test_a_body_refused_while_it_arrives_ends_its_connection(server: ServerProcess) -> None:
    """A client that goes on sending after its body passed the limit (a chunked body without
    end; 10 GiB declared) gets the 413 at once, with `Connection: close` (and no "100
    Continue" before it where it waits for one), and the connection ends within seconds: the
    server neither reads the rest until `--request-read-timeout` (60 s) nor resets the
    connection before the client could read the answer."""
    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    piece = b" " * (1 << 20)
    cases = [
        (b"Transfer-Encoding: chunked", b"%x\r\n" % len(piece) + piece + b"\r\n"),
        (b"Content-Length: %d" % (10 << 30), piece),
        # A client that waits for "100 Continue" gets the 413 instead and sends nothing.
        (b"Content-Length: %d\r\nExpect: 100-continue" % (10 << 30), b""),
    ]
    for framing, data in cases:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n%s\r\n\r\n" % framing
        with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
            sock.sendall(head)

            def send_for_ever(sock: socket.socket = sock, data: bytes = data) -> None:
                try:
                    while True:
                        sock.sendall(data)
                except OSError:
                    pass  # the server closed the connection, or the test did

            sender = threading.Thread(target=send_for_ever, daemon=True)
            if data:
                sender.start()
            sock.settimeout(30)  # the hang guard: before the fix this waited out 60 s
            response, answered = b"", 0.0
            try:
                while chunk := sock.recv(65536):
                    answered = answered or time.monotonic()
                    response += chunk
            except TimeoutError:
                raise AssertionError(f"still open 30 s on: {response[:300]!r}") from None
            ended = time.monotonic()
            sock.shutdown(socket.SHUT_RDWR)
            if data:
                sender.join(TIMEOUT_S)
        head_part, _, body = response.partition(b"\r\n\r\n")
        assert head_part.startswith(b"HTTP/1.1 413"), response[:300]
        assert b"connection: close" in head_part.lower(), head_part
        assert json.loads(body)["error"]["code"] == "request_too_large"
        assert ended - answered < 5.0, f"closed {ended - answered:.1f} s after the answer"
    assert httpx.get(server.base_url + "/health", timeout=TIMEOUT_S).status_code == 200


def test_server_healthy_and_kv_pool_free_after_hostile_input(server: ServerProcess) -> None:
    """Last: everything above left the server serving and no KV slot in use."""
    assert httpx.get(server.base_url + "/health", timeout=TIMEOUT_S).status_code == 200
    stats = server.wait_idle()
    assert stats["kv_free"] + stats["kv_cached"] == stats["kv_total"]
