"""Rendering a model's Jinja chat template the way Hugging Face transformers does.

Templates come from untrusted model files, so they run in jinja2's immutable sandbox. The
environment matches transformers' `apply_chat_template` in what templates rely on:
trim_blocks and lstrip_blocks, the loopcontrols extension, a `tojson` that keeps non-ASCII
text as is, `raise_exception(msg)`, `strftime_now(fmt)`, and the `{% generation %}` block
(rendered as its plain body; it only marks assistant text for training masks). Any difference
here changes prompt tokens, so the tests compare rendered prompts with transformers'.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lockstep.errors import ModelLoadError, RequestError


class _TemplateRaised(Exception):
    """raise_exception() was called by the template: the request does not fit the template."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any
) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML, which would change prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body", []), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


@lru_cache(maxsize=8)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile once per distinct template text; a syntax error is a ModelLoadError."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelLoadError(
            f"the model's chat template does not compile: {exc.message} (line {exc.lineno})"
        ) from None


def render_chat_template(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool,
    bos_token: str,
    eos_token: str,
    **extra: Any,
) -> str:
    """The prompt text for `messages`. A template that rejects the messages (raise_exception,
    a missing key, a sandbox violation) gives a RequestError carrying its reason."""
    compiled = compile_chat_template(template)
    try:
        return compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except _TemplateRaised as exc:
        raise RequestError(f"the chat template rejected the messages: {exc}") from None
    except (jinja2.TemplateError, TypeError, KeyError) as exc:
        raise RequestError(f"the chat template failed on these messages: {exc}") from None
