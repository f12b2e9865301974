"""vLLM's tokenizer routes and `/version`, as `vllm bench serve`-style clients probe them:
`/tokenize` gives the very ids the completion and chat routes compute, `/detokenize` turns ids
back into the text, and bad input gets the usual 4xx."""

from __future__ import annotations

import json

import httpx
import pytest
import test_server
from test_server import ServerProcess

import lockstep

TIMEOUT_S = 120  # a hang guard only
# test_server.py's fixtures: a server of this module's own, and a kept-alive client.
server, http = test_server.server, test_server.http


def test_version(http: httpx.Client) -> None:
    response = http.get("/version")
    assert response.status_code == 200 and response.json() == {"version": lockstep.__version__}


def test_tokenize_gives_the_ids_the_generation_routes_use(
    server: ServerProcess, http: httpx.Client
) -> None:
    prompt = "The capital of France is"
    completion = http.post("/v1/completions", json={
        "model": server.model, "prompt": prompt, "max_tokens": 1, "return_token_ids": True,
    }).json()  # fmt: skip
    tokenized = http.post("/tokenize", json={"model": server.model, "prompt": prompt}).json()
    assert tokenized["tokens"] == completion["choices"][0]["prompt_token_ids"]
    assert tokenized["count"] == len(tokenized["tokens"]) == completion["usage"]["prompt_tokens"]
    assert tokenized["max_model_len"] == 512 and tokenized["token_strs"] is None

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = http.post("/v1/chat/completions", json={
        "model": server.model, "messages": messages, "max_tokens": 1,
    }).json()  # fmt: skip
    chat_ids = http.post("/tokenize", json={"messages": messages}).json()
    assert chat_ids["count"] == chat["usage"]["prompt_tokens"]
    # Without the generation prompt the rendering is shorter (the control: the flag is used).
    bare = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert bare.json()["count"] < chat_ids["count"]


def test_tokenizer_info_names_the_special_tokens_tokenize_knows(
    server: ServerProcess, http: httpx.Client
) -> None:
    """lm-evaluation-harness's remote tokenizer reads `eos_token` here and encodes it through
    `/tokenize` to learn the EOS id (tests/server/test_lm_eval.py runs it)."""
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == 512
    assert "<|im_start|>" in info["chat_template"]
    eos = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos.json()["tokens"] == [2]  # SmolLM2's <|im_end|>


def test_detokenize_inverts_tokenize(http: httpx.Client) -> None:
    text = "Lockstep keeps every bit, même en français."
    tokenized = http.post("/tokenize", json={
        "prompt": text, "add_special_tokens": False, "return_token_strs": True,
    }).json()  # fmt: skip
    assert len(tokenized["token_strs"]) == tokenized["count"] > 1
    back = http.post("/detokenize", json={"tokens": tokenized["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": "nope", "prompt": "hi"}, 404, "model"),
        ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400,
         "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "hi \ud800"}, 400, "prompt"),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "12"}, 400, "tokens"),
    ],
)  # fmt: skip
def test_bad_tokenizer_requests(
    http: httpx.Client, path: str, body: dict, status: int, param: str
) -> None:
    # json.dumps writes a lone surrogate as its escape, which httpx's own encoder refuses.
    response = http.post(
        path, content=json.dumps(body), headers={"content-type": "application/json"}
    )
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
    assert http.get("/health").status_code == 200
