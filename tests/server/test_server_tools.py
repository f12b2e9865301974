"""Tool calling through the official `openai` client against a real `lockstep serve`.

The server loads a tiny random Qwen3 folder whose chat template renders `tools` and tool
calls in Qwen's and Hermes' markup (`<tool_call>` JSON), so `--tool-call-parser auto` picks
the hermes parser. A random model never chooses to call a tool by itself: `tool_choice`
`required` and a named function force calls through the grammar, which is what the parsing,
streaming and history checks run on; the parser's own cases are in test_tool_parser.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from test_server import ServerProcess
from test_server_chat_template import TOOL_TEMPLATE

transformers = pytest.importorskip("transformers")
from tests.support.tiny_hf import save_tiny  # noqa: E402

ARGS = ["--device", "cpu", "--kv-tokens", "4096", "--max-batch-tokens", "512", "--chunk-size",
        "256", "--max-running", "8", "--max-model-len", "512"]  # fmt: skip
# Qwen's tools preamble, cut short: the byte tokenizer spends a token per character.
TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}" + TOOL_TEMPLATE
)
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "get_time"}},
]
NAMES = {"get_weather", "get_time"}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tools") / "model"
    save_tiny("qwen3", path, seed=21)
    config = {"bos_token": None, "eos_token": "<|eos|>", "chat_template": TOOLS_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(["--model", str(folder), *ARGS]).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _create(client: openai.OpenAI, server: ServerProcess, **kwargs: Any) -> Any:
    options = {"model": server.model, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 100,
               "temperature": 0, **kwargs}  # fmt: skip
    return client.chat.completions.create(**options)


def _calls(message: Any) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def test_required_and_named_calls_are_parsed(client: openai.OpenAI, server: ServerProcess) -> None:
    single = _create(client, server, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert single.finish_reason == "tool_calls" and single.message.content is None
    assert len(single.message.tool_calls) == 1
    (name, arguments), call = _calls(single.message)[0], single.message.tool_calls[0]
    assert name in NAMES and call.type == "function" and call.id.startswith("call_")
    allowed = [{"city": "Paris"}, {"city": "Rome"}] if name == "get_weather" else [{}]
    assert arguments in allowed

    named = _create(client, server, tool_choice={"type": "function",
                                                 "function": {"name": "get_time"}}).choices[0]  # fmt: skip
    assert _calls(named.message) == [("get_time", {})]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    weather = _create(client, server, tool_choice=forced, temperature=1.0, seed=3).choices[0]
    [(name, arguments)] = _calls(weather.message)
    assert name == "get_weather" and arguments["city"] in ("Paris", "Rome")

    # One or more calls, each of a given tool with valid arguments.
    several = _create(client, server, tool_choice="required").choices[0]
    assert several.finish_reason in ("tool_calls", "length")
    calls = _calls(several.message) if several.message.tool_calls else []
    assert calls and all(name in NAMES for name, _ in calls)


def _streamed(stream: Any) -> tuple[str, list[tuple[str, dict]], str | None]:
    """A stream's content, calls and finish reason, assembled as OpenAI's deltas say."""
    calls: dict[int, dict[str, Any]] = {}
    finish, content = None, ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    assert call["id"] is None and delta.type == "function"
                    call["id"], call["name"] = delta.id, delta.function.name
                call["arguments"] += delta.function.arguments or ""
    assert list(calls) == list(range(len(calls)))
    assert all(c["id"].startswith("call_") for c in calls.values())
    return content, [(c["name"], json.loads(c["arguments"])) for c in calls.values()], finish


# A reply forced through vLLM's `structured_outputs` (api: the model writes this text), so that
# `auto` has calls to find: some text, then two calls.
SAID = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
FORCED = {"extra_body": {"structured_outputs": {"regex": re.escape(SAID)}}, "max_tokens": 180}


def test_auto_finds_the_calls_in_the_reply(client: openai.OpenAI, server: ServerProcess) -> None:
    both = _create(client, server, **FORCED).choices[0]
    assert both.message.content == "Let me check." and both.finish_reason == "tool_calls"
    assert _calls(both.message) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    first = _create(client, server, parallel_tool_calls=False, **FORCED).choices[0]
    assert _calls(first.message) == [("get_weather", {"city": "Paris"})]
    assert first.finish_reason == "tool_calls" and first.message.content == "Let me check."
    # The control: with tool_choice none the same reply is all content.
    text = _create(client, server, tool_choice="none", **FORCED).choices[0]
    assert text.message.content == SAID and text.message.tool_calls is None
    assert text.finish_reason == "stop"


@pytest.mark.parametrize(
    "options",
    [FORCED, {"tool_choice": "required", "parallel_tool_calls": False, "seed": 5,
              "temperature": 1.0}],
    ids=["auto", "required"],
)  # fmt: skip
def test_streamed_calls_equal_the_whole_answer(
    client: openai.OpenAI, server: ServerProcess, options: dict
) -> None:
    whole = _create(client, server, **options).choices[0]
    content, calls, finish = _streamed(_create(client, server, stream=True, **options))
    assert calls == _calls(whole.message) and finish == whole.finish_reason == "tool_calls"
    assert content == (whole.message.content or "")


def test_auto_and_none_answer_in_text(client: openai.OpenAI, server: ServerProcess) -> None:
    with_tools = _create(client, server, max_tokens=8).choices[0]
    assert with_tools.message.tool_calls is None and with_tools.finish_reason in ("stop", "length")
    none = _create(client, server, max_tokens=8, tool_choice="none")
    without = _create(client, server, max_tokens=8, tools=openai.NOT_GIVEN)
    # The tools are in the prompt (the control: without them it is shorter).
    assert none.usage.prompt_tokens > without.usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None


def test_tools_render_as_transformers_renders_them(folder: Path, server: ServerProcess) -> None:
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    tokenizer.chat_template = TOOLS_TEMPLATE
    expected = tokenizer.apply_chat_template(
        MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    body = {"model": server.model, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 1,
            "return_token_ids": True, "tool_choice": "none"}  # fmt: skip
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        ids = http.post("/v1/chat/completions", json=body).json()["choices"][0]["prompt_token_ids"]
        assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == expected
    assert '\n{"type": "function", "function": {"name": "get_weather"' in expected


def test_a_call_and_its_result_round_trip(client: openai.OpenAI, server: ServerProcess) -> None:
    reply = _create(client, server, tool_choice={"type": "function",
                                                 "function": {"name": "get_weather"}})  # fmt: skip
    message = reply.choices[0].message
    history = [
        *MESSAGES,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "22 C"},
    ]
    follow_up = _create(client, server, messages=history, max_tokens=4, tool_choice="none")
    assert follow_up.choices[0].finish_reason in ("stop", "length")
    # The call and its result are in the prompt.
    assert follow_up.usage.prompt_tokens > reply.usage.prompt_tokens + len("22 C") + 40


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]},
         "tool_choice"),
        ({"tools": TOOLS + TOOLS}, "tools"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
    ],
)  # fmt: skip
def test_tool_requests_that_cannot_be_honoured(
    server: ServerProcess, extra: dict, param: str
) -> None:
    body = {"model": server.model, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 1, **extra}
    body = {k: v for k, v in body.items() if v is not None}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
