"""The request-field policy (docs/server.md, "Request fields") on a real server of the
embedded SmolLM2 (a GGUF file), one class of field at a time:

- accepted: ids, labels and routing hints, and every not-implemented field at its neutral
  value, change no bit of the answer (the control: a different seed does);
- implemented: SGLang's `logit_bias` on /generate, `extra_key` as a prefix-cache namespace,
  SGLang's `regex` / `ebnf` / `json_schema` on the OpenAI routes;
- refused: any other value of a not-implemented field, a misspelt field and a
  prefill/decode-disaggregation field are a 400 naming it.

And the tokenizer folder a router loads for a GGUF model (docs/scale-out.md): /server_info
names it, it gives the server's own token ids, and sglang-router 0.3.2 loads it.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx
import pytest
import test_server
from test_server import ServerProcess

from lockstep.server.native_protocol import (
    UNSUPPORTED_GENERATE,
    UNSUPPORTED_SAMPLING,
    GenerateRequest,
)
from lockstep.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from lockstep.server.unsupported_fields import (
    CHAT_UNSUPPORTED,
    COMPLETION_UNSUPPORTED,
    DISAGGREGATION_FIELDS,
    Neutral,
)

server, http = test_server.server, test_server.http

CANDIDATES: tuple[Any, ...] = (None, False, 0, 1, "auto", "none", "", ["text"], {}, [])
NOT_NEUTRAL = "something else"  # no neutral test takes it (test_server_field_table.py)


def _neutral_value(neutral: Neutral) -> Any:
    return next(value for value in CANDIDATES if neutral(value))


def _neutral_body(table: dict[str, Neutral]) -> dict[str, Any]:
    return {name: _neutral_value(test) for name, test in table.items()}


def _refusal(resp: httpx.Response) -> tuple[int, str | None, str | None, str]:
    error = resp.json()["error"]
    return resp.status_code, error["param"], error["code"], error["message"]


# --- accepted: the same bits ----------------------------------------------------------------

ACCEPTED_GENERATE = {
    "rid": "client-7",
    "conversation_id": "conv-1",
    "session_id": "sess-1",
    "routing_key": "tenant-a",
    "custom_labels": {"team": "rl"},
    "external_trace_header": {"traceparent": "00-1-2-01"},
    "model": "anything",
    "log_metrics": False,
    "no_logs": True,
}
ACCEPTED_OPENAI = {"rid": "client-7", "session_id": "sess-1", "custom_labels": {"team": "rl"}}


def _generate_bits(http: httpx.Client, body: dict[str, Any]) -> tuple[list[int], list[float]]:
    resp = http.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    return answer["output_ids"], [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]


def test_generate_neutral_and_accepted_fields_change_no_bit(http: httpx.Client) -> None:
    sampling = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 5}
    base = {"text": "Once upon a time", "return_logprob": True, "sampling_params": sampling}
    want = _generate_bits(http, base)
    loaded = {
        **base,
        **ACCEPTED_GENERATE,
        **_neutral_body(UNSUPPORTED_GENERATE),
        "sampling_params": {**sampling, **_neutral_body(UNSUPPORTED_SAMPLING)},
    }
    assert _generate_bits(http, loaded) == want
    # Control: the comparison sees a change of seed.
    reseeded = {**loaded, "sampling_params": {**loaded["sampling_params"], "sampling_seed": 6}}
    assert _generate_bits(http, reseeded) != want


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_openai_neutral_and_accepted_fields_change_no_bit(
    http: httpx.Client, server: ServerProcess, route: str
) -> None:
    if route == "completions":
        path, table = "/v1/completions", COMPLETION_UNSUPPORTED
        base = {"prompt": "Once upon a time", "logprobs": 1}
    else:
        path, table = "/v1/chat/completions", CHAT_UNSUPPORTED
        base = {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True}
    base = {**base, "model": server.model, "max_tokens": 8, "temperature": 1.0, "seed": 5}

    def bits(body: dict[str, Any]) -> Any:
        resp = http.post(path, json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["logprobs"]

    want = bits(base)
    assert bits({**base, **ACCEPTED_OPENAI, **_neutral_body(table)}) == want
    assert bits({**base, **ACCEPTED_OPENAI, "seed": 6}) != want  # the control


# --- refused: a 400 naming the field ----------------------------------------------------------


def _unsupported_cases(model: str) -> list[tuple[str, dict[str, Any], str]]:
    """(route, body, the param its refusal must name): every not-implemented field of every
    table at a value other than its neutral one."""
    cases: list[tuple[str, dict[str, Any], str]] = []
    for name in UNSUPPORTED_GENERATE:
        cases.append(("/generate", {"text": "a", name: NOT_NEUTRAL}, name))
    for name in UNSUPPORTED_SAMPLING:
        body = {"text": "a", "sampling_params": {name: NOT_NEUTRAL}}
        cases.append(("/generate", body, f"sampling_params.{name}"))
    completion = {"model": model, "prompt": "a"}
    chat = {"model": model, "messages": [{"role": "user", "content": "a"}]}
    for name in COMPLETION_UNSUPPORTED:
        cases.append(("/v1/completions", {**completion, name: NOT_NEUTRAL}, name))
    for name in CHAT_UNSUPPORTED:
        cases.append(("/v1/chat/completions", {**chat, name: NOT_NEUTRAL}, name))
    return cases


BODIES = {
    "/generate": GenerateRequest,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}


def _check_refusal(path: str, param: str, got: tuple) -> None:
    status, got_param, code, message = got
    assert (status, got_param, code) == (400, param, "unsupported_parameter"), (path, message)
    name = param.rsplit(".", 1)[-1]
    wanted = "disaggregation" if name in DISAGGREGATION_FIELDS else "not supported"
    assert wanted in message, (path, param, message)


def test_every_unsupported_field_is_refused_by_name_at_any_other_value() -> None:
    """Every case through the request models the routes parse bodies with (the refusal is
    raised there, before any engine work; the next test sends some to a real server)."""
    for path, body, param in _unsupported_cases("m"):
        with pytest.raises(APIError) as caught:
            BODIES[path].model_validate(body)
        error = caught.value
        _check_refusal(path, param, (error.status, error.param, error.code, error.message))


def test_refusals_reach_the_client_as_400s_naming_the_field(
    http: httpx.Client, server: ServerProcess
) -> None:
    cases = _unsupported_cases(server.model)
    for path in BODIES:  # the first and last case of each route
        mine = [case for case in cases if case[0] == path]
        for _, body, param in (mine[0], mine[-1]):
            _check_refusal(path, param, _refusal(http.post(path, json=body)))


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/generate", {"text": "a", "bootstrap_room": 12345}, "bootstrap_room"),
        ("/generate", {"text": "a", "bootstrap_host": "10.0.0.1"}, "bootstrap_host"),
        ("/v1/completions", {"prompt": "a", "bootstrap_port": 8998}, "bootstrap_port"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                  "kv_transfer_params": {"do_remote_decode": True}},
         "kv_transfer_params"),
    ],
)  # fmt: skip
def test_disaggregation_is_refused_saying_so(
    http: httpx.Client, server: ServerProcess, path: str, body: dict, param: str
) -> None:
    if path != "/generate":
        body = {**body, "model": server.model}
    status, got, code, message = _refusal(http.post(path, json=body))
    assert (status, got, code) == (400, param, "unsupported_parameter")
    assert "does not support prefill/decode disaggregation" in message


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/generate", {"text": "a", "sampling_params": {"temprature": 0.5}},
         "sampling_params.temprature"),
        ("/generate", {"text": "a", "sampling_seed": 3}, "sampling_seed"),
        ("/v1/completions", {"prompt": "a", "temprature": 0.5}, "temprature"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                  "json_schema": "{}"}, "json_schema"),
    ],
)  # fmt: skip
def test_unknown_fields_are_refused_by_name(
    http: httpx.Client, server: ServerProcess, path: str, body: dict, param: str
) -> None:
    """A misspelt sampling parameter, a sampling field outside `sampling_params`, and
    SGLang's completions-only `json_schema` sent to chat are unknown there."""
    if path != "/generate":
        body = {**body, "model": server.model}
    status, got, code, _ = _refusal(http.post(path, json=body))
    assert (status, got, code) == (400, param, "unknown_parameter")


# --- implemented --------------------------------------------------------------------------


def test_generate_logit_bias(http: httpx.Client) -> None:
    sampling = {"max_new_tokens": 4, "temperature": 0}
    base = {"text": "The capital of France is", "sampling_params": sampling}
    plain = http.post("/generate", json=base).json()["output_ids"]
    token = 42 if plain[0] != 42 else 43
    biased = {**base, "sampling_params": {**sampling, "logit_bias": {str(token): 100.0}}}
    assert http.post("/generate", json=biased).json()["output_ids"] == [token] * 4
    banned = {**base, "sampling_params": {**sampling, "logit_bias": {str(plain[0]): -100.0}}}
    assert http.post("/generate", json=banned).json()["output_ids"][0] != plain[0]
    bad = {**base, "sampling_params": {**sampling, "logit_bias": {"-1": 1.0}}}
    status, param, code, _ = _refusal(http.post("/generate", json=bad))
    assert (status, param, code) == (400, "sampling_params.logit_bias", "invalid_value")


@pytest.mark.parametrize("route", ["completions", "generate"])
def test_extra_key_separates_prefix_cache_entries_and_keeps_the_bits(
    http: httpx.Client, server: ServerProcess, route: str
) -> None:
    prompt = f"{route.title()}: a lighthouse keeper counts the waves every night."

    def ask(**keys: str) -> tuple[int, Any]:
        if route == "completions":
            body = {"model": server.model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                    "logprobs": 0, **keys}  # fmt: skip
            out = http.post("/v1/completions", json=body).json()
            return out["usage"]["prompt_tokens_details"]["cached_tokens"], out["choices"][0][
                "logprobs"
            ]["token_logprobs"]
        body = {"text": prompt, "return_logprob": True, **keys,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0}}  # fmt: skip
        out = http.post("/generate", json=body).json()
        return out["meta_info"]["cached_tokens"], out["meta_info"]["output_token_logprobs"]

    a, b = f"{route}-a", f"{route}-b"  # keys of this case's own
    cached, want = ask(extra_key=a)
    assert cached == 0
    assert ask(extra_key=a)[0] > 0  # the same key: a hit
    assert ask(extra_key=b) == (0, want)  # another key: no hit, the same bits
    assert ask(extra_key=b, cache_salt="s")[0] == 0  # both together: another namespace
    assert ask()[0] == 0  # and no key is a namespace of its own


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [
        ("regex", "[0-9]{3}-[a-z]{2}", r"[0-9]{3}-[a-z]{2}"),
        ("ebnf", 'root ::= "yes" | "no"', r"yes|no"),
        ("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                                    "required": ["n"], "additionalProperties": False}),
         r'\{"n": -?[0-9]+\}'),
    ],
)  # fmt: skip
def test_sglang_constraints_on_the_completions_route(
    http: httpx.Client, server: ServerProcess, field: str, value: str, pattern: str
) -> None:
    body = {"model": server.model, "prompt": "Answer:", "max_tokens": 12, "temperature": 0}
    text = http.post("/v1/completions", json={**body, field: value}).json()["choices"][0]["text"]
    assert re.fullmatch(pattern, text), text
    control = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert not re.fullmatch(pattern, control), control


def test_chat_takes_sglang_regex(http: httpx.Client, server: ServerProcess) -> None:
    body = {"model": server.model, "messages": [{"role": "user", "content": "Pick a number."}],
            "max_tokens": 10, "temperature": 0, "regex": "[0-9]{2}"}  # fmt: skip
    out = http.post("/v1/chat/completions", json=body).json()
    assert re.fullmatch("[0-9]{2}", out["choices"][0]["message"]["content"])


# --- the tokenizer folder of a GGUF model -------------------------------------------------


def test_server_info_names_a_tokenizer_folder_with_the_servers_ids(http: httpx.Client) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    info = http.get("/server_info").json()
    model_info = http.get("/model_info").json()
    folder = info["tokenizer_path"]
    assert info["model_path"] == folder == model_info["tokenizer_path"]
    assert info["weights_path"] == model_info["model_path"]
    assert info["weights_path"].endswith(".gguf")
    hf = tokenizers.Tokenizer.from_file(f"{folder}/tokenizer.json")
    for text in ("Hello world", "  spaces\tand émoji 🤖", "<|im_start|>user\nHi<|im_end|>"):
        served = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
        assert hf.encode(text).ids == served
    config = json.loads(open(f"{folder}/tokenizer_config.json").read())
    assert config["chat_template"] == http.get("/tokenizer_info").json()["chat_template"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Router:
    """A real sglang-router on free ports (its own and its Prometheus exporter's), its log in
    a temporary file (a pipe nobody drains would stall it)."""

    def __init__(self, *args: str) -> None:
        pytest.importorskip("sglang_router", reason="sglang-router is not installed")
        self.url = f"http://127.0.0.1:{_free_port()}"
        self._log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
             "--port", self.url.rsplit(":", 1)[1], "--prometheus-host", "127.0.0.1",
             "--prometheus-port", str(_free_port()), *args],
            stdout=self._log, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    def log(self) -> str:
        self._log.seek(0)
        return re.sub(r"\x1b\[[0-9;]*m", "", self._log.read())

    def wait_for_log(self, *outcomes: str) -> str:
        """The log once one of `outcomes` is in it (a failure after 60 s or an exit)."""
        deadline = time.monotonic() + 60
        while not any(outcome in (text := self.log()) for outcome in outcomes):
            assert self.proc.poll() is None and time.monotonic() < deadline, text[-3000:]
            time.sleep(0.3)
        return text

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        """`body` through the router, once it routes (it answers 503 until its workers are
        registered)."""
        deadline = time.monotonic() + 60
        while True:
            try:
                resp = httpx.post(self.url + path, json=body, timeout=60)
                if resp.status_code != 503 or time.monotonic() > deadline:
                    return resp
            except httpx.TransportError:
                assert self.proc.poll() is None and time.monotonic() < deadline, self.log()
            time.sleep(0.3)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def test_sglang_router_loads_the_tokenizer_of_a_gguf_replica(server: ServerProcess) -> None:
    """sglang-router reads `model_path` from /server_info and loads its tokenizer from it;
    a GGUF path there gives "GGUF format not yet supported" and no tokenizer."""
    router = Router("--policy", "cache_aware", "--worker-urls", server.base_url)
    folder = httpx.get(server.base_url + "/server_info", timeout=30).json()["tokenizer_path"]
    try:
        text = router.wait_for_log(
            "registered tokenizer", "Failed to load tokenizer", "No tokenizer_path"
        )
        body = {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        resp = router.post("/generate", body)
        assert resp.status_code == 200, resp.text
    finally:
        router.stop()
    assert "GGUF" not in text
    assert re.search(rf"Successfully registered tokenizer '{re.escape(server.model)}'", text)
    assert f"Loading tokenizer '{server.model}' from source: {folder}" in text


def test_sglang_router_pd_mode_gets_the_disaggregation_refusal(server: ServerProcess) -> None:
    """sglang-router's PD mode adds the bootstrap fields to every request it sends a prefill
    and a decode worker: through it each route answers Lockstep's 400, which says why."""
    prefill = ServerProcess(["--model", "random:tiny", "--device", "cpu", "--kv-tokens", "512",
                             "--max-model-len", "128"]).start()  # fmt: skip
    router = Router("--pd-disaggregation", "--prefill", prefill.base_url, "--decode",
                    server.base_url, "--policy", "random")  # fmt: skip
    try:
        for path, body in (
            ("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 2}}),
            ("/v1/completions", {"model": server.model, "prompt": "Hello", "max_tokens": 2}),
            ("/v1/chat/completions", {"model": server.model, "max_tokens": 2,
                                      "messages": [{"role": "user", "content": "Hi"}]}),
        ):  # fmt: skip
            resp = router.post(path, body)
            assert resp.status_code == 400, (path, resp.text)
            assert "does not support prefill/decode disaggregation" in resp.text, resp.text
    finally:
        router.stop()
        prefill.stop()
