"""Chat messages and template options through a template that reads them, on a real server.

The server loads a tiny random Qwen3 folder whose chat template (written here, in the shape
of Qwen's and Hermes' templates) renders message names, assistant tool calls, tool results,
RAG documents and Qwen3's `enable_thinking`, and whose tokenizer adds a BOS. Every prompt
the server computes is compared with transformers' `apply_chat_template` on the same
messages as vLLM hands them to a template (tool-call arguments parsed from their JSON text):
the reference implementation, not a second copy of ours.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_server import ServerProcess

transformers = pytest.importorskip("transformers")
from tests.support.tiny_hf import save_tiny  # noqa: E402

ARGS = ["--device", "cpu", "--kv-tokens", "2048", "--max-batch-tokens", "256", "--chunk-size", "64",
        "--max-running", "8", "--max-model-len", "512"]  # fmt: skip
BOS = 256  # the byte tokenizer's <|bos|>

TOOL_TEMPLATE = (
    "{%- if documents %}{{- '<|im_start|>system\\nDocuments:' }}"
    "{%- for d in documents %}{{- '\\n- ' + d.title + ': ' + d.text }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response id=\"' + message.tool_call_id + '\">\\n' + message.content"
    " + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.name %}{{- ' name=' + message.name }}{%- endif %}"
    "{{- '\\n' + message.content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '\\n<tool_call>\\n' + {'name': call.function.name,"
    " 'arguments': call.function.arguments} | tojson + '\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)

HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "You answer with tools."},
    {"role": "user", "content": "Weather in Paris?", "name": "ana"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "time", "arguments": ""}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "noon"}]},
    {"role": "user", "content": "Thanks!"},
]  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chat_template") / "model"
    save_tiny("qwen3", path, seed=20)
    config = {"bos_token": "<|bos|>", "add_bos_token": True, "eos_token": "<|eos|>",
              "chat_template": TOOL_TEMPLATE}  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(["--model", str(folder), *ARGS]).start()
    yield proc
    proc.stop()


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def reference(folder: Path) -> Any:
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer


def _as_vllm_passes_them(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages a template sees: text parts joined, null content "", arguments parsed."""
    out = []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), list):
            m["content"] = "".join(part["text"] for part in m["content"])
        m["content"] = m.get("content") or ""
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"],
                                   "arguments": json.loads(c["function"]["arguments"] or "{}")}}
                for c in m["tool_calls"]
            ]  # fmt: skip
        out.append(m)
    return out


def _expected_ids(
    http: httpx.Client, reference: Any, messages: list[dict], **options: Any
) -> list[int]:
    """transformers' rendering, tokenized by the server without special tokens."""
    text = reference.apply_chat_template(_as_vllm_passes_them(messages), tokenize=False, **options)
    body = {"prompt": text, "add_special_tokens": False}
    return http.post("/tokenize", json=body).json()["tokens"]


def _chat_prompt_ids(
    http: httpx.Client, server: ServerProcess, messages: list[dict], **extra: Any
) -> list[int]:
    body = {"model": server.model, "messages": messages, "max_tokens": 1, "return_token_ids": True,
            **extra}  # fmt: skip
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["prompt_token_ids"]


def test_tool_history_renders_as_transformers_does(
    server: ServerProcess, http: httpx.Client, reference: Any
) -> None:
    ids = _chat_prompt_ids(http, server, HISTORY)
    assert ids == _expected_ids(http, reference, HISTORY, add_generation_prompt=True)
    text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert " name=ana" in text and '"arguments": {"city": "Paris"}' in text
    assert '<tool_response id="call_2">\nnoon' in text
    # /tokenize and /v1/score take the same messages.
    tokenized = http.post("/tokenize", json={"messages": HISTORY}).json()["tokens"]
    assert tokenized == ids
    scored = http.post("/v1/score", json={"model": server.model, "messages": HISTORY})
    assert scored.status_code == 200, scored.text


def test_template_options_change_the_prompt_as_transformers_renders_them(
    server: ServerProcess, http: httpx.Client, reference: Any
) -> None:
    messages = [{"role": "user", "content": "Think about it."}]
    default = _chat_prompt_ids(http, server, messages)
    no_thinking = _chat_prompt_ids(
        http, server, messages, chat_template_kwargs={"enable_thinking": False}
    )
    assert no_thinking == _expected_ids(
        http, reference, messages, add_generation_prompt=True, enable_thinking=False
    )
    assert no_thinking != default  # the control: the option reached the template

    documents = [{"title": "Tea", "text": "Tea is a drink."}]
    with_docs = _chat_prompt_ids(http, server, messages, documents=documents)
    assert with_docs == _expected_ids(
        http, reference, messages, add_generation_prompt=True, documents=documents
    )
    assert with_docs != default

    # The tokenizer's BOS: on top of the template only when asked (chat), by default for
    # a text prompt (completions).
    with_bos = _chat_prompt_ids(http, server, messages, add_special_tokens=True)
    assert with_bos == [BOS, *default] and default[0] != BOS
    completion = {"model": server.model, "prompt": "hi", "max_tokens": 1, "return_token_ids": True}
    plain = http.post("/v1/completions", json=completion).json()["choices"][0]
    bare = http.post("/v1/completions", json={**completion, "add_special_tokens": False}).json()
    tokenized = http.post("/tokenize", json={"prompt": "hi"}).json()["tokens"]
    assert plain["prompt_token_ids"] == tokenized == [BOS, *bare["choices"][0]["prompt_token_ids"]]


@pytest.mark.parametrize(
    ("messages", "extra", "param"),
    [
        ([*HISTORY[:2], {**HISTORY[2], "tool_calls": [{"id": "c", "type": "function",
          "function": {"name": "f", "arguments": "{not json"}}]}], {},
         "messages.2.tool_calls.0.function.arguments"),
        ([{"role": "user", "content": "hi", "tool_call_id": "c"}], {}, "messages.0.tool_call_id"),
        ([{"role": "user", "content": "hi", "tool_calls": []}], {}, "messages.0.tool_calls"),
        ([{"role": "user", "content": None}], {}, "messages.0.content"),
        ([{"role": "assistant"}], {}, "messages.0.content"),
        ([{"role": "user", "content": "hi"}], {"chat_template_kwargs": {"no_such": 1}},
         "chat_template_kwargs.no_such"),
        ([{"role": "user", "content": "hi"}], {"chat_template_kwargs": {"messages": []}},
         "chat_template_kwargs.messages"),
        ([{"role": "user", "content": "hi"}],  # the template reads no `tools`
         {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ],
)  # fmt: skip
def test_messages_that_do_not_fit_are_refused(
    server: ServerProcess, http: httpx.Client, messages: list, extra: dict, param: str
) -> None:
    body = {"model": server.model, "messages": messages, "max_tokens": 1, **extra}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
