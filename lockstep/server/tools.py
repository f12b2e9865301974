"""Tool calling as OpenAI's chat API shapes it: `tools`, `tool_choice`, `parallel_tool_calls`.

`plan_tools` turns a request's fields into a `ToolPlan` before any engine work:

- `tools` go to the chat template as its `tools` variable (the list of `{"type": "function",
  "function": {...}}` that transformers hands a template); a template that reads no `tools`
  cannot show them, and the request is refused.
- `tool_choice` `none`: the tools are shown, the output is all content (vLLM's default).
  `auto` (the default with tools): the output is parsed for calls by the server's tool-call
  parser (`tool_parser.py`); without one (`--tool-call-parser none`, or a template in no
  markup Lockstep parses) the request is refused. `required` and a named function: decoding
  is constrained by a grammar (llguidance, `StructuredOutput`) to one call of the named
  function, or to calls of the given tools (one with `parallel_tool_calls: false`, one or more
  otherwise), in the markup the parser reads back.
- `parallel_tool_calls: false` with `auto`: generation stops at the end of the first call.

What a call's JSON must look like is the function's `parameters` schema under `arguments`;
the grammar writes JSON in `json.dumps` layout, which is also how the parser re-serializes it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from lockstep.engine.grammar import JSON_LAYOUT
from lockstep.engine.structured_output import StructuredOutput
from lockstep.server.processing_fields import compile_constraint
from lockstep.server.protocol import APIError, ChatCompletionRequest
from lockstep.server.tool_parser import HermesToolCallParser, ParsedToolCall


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses tools. `template_tools`: the template's `tools` variable
    (None: not passed). `parse`: parse calls out of the output. `structured_output`: the
    grammar that forces calls. `stop`: stop strings added (the end of the first call)."""

    template_tools: list[dict[str, Any]] | None = None
    parse: bool = False
    structured_output: StructuredOutput | None = None
    stop: tuple[str, ...] = ()


NO_TOOLS = ToolPlan()


def plan_tools(
    body: ChatCompletionRequest, parser: str | None, template_variables: frozenset[str] | None
) -> ToolPlan:
    """The plan for `body`, or a 400 naming the field that cannot be honoured.
    `parser`: the server's tool-call parser (None: none); `template_variables`: the names the
    chat template reads (None: the model has no template)."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise APIError(
                "tool_choice needs tools: send the tools the model may call, or leave"
                " tool_choice out",
                param="tool_choice",
                code="invalid_value",
            )
        return NO_TOOLS
    if template_variables is None or "tools" not in template_variables:
        raise APIError(
            "this model's chat template does not render tools (it reads no `tools`), so the"
            " model cannot see them; leave tools out",
            param="tools",
            code="invalid_value",
        )
    names = [tool.function.name for tool in body.tools]
    duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if duplicate is not None:
        raise APIError(
            f"tools name the function {duplicate!r} twice: names must be unique",
            param="tools",
            code="invalid_value",
        )
    template_tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    if choice == "none":
        return ToolPlan(template_tools=template_tools)
    if parser is None:
        raise APIError(
            f"tool_choice={_choice_label(choice)} needs a tool-call parser for this model's"
            " output, and the server has none (its chat template writes no markup Lockstep"
            " parses; start it with --tool-call-parser hermes if the model writes"
            " <tool_call> JSON), or send tool_choice 'none'",
            param="tools" if choice is None else "tool_choice",
            code="invalid_value",
        )
    if choice is None or choice == "auto":
        strict = next((t.function.name for t in body.tools if t.function.strict), None)
        if strict is not None:
            raise APIError(
                f"tools: function {strict!r} is strict, which Lockstep enforces by constraining"
                " decoding, as it does for tool_choice 'required' or a named function; with"
                " 'auto' the model may answer in text, so send strict false or one of those",
                param="tool_choice",
                code="invalid_value",
            )
        parallel = body.parallel_tool_calls is not False
        stop = () if parallel else (HermesToolCallParser.END,)
        return ToolPlan(template_tools=template_tools, parse=True, stop=stop)
    if choice == "required":
        functions = [tool.function for tool in body.tools]
        parallel = body.parallel_tool_calls is not False
    else:
        wanted = choice.function.name
        functions = [tool.function for tool in body.tools if tool.function.name == wanted]
        if not functions:
            raise APIError(
                f"tool_choice names the function {wanted!r}, which is not among the tools"
                f" ({', '.join(names)})",
                param="tool_choice.function.name",
                code="invalid_value",
            )
        parallel = False
    grammar = _calls_grammar(functions, parallel)
    return ToolPlan(
        template_tools=template_tools,
        parse=True,
        structured_output=StructuredOutput.grammar(grammar, field="tools"),
    )


def _choice_label(choice: Any) -> str:
    if choice is None:
        return "'auto' (the default with tools)"
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


def _call_schema(function: Any) -> dict[str, Any]:
    """A call of `function` as JSON: its name, and arguments valid against its parameters
    (none given: OpenAI's empty parameter list, the object `{}`)."""
    parameters = function.parameters or {
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _calls_grammar(functions: list[Any], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect, `%json` embedding a schema) of one call, or of
    one or more calls on separate lines, in Hermes markup."""
    schemas = [_call_schema(f) for f in functions]
    schema = dict(schemas[0]) if len(schemas) == 1 else {"anyOf": schemas}
    schema["x-guidance"] = JSON_LAYOUT  # llguidance's JSON options: json.dumps layout
    start, end = (
        json.dumps(HermesToolCallParser.START + "\n"),
        json.dumps("\n" + HermesToolCallParser.END),
    )
    call = f"call: {start} %json {json.dumps(schema)} {end}"
    return f'start: call ("\\n" call)*\n{call}' if parallel else f"start: call\n{call}"


async def with_tool_constraint(
    grammars: Any, processing: dict[str, Any], plan: ToolPlan
) -> dict[str, Any]:
    """`processing` (SamplingParams keyword arguments, processing_fields.py) with the plan's
    grammar, compiled off the event loop (a function schema that does not compile is a 400
    naming `tools`). The output takes one constraint: a second one is a 400."""
    if plan.structured_output is None:
        return processing
    other = processing.get("structured_output")
    if other is not None:
        raise APIError(
            f"tool_choice 'required' or a named function constrains the reply to tool calls;"
            f" {other.field} constrains it too: send one",
            param=other.field,
            code="invalid_value",
        )
    await compile_constraint(grammars, plan.structured_output)
    return {**processing, "structured_output": plan.structured_output}


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def message_tool_calls(calls: list[ParsedToolCall], ids: list[str]) -> list[dict[str, Any]]:
    """A message's `tool_calls`, OpenAI's shape."""
    return [
        {"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c, i in zip(calls, ids, strict=True)
    ]


def delta_tool_calls(first_index: int, calls: list[ParsedToolCall], ids: list[str]) -> list[dict]:
    """Stream deltas for completed calls, OpenAI's shape: per call one delta with its index,
    id, type and name (arguments ""), then one with its arguments."""
    deltas = []
    for k, (call, call_id) in enumerate(zip(calls, ids, strict=True)):
        index = first_index + k
        deltas.append(
            {
                "index": index,
                "id": call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": ""},
            }
        )
        deltas.append({"index": index, "function": {"arguments": call.arguments}})
    return deltas


def finish_reason(reason: str | None, calls: int) -> str | None:
    """`tool_calls` when the reply made calls and ended on its own (a reply cut by max_tokens
    stays `length`)."""
    return "tool_calls" if calls and reason == "stop" else reason
