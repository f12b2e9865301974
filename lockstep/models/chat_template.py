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
from typing import Any, NamedTuple

import jinja2
import jinja2.meta
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


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=8)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile once per distinct template text; a syntax error is a ModelLoadError."""
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelLoadError(
            f"the model's chat template does not compile: {exc.message} (line {exc.lineno})"
        ) from None


class TemplateNames(NamedTuple):
    """What a template can read. `variables`: the names it takes from its caller (besides
    the environment's own functions), e.g. `messages`, `add_generation_prompt` and options
    such as Qwen3's `enable_thinking`. `fields`: every attribute or constant key it looks up
    on any value (`message.tool_calls`, `message['name']`): a message field that is not
    among them cannot reach the prompt."""

    variables: frozenset[str]
    fields: frozenset[str]


@lru_cache(maxsize=8)
def template_names(template: str) -> TemplateNames:
    """The names `template` reads, from its syntax tree (a static over-approximation: a name
    in a branch the messages never take still counts)."""
    env = _environment()
    tree = env.parse(template)
    variables = jinja2.meta.find_undeclared_variables(tree) - set(env.globals)
    fields = {node.attr for node in tree.find_all(nodes.Getattr)}
    fields |= {
        node.arg.value
        for node in tree.find_all(nodes.Getitem)
        if isinstance(node.arg, nodes.Const) and isinstance(node.arg.value, str)
    }
    fields |= {  # message.get('name')
        node.args[0].value
        for node in tree.find_all(nodes.Call)
        if isinstance(node.node, nodes.Getattr)
        and node.node.attr == "get"
        and node.args
        and isinstance(node.args[0], nodes.Const)
        and isinstance(node.args[0].value, str)
    }
    return TemplateNames(frozenset(variables), frozenset(fields))


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
