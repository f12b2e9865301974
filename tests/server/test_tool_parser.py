"""The tool-call parser on strings, and the tool plan of a request (no server: both are pure).

The parser must give a stream cut anywhere the content and calls of the whole text; the plan
must refuse, with the field named, whatever the model or the request cannot honour.
"""

from __future__ import annotations

import json

import pytest

from lockstep.server.protocol import APIError, ChatCompletionRequest
from lockstep.server.tool_parser import (
    HermesToolCallParser,
    ParsedToolCall,
    parse_whole,
    resolve_tool_call_parser,
)
from lockstep.server.tools import plan_tools

WEATHER = ParsedToolCall("get_weather", '{"city": "Paris", "unit": "C"}')
TIME = ParsedToolCall("get_time", "{}")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
CALL_NO_ARGS = '<tool_call>\n{"name": "get_time"}\n</tool_call>'

CASES = [
    # (model output, content, calls)
    ("Paris is sunny.\n", "Paris is sunny.\n", []),
    ("", "", []),
    (CALL, "", [WEATHER]),
    (f"\n\n{CALL}\n", "", [WEATHER]),
    (f"Let me check.\n{CALL}\n{CALL_NO_ARGS}\n", "Let me check.", [WEATHER, TIME]),
    (f"{CALL}\nDone.", "\nDone.", [WEATHER]),
    # Compact JSON is re-serialized as json.dumps writes it.
    ('<tool_call>{"name":"get_weather","arguments":{"city":"Paris","unit":"C"}}</tool_call>',
     "", [WEATHER]),
    # Not a call: invalid JSON, a wrong shape, extra keys, a block cut off: content, tags kept.
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ('<tool_call>["get_time"]</tool_call>', '<tool_call>["get_time"]</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "x"}</tool_call>', []),
    ('<tool_call>{"name": "f", "id": 1}</tool_call>', '<tool_call>{"name": "f", "id": 1}</tool_call>',
     []),
    ('Sure <tool_call>\n{"name": "get_wea', 'Sure <tool_call>\n{"name": "get_wea', []),
    # Something that starts like a tag but is not one.
    ("a <tool_cal b <tool", "a <tool_cal b <tool", []),
]  # fmt: skip


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_whole_text(text: str, content: str, calls: list[ParsedToolCall]) -> None:
    parsed = parse_whole(HermesToolCallParser(), text)
    assert (parsed.content, parsed.calls) == (content, calls)
    for call in parsed.calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_a_stream_cut_anywhere_parses_as_the_whole(
    text: str, content: str, calls: list[ParsedToolCall]
) -> None:
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], list(text[:cut]) + [text[cut:]]):
            parser = HermesToolCallParser()
            outs = [parser.feed(piece) for piece in pieces] + [parser.finish()]
            assert "".join(o.content for o in outs) == content, (cut, pieces)
            assert [c for o in outs for c in o.calls] == calls
    # The control: the comparison sees what a lost end changes.
    if len(text) > 2:
        cut_short = parse_whole(HermesToolCallParser(), text[:-2])
        assert (cut_short.content, cut_short.calls) != (content, calls)


def test_calls_are_released_as_soon_as_their_block_closes() -> None:
    parser = HermesToolCallParser()
    assert parser.feed("Checking. " + CALL[:-3]).calls == []
    assert parser.feed(CALL[-3:]).calls == [WEATHER]
    assert parser.num_calls == 1


def test_parser_choice() -> None:
    assert resolve_tool_call_parser("auto", "{{ '<tool_call>' }}") == "hermes"
    assert resolve_tool_call_parser("auto", "{{ messages }}") is None
    assert resolve_tool_call_parser("auto", None) is None
    assert resolve_tool_call_parser("none", "<tool_call>") is None
    assert resolve_tool_call_parser("hermes", None) == "hermes"
    with pytest.raises(ValueError, match="--tool-call-parser='mistral' is invalid"):
        resolve_tool_call_parser("mistral", None)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
]  # fmt: skip
TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt"})


def _plan(parser: str | None = "hermes", variables=TEMPLATE_VARIABLES, **fields):
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )
    return plan_tools(body, parser, variables)


def test_plans() -> None:
    assert _plan().template_tools is None  # no tools: nothing to render or parse
    auto = _plan(tools=TOOLS)
    assert auto.parse and auto.structured_output is None and auto.stop == ()
    assert auto.template_tools[1] == {"type": "function", "function": {"name": "get_time"}}
    single = _plan(tools=TOOLS, parallel_tool_calls=False)
    assert single.stop == ("</tool_call>",)
    none = _plan(tools=TOOLS, tool_choice="none")
    assert not none.parse and none.template_tools is not None
    required = _plan(tools=TOOLS, tool_choice="required")
    assert required.structured_output.kind == "grammar"
    assert '("\\n" call)*' in required.structured_output.spec
    assert "get_weather" in required.structured_output.spec
    named = _plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert "get_weather" not in named.structured_output.spec
    assert '("\\n" call)*' not in named.structured_output.spec


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        ({"tool_choice": "auto"}, "tool_choice", "tool_choice needs tools"),
        ({"tools": TOOLS, "variables": frozenset({"messages"})}, "tools", "does not render tools"),
        ({"tools": TOOLS, "variables": None}, "tools", "does not render tools"),
        ({"tools": TOOLS, "parser": None}, "tools", "--tool-call-parser hermes"),
        ({"tools": TOOLS, "parser": None, "tool_choice": "required"}, "tool_choice",
         "needs a tool-call parser"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools", "'get_weather' twice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name", "'nope', which is not among the tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]},
         "tool_choice", "'f' is strict"),
    ],
)  # fmt: skip
def test_refusals(kwargs: dict, param: str, message: str) -> None:
    with pytest.raises(APIError, match=message) as info:
        _plan(**kwargs)
    assert info.value.param == param


def test_tool_choice_none_needs_no_parser_nor_constraint() -> None:
    strict = [{"type": "function", "function": {"name": "f", "strict": True}}]
    plan = _plan(parser=None, tools=strict, tool_choice="none")
    assert plan.template_tools == strict and not plan.parse and plan.structured_output is None
