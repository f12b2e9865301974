"""Request bodies of the OpenAI-compatible API, as strict pydantic models.

Four kinds of field, each handled on purpose (STYLE.md: honour the API you claim):

- implemented fields, declared below with their ranges (the OpenAPI schema shows them);
- fields that cannot change the output (SGLang's request ids and labels), declared with a
  description saying "accepted:";
- OpenAI, vLLM and SGLang fields Lockstep does not implement (`unsupported_fields.py`): accepted
  only at their neutral value (e.g. `presence_penalty: 0`), otherwise refused with a 400
  naming the field;
- anything else: refused as an unrecognized argument (`extra="forbid"`).

Models are strict, so `"temperature": "1"` or `"max_tokens": true` is a 400, not a coercion.
Integers end below 2**63 (the engine holds them as 64-bit values) or within a tighter declared
range; token ids are checked against the vocabulary in `preparation.py`. Before any field is
validated, every string of a body, keys included, is checked to be valid Unicode (`RequestBody`), so
no lone surrogate reaches the tokenizer or a JSON encoder.
Response bodies are plain dicts built in `responses.py`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lockstep.server.unsupported_fields import (
    CHAT_UNSUPPORTED,
    COMPLETION_UNSUPPORTED,
    DISAGGREGATION_FIELDS,
    MESSAGE_UNSUPPORTED,
    STREAM_OPTIONS_UNSUPPORTED,
    Neutral,
)

# The engine holds integers as 64-bit values. Written as an inclusive maximum: an exclusive
# 2**63 is not a float-exact bound, and schema tools that compare through floats misread it.
INT64_MAX = 2**63 - 1

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Prompt = (
    str
    | Annotated[list[str], Field(min_length=1)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1)]
)


class APIError(Exception):
    """A client mistake, answered with an OpenAI-style error body and a 4xx status.

    Deliberately not a `ValueError`: raised inside a pydantic validator it propagates as is
    instead of being folded into a generic validation error that would lose `param`."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status
        self.type = type

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": _encodable(clip(self.message, MAX_MESSAGE_CHARS)),
                "type": self.type,
                "param": None if self.param is None else _encodable(clip(self.param)),
                "code": self.code,
            }
        }


# Messages quote client input (a field name, a value): a megabyte-long key must not come back
# as a megabyte-long error.
MAX_MESSAGE_CHARS = 2000
MAX_QUOTED_CHARS = 200


def clip(text: str, limit: int = MAX_QUOTED_CHARS) -> str:
    """`text`, or its first `limit` characters and how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def _encodable(text: str) -> str:
    """`text` with what UTF-8 cannot encode (lone surrogates) written as `\\udXXX` escapes:
    messages quote client input, and an error body must always encode."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _check_text(data: dict | list) -> None:
    """Refuses a string in a parsed JSON body (a key or a value, at any depth) that is not
    valid Unicode, naming its path as pydantic would ("messages.0.content"). JSON can spell a
    lone UTF-16 surrogate (`"\\ud800"`); UTF-8, the tokenizer and every JSON encoder cannot
    take one. Iterative, since the depth is the client's; a path is built only for a container
    or a non-ASCII string (`isascii` is O(1)), so a long list of token ids costs one pass."""
    stack: list[tuple[tuple[str, ...], dict | list]] = [((), data)]
    while stack:
        path, container = stack.pop()
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for label, item in items:
            if isinstance(label, str) and not label.isascii():
                _check_string(path + (label,), label)
            if isinstance(item, str):
                if not item.isascii():
                    _check_string(path + (str(label),), item)
            elif isinstance(item, (dict, list)):
                stack.append((path + (str(label),), item))


def _check_string(path: tuple[str, ...], text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        param = ".".join(path)
        raise APIError(
            f"Invalid value for {param!r}: the text is not valid Unicode (a lone UTF-16"
            f" surrogate, U+{ord(text[exc.start]):04X}, at character {exc.start}); send"
            " UTF-8 text",
            param=param,
            code="invalid_value",
        ) from None


def strip_neutral_unsupported(data: Any, unsupported: dict[str, Neutral], prefix: str = "") -> Any:
    """Refuse a non-neutral unsupported field; drop the neutral ones so `extra="forbid"`
    still catches genuinely unknown names. `prefix` makes `param` the field's path."""
    if not isinstance(data, dict):
        return data
    kept = {}
    for key, value in data.items():
        neutral = unsupported.get(key)
        if neutral is None:
            kept[key] = value
        elif key in DISAGGREGATION_FIELDS and value is not None:
            raise APIError(
                f"{prefix}{key}={clip(repr(value))}: Lockstep does not support prefill/decode"
                " disaggregation yet; run its replicas as regular workers behind a router"
                " without a PD mode (docs/scale-out.md)",
                param=prefix + key,
                code="unsupported_parameter",
            )
        elif not neutral(value):
            raise APIError(
                f"{prefix}{key}={clip(repr(value))} is not supported by Lockstep; leave it out"
                " (or send its neutral value: docs/server.md lists them)",
                param=prefix + key,
                code="unsupported_parameter",
            )
    return kept


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class RequestBody(StrictModel):
    """A whole request body: its text is checked once, here, before any field."""

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _check_text(data)
        return data


class StreamOptions(StrictModel):
    include_usage: bool | None = Field(
        None, description="a last chunk with the usage (default: continuous_usage_stats)"
    )
    continuous_usage_stats: bool = Field(
        False, description="vLLM extension: every chunk carries its choice's usage so far"
    )

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return strip_neutral_unsupported(data, STREAM_OPTIONS_UNSUPPORTED, "stream_options.")


# The logits-processing fields (lockstep/server/processing_fields.py translates them).
class JsonSchemaFormat(StrictModel):
    """OpenAI's `response_format.json_schema`. The schema is always enforced (`strict`
    true or false)."""

    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(StrictModel):
    """vLLM's `structured_outputs` object: one of json, regex, choice, grammar, json_object.
    The other fields of vLLM's are accepted at their defaults only."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: Literal[False] = False
    disable_any_whitespace: Literal[False] = False
    disable_additional_properties: Literal[False] = False
    whitespace_pattern: None = None
    structural_tag: None = None


class ProcessingFields(RequestBody):
    """The logits-processing fields of both OpenAI routes (vLLM's names and ranges)."""

    presence_penalty: float | None = Field(
        0.0, ge=-2.0, le=2.0, description="minus this for every token the output holds"
    )
    frequency_penalty: float | None = Field(
        0.0, ge=-2.0, le=2.0, description="minus this per occurrence in the output"
    )
    repetition_penalty: float | None = Field(
        1.0,
        gt=0.0,
        le=100.0,
        description="vLLM extension: tokens of the prompt or output, logit / r if > 0 else * r",
    )
    min_tokens: int = Field(
        0, ge=0, lt=2**63, description="vLLM extension: no EOS, stop id or stop string before"
    )
    logit_bias: dict[str, float] | None = Field(
        None, max_length=1024, description="token id -> bias in [-100, 100], added to its logit"
    )
    bad_words: list[str] | None = Field(
        None, max_length=64, description="vLLM extension: words the output never completes"
    )
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object or json_schema (always enforced)"
    )
    structured_outputs: StructuredOutputsParams | None = Field(
        None, description="vLLM extension: json, regex, choice, grammar or json_object"
    )
    guided_json: str | dict[str, Any] | None = Field(
        None, description="vLLM extension: a JSON schema the output follows"
    )
    guided_regex: str | None = Field(None, description="vLLM extension: the output's regex")
    guided_choice: list[str] | None = Field(
        None, description="vLLM extension: the output is one of these"
    )
    guided_grammar: str | None = Field(
        None, description="vLLM extension: a Lark or GBNF grammar the output follows"
    )
    regex: str | None = Field(None, description="SGLang extension: the output matches this regex")
    ebnf: str | None = Field(
        None, description="SGLang extension: the output follows this GBNF/EBNF grammar"
    )


class _SamplingFields(ProcessingFields):
    """Fields shared by completions and chat completions."""

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=INT64_MAX, description="0 or -1 disables it (vLLM extension)")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="vLLM extension")
    seed: int | None = Field(
        None, ge=0, le=INT64_MAX, description="choice i of n is sampled with seed + i"
    )
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = Field(
        None, max_length=64, description="vLLM extension"
    )
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256, description="recorded in the request log")
    ignore_eos: bool = Field(False, description="vLLM extension: do not stop at EOS")
    include_stop_str_in_output: bool = Field(False, description="vLLM extension")
    no_stop_trim: bool = Field(
        False, description="SGLang extension: the same as include_stop_str_in_output"
    )
    skip_special_tokens: bool = Field(
        True, description="vLLM extension: leave control tokens out of the text"
    )
    spaces_between_special_tokens: bool = Field(
        True, description="vLLM extension; the fast tokenizers decode the same either way"
    )
    cache_salt: str | None = Field(
        None,
        max_length=256,
        description="vLLM extension: requests share prefix-cache entries only with the same salt",
    )
    return_token_ids: bool = Field(
        False, description="vLLM extension: add prompt_token_ids and token_ids to choices"
    )
    return_tokens_as_token_ids: bool = Field(
        False, description='vLLM extension: logprob tokens written as "token_id:N"'
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
        description="vLLM extension: the logprob of every prompt token, with this many"
        " alternatives",
    )
    truncate_prompt_tokens: int | None = Field(
        None,
        ge=-1,
        le=INT64_MAX,
        description="vLLM extension: keep the last k prompt tokens (-1: as many as fit)",
    )
    extra_key: str | None = Field(
        None,
        max_length=256,
        description="SGLang extension: requests share prefix-cache entries only with the same"
        " key (and cache_salt)",
    )
    # Accepted with any value: ids and labels that cannot change the output.
    rid: str | Annotated[list[str], Field(max_length=256)] | None = Field(
        None, description="SGLang extension, accepted: the client's request id, logged"
    )
    session_id: str | None = Field(
        None, max_length=256, description="SGLang extension, accepted: an identity only"
    )
    custom_labels: dict[str, str] | None = Field(
        None, max_length=64, description="SGLang extension, accepted: metric labels"
    )

    @property
    def cache_namespace(self) -> str | None:
        """The prefix-cache namespace: vLLM's `cache_salt` and SGLang's `extra_key`
        together (`cache_namespace`)."""
        return cache_namespace(self.extra_key, self.cache_salt)

    @property
    def keeps_stop_string(self) -> bool:
        """Whether the matched stop string stays in the text: vLLM's and SGLang's names for
        it, either one asking (routers send SGLang's at its default, false)."""
        return self.include_stop_str_in_output or self.no_stop_trim


def cache_namespace(extra_key: str | None, cache_salt: str | None) -> str | None:
    """One prefix-cache namespace from SGLang's `extra_key` and vLLM's `cache_salt`:
    requests share cache entries only when both are equal (None when neither is sent)."""
    if extra_key is None and cache_salt is None:
        return None
    return json.dumps([extra_key, cache_salt])


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    json_schema: str | None = Field(
        None, description="SGLang extension: the output follows this JSON schema (its text)"
    )
    max_tokens: int | None = Field(16, ge=0, le=INT64_MAX, description="0: with echo, scoring only")
    max_completion_tokens: int | None = Field(
        None, ge=1, le=INT64_MAX, description="Lockstep extension: the same limit as max_tokens"
    )
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=16, description="accepted when equal to n")
    add_special_tokens: bool = Field(True, description="vLLM extension: the tokenizer's BOS")

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return strip_neutral_unsupported(data, COMPLETION_UNSUPPORTED)


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: str
    arguments: str | dict[str, Any] = Field(
        description="JSON text, as OpenAI writes it, or the object itself"
    )


class ToolCall(StrictModel):
    """A tool call an assistant made earlier in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    """One message; which fields fit which role is checked where the prompt is rendered
    (`chat_prompt.py`), so that the error can name the message."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = Field(None, description="passed to the chat template")
    tool_calls: list[ToolCall] | None = Field(None, description="assistant messages")
    tool_call_id: str | None = Field(None, description="tool messages")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


Messages = Annotated[list[ChatMessage], Field(min_length=1)]


class FunctionDefinition(StrictModel):
    """A function the model may call (tools.py: how it reaches the template and a grammar)."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = Field(
        None, description="true: calls match `parameters`; needs tool_choice required or named"
    )


class ToolDefinition(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


def _neutral_message_fields(data: Any) -> Any:
    """Drops the neutral assistant fields a client echoing a reply back sends (`refusal:
    null`), refusing the others with their path (`messages.2.refusal`)."""
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        return data
    messages = [
        strip_neutral_unsupported(m, MESSAGE_UNSUPPORTED, f"messages.{i}.")
        for i, m in enumerate(data["messages"])
    ]
    return {**data, "messages": messages}


class ChatCompletionRequest(_SamplingFields):
    messages: Messages
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX, description="deprecated alias")
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = Field(
        False, description="vLLM extension: the reply starts with the final message it continues"
    )
    add_generation_prompt: bool = Field(True, description="vLLM extension")
    continue_final_message: bool = Field(
        False, description="vLLM extension: the model carries on the final message"
    )
    add_special_tokens: bool = Field(
        False, description="vLLM extension: the tokenizer's BOS on top of the template's"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM extension: further variables for the chat template"
    )
    documents: list[dict[str, str]] | None = Field(
        None, description="vLLM extension: the template's `documents` (RAG)"
    )
    tools: Annotated[list[ToolDefinition], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto with tools, none without"
    )
    parallel_tool_calls: bool | None = Field(
        None, description="default true; false: at most one call per reply"
    )

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return _neutral_message_fields(strip_neutral_unsupported(data, CHAT_UNSUPPORTED))


class ScoreRequest(RequestBody):
    """Teacher-forced logprobs of given text (Lockstep's `/v1/score`, see docs/server.md)."""

    model: str
    prompt: Prompt | None = None
    messages: Messages | None = None
    top_logprobs: int = Field(0, ge=0, le=20)
    add_special_tokens: bool = Field(
        True, description="for a text prompt: let the tokenizer add its special tokens"
    )
    cache_salt: str | None = Field(None, max_length=256)

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return _neutral_message_fields(data)


class TokenizeRequest(RequestBody):
    """vLLM's `/tokenize`: a text prompt, or chat messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: bool | None = Field(
        None, description="default: true for a prompt, false for messages (the template)"
    )
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return _neutral_message_fields(data)


class DetokenizeRequest(RequestBody):
    """vLLM's `/detokenize`: token ids back to text."""

    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0, le=INT64_MAX)]], Field(max_length=1 << 20)]
