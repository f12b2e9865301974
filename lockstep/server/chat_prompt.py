"""Chat messages to prompt token ids, through the model's own chat template.

The messages reach the template as vLLM hands them to it: `developer` becomes `system`,
content parts are joined into one string (null content is ""), `name` is passed as a field,
an assistant's `tool_calls` carry their arguments as parsed JSON (an empty `tool_calls` list
is dropped), a tool message carries its `tool_call_id`; a request's `tools` become the
template's `tools` (tools.py checks the template reads them). What the template cannot show is
refused, never dropped: a tool call or a tool result when the template reads no
`tool_calls` (a template that renders tools reads them: Qwen's and Hermes' do, SmolLM2's
does not), `documents` or a `chat_template_kwargs` key that the template never reads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lockstep.models.chat_template import template_names
from lockstep.server.preparation import Served, check_text_length
from lockstep.server.protocol import APIError, ChatCompletionRequest, ChatMessage, clip

# Template variables the renderer sets itself, or that name something refused elsewhere:
# they cannot come through `chat_template_kwargs`.
_RESERVED_VARIABLES = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "bos_token",
        "eos_token",
        "documents",
        "tools",
        "chat_template",
        "tokenize",
    }
)


@dataclass(frozen=True)
class ChatOptions:
    """How to render: vLLM's request options of the same names."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    documents: list[dict[str, str]] | None = None
    tools: list[dict[str, Any]] | None = None  # the template's `tools` (tools.py checks them)
    bounded: bool = True  # refuse text too long for the context before rendering it


def chat_options(body: ChatCompletionRequest) -> ChatOptions:
    """The rendering a chat completion asks for. `continue_final_message` turns the
    generation prompt off; asking for both explicitly is a 400, as in vLLM."""
    if body.continue_final_message and body.add_generation_prompt:
        if "add_generation_prompt" in body.model_fields_set:
            raise APIError(
                "continue_final_message and add_generation_prompt cannot both be true: the"
                " first carries on the final message, the second opens a new one",
                param="continue_final_message",
                code="invalid_value",
            )
    return ChatOptions(
        add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
        continue_final_message=body.continue_final_message,
        add_special_tokens=body.add_special_tokens,
        template_kwargs=body.chat_template_kwargs or {},
        documents=body.documents,
    )


def reply_role(body: ChatCompletionRequest, options: ChatOptions) -> str:
    """vLLM's reply role: the assistant after a generation prompt, else the role of the
    message the model carries on."""
    return "assistant" if options.add_generation_prompt else body.messages[-1].role


def echoed_text(body: ChatCompletionRequest, options: ChatOptions) -> str:
    """With `echo`: the final message's text when the reply continues it (its role is the
    reply's), as vLLM prefixes it; otherwise nothing."""
    final = body.messages[-1]
    if body.echo and final.role == reply_role(body, options):
        return final.text()
    return ""


def chat_prompt(
    served: Served, messages: list[ChatMessage], options: ChatOptions | None = None
) -> list[int]:
    """The prompt ids of `messages` rendered with the model's chat template; the tokenizer
    adds its own special tokens only with `add_special_tokens` (the template writes them)."""
    options = options or ChatOptions()
    tokenizer = served.tokenizer
    template = getattr(tokenizer, "chat_template", None)
    reads = template_names(template) if template is not None else None
    rendered_messages = [_template_message(m, i, reads) for i, m in enumerate(messages)]
    if options.bounded:
        check_text_length(served, _all_text(messages), "messages")
    extra: dict[str, Any] = {}
    if reads is not None:
        extra = _template_kwargs(options.template_kwargs, reads.variables)
        if options.documents is not None:
            if "documents" not in reads.variables:
                raise APIError(
                    "this model's chat template does not read documents",
                    param="documents",
                    code="invalid_value",
                )
            extra["documents"] = options.documents
    if options.continue_final_message:
        extra["continue_final_message"] = True
    if options.tools is not None:
        extra["tools"] = options.tools
    rendered = tokenizer.apply_chat_template(
        rendered_messages, add_generation_prompt=options.add_generation_prompt, **extra
    )
    ids = tokenizer.encode(rendered, add_special_tokens=options.add_special_tokens)
    if not ids:
        raise APIError(
            "The messages render to an empty prompt.", param="messages", code="invalid_value"
        )
    return ids


def template_variables(served: Served) -> frozenset[str] | None:
    """The variables the model's chat template reads (None: it has no template)."""
    template = getattr(served.tokenizer, "chat_template", None)
    return None if template is None else template_names(template).variables


def _all_text(messages: list[ChatMessage]) -> str:
    parts = [m.text() for m in messages]
    for m in messages:
        for call in m.tool_calls or ():
            arguments = call.function.arguments
            parts.append(arguments if isinstance(arguments, str) else json.dumps(arguments))
    return "".join(parts)


def _template_message(message: ChatMessage, index: int, reads: Any) -> dict[str, Any]:
    """One message as the template sees it, or a 400 naming the field that does not fit
    its role or that the template cannot show. `reads`: the template's names (None: no
    template, refused when rendering)."""
    path = f"messages.{index}"
    role = message.role
    tool_aware = reads is None or "tool_calls" in reads.fields
    if message.content is None and not (role == "assistant" and message.tool_calls):
        raise APIError(
            f"{path} has no content (only an assistant message with tool_calls may omit it)",
            param=f"{path}.content",
            code="missing",
        )
    if message.tool_calls is not None and role != "assistant":
        raise APIError(
            f"{path}: only assistant messages carry tool_calls",
            param=f"{path}.tool_calls",
            code="invalid_value",
        )
    if message.tool_call_id is not None and role != "tool":
        raise APIError(
            f"{path}: only tool messages carry a tool_call_id",
            param=f"{path}.tool_call_id",
            code="invalid_value",
        )
    if role == "tool" and not tool_aware:
        raise APIError(
            f"{path}: this model's chat template does not render tool results (it reads no"
            " tool_calls)",
            param=f"{path}.role",
            code="invalid_value",
        )
    result: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        "content": message.text(),
    }
    if message.name is not None:
        result["name"] = message.name
    if message.tool_calls:
        if not tool_aware:
            raise APIError(
                f"{path}: this model's chat template does not render tool calls",
                param=f"{path}.tool_calls",
                code="invalid_value",
            )
        result["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type,
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(
                        call.function.arguments, f"{path}.tool_calls.{j}.function.arguments"
                    ),
                },
            }
            for j, call in enumerate(message.tool_calls)
        ]
    if message.tool_call_id is not None:
        result["tool_call_id"] = message.tool_call_id
    return result


def _arguments(arguments: str | dict[str, Any], param: str) -> Any:
    """OpenAI writes a call's arguments as JSON text; templates take the object (as
    transformers and vLLM hand it to them). Empty text is no arguments."""
    if not isinstance(arguments, str):
        return arguments
    if not arguments:
        return {}
    try:
        return json.loads(arguments)
    except ValueError as exc:
        raise APIError(
            f"{param} is not valid JSON ({exc}): {clip(arguments)}",
            param=param,
            code="invalid_value",
        ) from None


def _template_kwargs(kwargs: Mapping[str, Any], variables: frozenset[str]) -> dict[str, Any]:
    """`chat_template_kwargs`, each a variable the template reads and the renderer does not
    set itself."""
    for key in kwargs:
        param = f"chat_template_kwargs.{key}"
        if key in _RESERVED_VARIABLES:
            raise APIError(
                f"{clip(key)} cannot be set through chat_template_kwargs: it has its own"
                " request field, or is not supported",
                param=param,
                code="invalid_value",
            )
        if key not in variables:
            readable = ", ".join(sorted(variables - _RESERVED_VARIABLES)) or "none"
            raise APIError(
                f"this model's chat template reads no variable {clip(key)!r}; the ones it"
                f" reads besides messages: {readable}",
                param=param,
                code="invalid_value",
            )
    return dict(kwargs)
