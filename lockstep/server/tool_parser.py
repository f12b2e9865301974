"""Tool calls in a model's output text, parsed while the text streams.

One parser per output format, chosen per model (`--tool-call-parser`, default from the chat
template, `resolve_tool_call_parser`). `hermes`: the Hermes and Qwen markup, each call a JSON
object between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A streaming answer and a whole one are parsed by the same state machine fed the same text
(whole: in one piece), so their content and calls agree. The rules:

- text outside the tags is content, except whitespace next to a call (before one, after the
  last one): a reply of calls alone has no content;
- a block whose JSON is not an object with a string `name` and an object `arguments` (or none)
  is content, tags included, as is a block the output ends inside (a call cut by `max_tokens`);
- a call's `arguments` are re-serialized as `json.dumps` writes them (the grammar that forces a
  call writes that same layout, lockstep/server/tools.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

TOOL_CALL_PARSERS = ("hermes",)


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # the arguments object as JSON text


@dataclass
class ParserOutput:
    """What a piece of text adds: content to show now, and the calls it completed."""

    content: str = ""
    calls: list[ParsedToolCall] = field(default_factory=list)


class HermesToolCallParser:
    """`<tool_call>{json}</tool_call>` blocks. Feed it text in any pieces, then `finish()`.
    Text that may be the start of a tag is held back until the next piece decides it."""

    START = "<tool_call>"
    END = "</tool_call>"

    def __init__(self) -> None:
        self._buffer = ""  # text not classified yet
        self._inside = False  # the buffer is inside a <tool_call> block
        self._pending_space = ""  # whitespace content shown only if content follows
        self._space_before = ""  # the whitespace before the open block: content if no call
        self.num_calls = 0

    def feed(self, text: str) -> ParserOutput:
        out = ParserOutput()
        self._buffer += text
        while True:
            if self._inside:
                end = self._buffer.find(self.END)
                if end < 0:
                    return out
                block, self._buffer = self._buffer[:end], self._buffer[end + len(self.END) :]
                self._inside = False
                call = _parse_call(block)
                if call is None:
                    out.content += self._content(self._space_before + self.START + block + self.END)
                else:
                    self.num_calls += 1
                    out.calls.append(call)
                continue
            start = self._buffer.find(self.START)
            if start >= 0:
                out.content += self._content(self._buffer[:start])
                self._space_before, self._pending_space = self._pending_space, ""
                self._buffer = self._buffer[start + len(self.START) :]
                self._inside = True
                continue
            held = _partial_tag_length(self._buffer, self.START)
            cut = len(self._buffer) - held
            out.content += self._content(self._buffer[:cut])
            self._buffer = self._buffer[cut:]
            return out

    def finish(self) -> ParserOutput:
        """The end of the output: what was held back is content (an unclosed block with its
        tag); whitespace after the last call is dropped."""
        rest = (self._space_before + self.START if self._inside else "") + self._buffer
        self._buffer, self._inside = "", False
        out = ParserOutput(content=self._content(rest))
        if self.num_calls == 0:
            out.content += self._pending_space
        self._pending_space = ""
        return out

    def _content(self, text: str) -> str:
        """Content to show now: pending whitespace joins it, trailing whitespace waits."""
        text = self._pending_space + text
        shown = text.rstrip()
        self._pending_space = text[len(shown) :]
        return shown


def _partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def _parse_call(block: str) -> ParsedToolCall | None:
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict) or set(value) - {"name", "arguments"}:
        return None
    return ParsedToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def parse_whole(parser: HermesToolCallParser, text: str) -> ParserOutput:
    """A whole output at once: the same machine as a stream fed `text` in one piece."""
    first, last = parser.feed(text), parser.finish()
    return ParserOutput(first.content + last.content, first.calls + last.calls)


def resolve_tool_call_parser(option: str, chat_template: str | None) -> str | None:
    """The parser for `--tool-call-parser option`: `auto` picks `hermes` when the chat template
    writes `<tool_call>` (Qwen's, Hermes'), else none; `none` turns parsing off."""
    if option == "none":
        return None
    if option == "auto":
        if chat_template and HermesToolCallParser.START in chat_template:
            return "hermes"
        return None
    if option not in TOOL_CALL_PARSERS:
        raise ValueError(
            f"--tool-call-parser={option!r} is invalid: expected auto, none or one of "
            f"{', '.join(TOOL_CALL_PARSERS)}"
        )
    return option
