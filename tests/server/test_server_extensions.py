"""vLLM's request extensions on a real server (the embedded SmolLM2, whose ChatML template
reads no tool calls, names or options): prompt truncation, the generation prompt and
`continue_final_message` checked against `/tokenize` and transformers' rendering, vLLM's chat
`echo`, usage in every chunk, and what this template cannot show refused with its field."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
import test_server
from test_server import MAX_MODEL_LEN, ServerProcess

from lockstep.models.resolver import resolve_model

# test_server.py's fixtures: a server of this module's own, and a kept-alive client.
server, http = test_server.server, test_server.http

PARTIAL = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is"},
]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _post(http: httpx.Client, path: str, body: dict) -> dict:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _prompt_ids(http: httpx.Client, path: str, body: dict) -> list[int]:
    reply = _post(http, path, {**body, "max_tokens": 1, "return_token_ids": True})
    return reply["choices"][0]["prompt_token_ids"]


def test_truncate_prompt_tokens_keeps_the_last_tokens(
    server: ServerProcess, http: httpx.Client
) -> None:
    text = "One two three four five six seven eight nine ten."
    full = _post(http, "/tokenize", {"prompt": text})["tokens"]
    comp = {"model": server.model, "prompt": text}
    assert _prompt_ids(http, "/v1/completions", {**comp, "truncate_prompt_tokens": 5}) == full[-5:]
    longer = len(full) + 3
    assert _prompt_ids(http, "/v1/completions", {**comp, "truncate_prompt_tokens": longer}) == full

    messages = [{"role": "user", "content": text}]
    chat_full = _post(http, "/tokenize", {"messages": messages})["tokens"]
    chat = {"model": server.model, "messages": messages, "truncate_prompt_tokens": 7}
    assert _prompt_ids(http, "/v1/chat/completions", chat) == chat_full[-7:]

    # -1: as many as leave room for max_tokens; a text too long for the context is then fine.
    long_text = "word " * (MAX_MODEL_LEN + 50)
    long_ids = _post(http, "/tokenize", {"prompt": long_text})["tokens"]
    reply = _post(http, "/v1/completions", {
        "model": server.model, "prompt": long_text, "max_tokens": 4,
        "truncate_prompt_tokens": -1, "return_token_ids": True,
    })  # fmt: skip
    assert reply["choices"][0]["prompt_token_ids"] == long_ids[-(MAX_MODEL_LEN - 4) :]

    for bad in (0, -2, MAX_MODEL_LEN):
        response = http.post("/v1/completions", json={**comp, "truncate_prompt_tokens": bad})
        assert response.status_code == 400, (bad, response.text)
        assert response.json()["error"]["param"] == "truncate_prompt_tokens"


def test_generation_prompt_and_continue_final_message(
    server: ServerProcess, http: httpx.Client, client: openai.OpenAI
) -> None:
    chat = {"model": server.model, "messages": PARTIAL}
    with_prompt = _prompt_ids(http, "/v1/chat/completions", chat)
    assert with_prompt == _post(http, "/tokenize", {"messages": PARTIAL})["tokens"]
    bare = _prompt_ids(http, "/v1/chat/completions", {**chat, "add_generation_prompt": False})
    assert (
        bare
        == _post(http, "/tokenize", {"messages": PARTIAL, "add_generation_prompt": False})["tokens"]
    )

    continued = _prompt_ids(http, "/v1/chat/completions", {**chat, "continue_final_message": True})
    transformers = pytest.importorskip("transformers")
    tokenizer = resolve_model(None).tokenizer
    reference = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    reference.chat_template = tokenizer.chat_template
    text = reference.apply_chat_template(
        PARTIAL, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert text.endswith("<|im_start|>assistant\nThe capital of France is")
    assert continued == tokenizer.encode(text, add_special_tokens=False)
    assert continued == bare[: len(continued)] and len(continued) < len(bare)  # no end of turn

    both = http.post("/v1/chat/completions", json={
        **chat, "continue_final_message": True, "add_generation_prompt": True,
    })  # fmt: skip
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"

    # vLLM's chat echo: the reply starts with the message it continues.
    args = dict(model=server.model, messages=PARTIAL, max_tokens=6, temperature=0)
    ext = {"continue_final_message": True}
    plain = client.chat.completions.create(**args, extra_body=ext).choices[0].message
    echoed = client.chat.completions.create(**args, extra_body={**ext, "echo": True})
    message = echoed.choices[0].message
    assert message.role == "assistant"
    assert message.content == PARTIAL[-1]["content"] + plain.content
    stream = client.chat.completions.create(**args, stream=True, extra_body={**ext, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream) == message.content
    # vLLM echoes the final message whenever its role is the reply's: after a generation
    # prompt the reply is the assistant's, so a final user message is not echoed.
    question = dict(args, messages=PARTIAL[:1])
    answer = client.chat.completions.create(**question).choices[0].message.content
    unechoed = client.chat.completions.create(**question, extra_body={"echo": True})
    assert unechoed.choices[0].message.content == answer


def _events(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats(server: ServerProcess, http: httpx.Client, path: str) -> None:
    body: dict[str, Any] = {
        "model": server.model, "max_tokens": 6, "n": 2, "seed": 1, "ignore_eos": True,
        "stream": True, "stream_options": {"continuous_usage_stats": True},
        "return_token_ids": True,
    }  # fmt: skip
    if path == "/v1/completions":
        body["prompt"] = "Once upon a time"
    else:
        body["messages"] = [{"role": "user", "content": "Tell me a story."}]
    events = _events(http, path, body)
    tokens_so_far = {0: 0, 1: 0}
    prompt_tokens = None
    for event in events[:-1]:
        (choice,) = event["choices"]
        tokens_so_far[choice["index"]] += len(choice.get("token_ids") or [])
        use = event["usage"]
        prompt_tokens = prompt_tokens or use["prompt_tokens"]
        assert use["completion_tokens"] == tokens_so_far[choice["index"]], event
        assert use["total_tokens"] == use["prompt_tokens"] + use["completion_tokens"]
    assert tokens_so_far == {0: 6, 1: 6}
    final = events[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 12
    assert final["usage"]["prompt_tokens"] == prompt_tokens

    # include_usage false asks for no usage: contradicting it is refused.
    contradiction = {**body, "stream_options": {"include_usage": False,
                                                "continuous_usage_stats": True}}  # fmt: skip
    response = http.post(path, json=contradiction)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "stream_options.continuous_usage_stats"


def test_fields_this_template_cannot_show_are_refused(
    server: ServerProcess, http: httpx.Client
) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    cases = [
        ({"messages": [*PARTIAL[:1], {"role": "assistant", "content": None,
                                      "tool_calls": [call]}]}, "messages.1.tool_calls"),
        ({"messages": [*PARTIAL, {"role": "tool", "tool_call_id": "c1", "content": "x"}]},
         "messages.2.role"),
        ({"messages": PARTIAL[:1], "chat_template_kwargs": {"enable_thinking": False}},
         "chat_template_kwargs.enable_thinking"),
        ({"messages": PARTIAL[:1], "documents": [{"title": "t", "text": "x"}]}, "documents"),
        ({"messages": [{**PARTIAL[0], "refusal": "no"}]}, "messages.0.refusal"),
        ({"messages": PARTIAL[:1], "stream": True,
          "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    ]  # fmt: skip
    for extra, param in cases:
        body = {"model": server.model, "max_tokens": 1, **extra}
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["error"]["param"] == param, (extra, response.text)


def test_neutral_and_passed_through_message_fields_are_accepted(
    server: ServerProcess, http: httpx.Client
) -> None:
    """A reply echoed back as history (`refusal: null`), a `name` (passed to the template;
    this one does not render it) and the fast tokenizers' indifferent
    `spaces_between_special_tokens` change nothing here."""
    chat = {"model": server.model, "messages": PARTIAL}
    base = _prompt_ids(http, "/v1/chat/completions", chat)
    echoed_back = [PARTIAL[0], {**PARTIAL[1], "refusal": None, "function_call": None}]
    named = [{**PARTIAL[0], "name": "ana"}, PARTIAL[1]]
    for messages in (echoed_back, named):
        assert _prompt_ids(http, "/v1/chat/completions", {**chat, "messages": messages}) == base
    args = {**chat, "max_tokens": 8, "temperature": 0, "skip_special_tokens": False}
    texts = [
        _post(http, "/v1/chat/completions", {**args, "spaces_between_special_tokens": flag})[
            "choices"
        ][0]["message"]["content"]
        for flag in (True, False)
    ]
    assert texts[0] == texts[1]
