"""Penalties, logit_bias, min_tokens, bad_words and structured outputs on a real server (the
embedded SmolLM2) through the official `openai` client, `extra_body` for vLLM's fields, and
SGLang's /generate: each field works, or is refused with a 400 naming it. The official
client's `chat.completions.parse` with pydantic models gives replies that parse and validate,
greedy and sampled."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import openai
import pytest
import test_server
from pydantic import BaseModel, Field
from test_server import ServerProcess

server, http = test_server.server, test_server.http


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population: int = Field(ge=0, le=100_000_000)


class Review(BaseModel):
    verdict: Literal["good", "bad", "mixed"]
    score: int = Field(ge=1, le=5)
    tags: list[Literal["price", "quality", "service"]] = Field(max_length=3)


ASK = {
    City: "Name a large city, its country and its population, as JSON.",
    Review: "Review a restaurant you liked, as JSON.",
}


@pytest.mark.parametrize("model", [City, Review])
def test_parse_with_pydantic_models_greedy_and_sampled(
    server: ServerProcess, client: openai.OpenAI, model: type[BaseModel]
) -> None:
    messages = [{"role": "user", "content": ASK[model]}]
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 7, "n": 2}):
        reply = client.chat.completions.parse(
            model=server.model, messages=messages, response_format=model, max_tokens=120,
            **sampling,
        )  # fmt: skip
        for choice in reply.choices:
            assert choice.finish_reason == "stop"
            assert isinstance(choice.message.parsed, model)
            assert model.model_validate_json(choice.message.content) == choice.message.parsed
    # Control: the same question unconstrained is not such JSON.
    plain = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=40, temperature=0.0
    )
    with pytest.raises(ValueError):
        model.model_validate_json(plain.choices[0].message.content or "")


def test_json_schema_on_completions_and_streamed(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    schema = {**City.model_json_schema(), "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    out = client.completions.create(
        model=server.model, prompt="The biggest city in Japan, as JSON:", max_tokens=80,
        temperature=0.0, extra_body={"response_format": fmt},
    )  # fmt: skip
    assert City.model_validate_json(out.choices[0].text)
    stream = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": ASK[City]}], max_tokens=80,
        temperature=0.0, stream=True, response_format=fmt,
    )  # fmt: skip
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert City.model_validate_json(text)
    obj = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "A JSON object, please."}],
        max_tokens=60, temperature=0.0, response_format={"type": "json_object"},
    ).choices[0]  # fmt: skip
    assert obj.message.content.startswith("{")
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.message.content), dict)


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_regex": r"[0-9]{4}-[0-9]{2}"}, lambda t: re.fullmatch(r"[0-9]{4}-[0-9]{2}", t)),
        ({"guided_choice": ["Paris", "Rome"]}, lambda t: t in ("Paris", "Rome")),
        ({"guided_grammar": 'root ::= "It is " ("hot" | "cold") "."'},
         lambda t: t in ("It is hot.", "It is cold.")),
        ({"guided_grammar": 'start: "n=" /[0-9]{1,3}/'}, lambda t: re.fullmatch(r"n=\d{1,3}", t)),
        ({"guided_json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
         lambda t: all(isinstance(b, bool) for b in json.loads(t))),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"regex": "[A-Z][a-z]{2,8}"}},
         lambda t: re.fullmatch("[A-Z][a-z]{2,8}", t)),
    ],
)  # fmt: skip
def test_vllm_guided_fields(server: ServerProcess, client: openai.OpenAI, extra, check) -> None:
    chat = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Answer briefly."}],
        max_tokens=40, temperature=1.0, seed=3, extra_body=extra,
    ).choices[0]  # fmt: skip
    assert chat.finish_reason == "stop" and check(chat.message.content), chat.message.content
    comp = client.completions.create(
        model=server.model, prompt="Answer:", max_tokens=40, temperature=0.0, extra_body=extra
    ).choices[0]
    assert comp.finish_reason == "stop" and check(comp.text), comp.text


def _tokens(client: openai.OpenAI, server: ServerProcess, **kw) -> list[int]:
    body = {"return_token_ids": True, **kw.pop("extra_body", {})}
    out = client.completions.create(
        model=server.model, prompt="Once upon a time", max_tokens=kw.pop("max_tokens", 10),
        temperature=0.0, extra_body=body, **kw,
    )  # fmt: skip
    return out.choices[0].token_ids  # type: ignore[attr-defined]


def test_penalties_bias_min_tokens_and_bad_words(
    server: ServerProcess, client: openai.OpenAI, http: httpx.Client
) -> None:
    tok = http.post("/tokenize", json={"prompt": " the", "add_special_tokens": False}).json()
    the = tok["tokens"][-1]
    plain = _tokens(client, server, extra_body={"ignore_eos": True})
    assert _tokens(client, server, logit_bias={str(the): 100}) == [the] * 10
    assert plain != [the] * 10  # control: the bias chose them
    banned = _tokens(client, server, logit_bias={str(the): 100}, extra_body={"bad_words": ["the"]})
    assert the not in banned
    eos = 0  # <|endoftext|>, the model's EOS for completions
    assert _tokens(client, server, logit_bias={str(eos): 100}) == [eos]
    held = _tokens(client, server, logit_bias={str(eos): 100}, extra_body={"min_tokens": 4})
    assert len(held) == 5 and eos not in held[:4]
    for kw in (
        {"presence_penalty": 2.0},
        {"frequency_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 1.8, "ignore_eos": True}},
    ):
        kw.setdefault("extra_body", {"ignore_eos": True})
        penalized = _tokens(client, server, max_tokens=24, **kw)
        assert penalized != _tokens(client, server, max_tokens=24, extra_body={"ignore_eos": True})


def _refused(http: httpx.Client, path: str, body: dict, param: str) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 400, (body, response.text)
    assert response.json()["error"]["param"] == param, response.text


def test_bad_values_are_refused_with_their_field(server: ServerProcess, http: httpx.Client) -> None:
    chat = {"model": server.model, "messages": [{"role": "user", "content": "hi"}]}
    comp = {"model": server.model, "prompt": "hi"}
    cases = [
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_grammar": "start: nothing_defined"}, "guided_grammar"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
          "schema": {"type": 5}}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ]  # fmt: skip
    for extra, param in cases:
        _refused(http, "/v1/chat/completions", {**chat, **extra}, param)
        _refused(http, "/v1/completions", {**comp, **extra}, param)


def test_sglang_generate_penalties_and_constraints(
    server: ServerProcess, http: httpx.Client
) -> None:
    def generate(params: dict) -> dict:
        body = {"text": "The answer is", "sampling_params": {"max_new_tokens": 40, **params}}
        response = http.post("/generate", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    assert re.fullmatch(r"[0-9]{2,5}", generate({"regex": "[0-9]{2,5}"})["text"])
    schema = json.dumps({**Review.model_json_schema(), "additionalProperties": False})
    assert Review.model_validate_json(generate({"json_schema": schema, "temperature": 0})["text"])
    assert generate({"ebnf": 'root ::= "yes" | "no"'})["text"] in ("yes", "no")
    plain = generate({"temperature": 0, "ignore_eos": True})["output_ids"]
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                  {"repetition_penalty": 2.0}):  # fmt: skip
        assert generate({"temperature": 0, "ignore_eos": True, **extra})["output_ids"] != plain
    # min_new_tokens masks stop_token_ids: greedy's 3rd token as a stop id ends the output
    # there (the control), but not before the 10th token with min_new_tokens=10.
    stop = {"temperature": 0, "stop_token_ids": [plain[2]], "ignore_eos": True}
    assert len(generate(stop)["output_ids"]) == plain.index(plain[2]) + 1
    held = generate({**stop, "min_new_tokens": 10})["output_ids"]
    assert len(held) >= 10 and plain[2] not in held[:9]
    for params, param in (
        ({"regex": "("}, "sampling_params.regex"),
        ({"json_schema": "{bad"}, "sampling_params.json_schema"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "sampling_params.ebnf"),
        ({"min_new_tokens": 50, "max_new_tokens": 10}, "sampling_params"),
    ):
        _refused(http, "/generate", {"text": "x", "sampling_params": params}, param)
    # Out of range: pydantic names the field within the object-or-list union.
    response = http.post(
        "/generate", json={"text": "x", "sampling_params": {"presence_penalty": 9}}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"].endswith(".presence_penalty"), response.text
