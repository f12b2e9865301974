"""Request bodies of the OpenAI-compatible API, as strict pydantic models.

Three kinds of field, each handled on purpose (STYLE.md: honour the API you claim):

- implemented fields, declared below with their ranges (the OpenAPI schema shows them);
- OpenAI fields Lockstep does not implement (`UNSUPPORTED_FIELDS`): accepted only at their
  neutral value (e.g. `presence_penalty: 0`), otherwise refused with a 400 naming the field;
- anything else: refused as an unrecognized argument (`extra="forbid"`).

Models are strict, so `"temperature": "1"` or `"max_tokens": true` is a 400, not a coercion.
Integers end below 2**63 (the engine holds them as 64-bit values) or within a tighter declared
range; token ids are checked against the vocabulary in `preparation.py`. Before any field is
validated, every string of a body, keys included, is checked to be valid Unicode (`RequestBody`), so
no lone surrogate reaches the tokenizer or a JSON encoder.
Response bodies are plain dicts built in `responses.py`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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


def _is_neutral_response_format(value: Any) -> bool:
    return value is None or value == {"type": "text"}


# OpenAI fields with no Lockstep implementation, each with the test for its neutral value.
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "presence_penalty": lambda v: v is None or v == 0,
    "frequency_penalty": lambda v: v is None or v == 0,
    "repetition_penalty": lambda v: v is None or v == 1,
    "logit_bias": lambda v: v is None or v == {},
    "best_of": lambda v: v is None or v == 1,
    "suffix": lambda v: v is None or v == "",
    "tools": lambda v: v is None or v == [],
    "tool_choice": lambda v: v is None or v == "none",
    "parallel_tool_calls": lambda v: v is None,
    "functions": lambda v: v is None or v == [],
    "function_call": lambda v: v is None or v == "none",
    "response_format": _is_neutral_response_format,
    "modalities": lambda v: v is None or v == ["text"],
    "audio": lambda v: v is None,
    "prediction": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "service_tier": lambda v: v is None or v == "auto",
    "store": lambda v: v is None or v is False,
    "metadata": lambda v: v is None or v == {},
    "verbosity": lambda v: v is None,
    "prompt_cache_key": lambda v: v is None,
    "safety_identifier": lambda v: v is None,
}


def strip_neutral_unsupported(
    data: Any, unsupported: dict[str, Any] = UNSUPPORTED_FIELDS, prefix: str = ""
) -> Any:
    """Refuse a non-neutral unsupported field; drop the neutral ones so `extra="forbid"`
    still catches genuinely unknown names. `prefix` makes `param` the field's path."""
    if not isinstance(data, dict):
        return data
    kept = {}
    for key, value in data.items():
        neutral = unsupported.get(key)
        if neutral is None:
            kept[key] = value
        elif not neutral(value):
            raise APIError(
                f"{prefix}{key}={clip(repr(value))} is not supported by Lockstep; leave it out"
                " (or send its neutral value)",
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
    include_usage: bool = False


class _SamplingFields(RequestBody):
    """Fields shared by completions and chat completions."""

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, lt=2**63, description="0 or -1 disables it (Lockstep extension)")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Lockstep extension")
    seed: int | None = Field(
        None, ge=0, lt=2**63, description="choice i of n is sampled with seed + i"
    )
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=2**63)]] | None = Field(
        None, max_length=64, description="Lockstep extension"
    )
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256, description="recorded in the request log")
    ignore_eos: bool = Field(False, description="Lockstep extension: do not stop at EOS")
    include_stop_str_in_output: bool = Field(False, description="Lockstep extension")
    skip_special_tokens: bool = Field(
        True, description="vLLM extension: leave control tokens out of the text"
    )
    cache_salt: str | None = Field(
        None,
        max_length=256,
        description="Lockstep extension: requests share prefix-cache entries only with the same salt",
    )
    return_token_ids: bool = Field(
        False, description="Lockstep extension: add prompt_token_ids and token_ids to choices"
    )

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return strip_neutral_unsupported(data)


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1, lt=2**63)
    max_completion_tokens: int | None = Field(
        None, ge=1, lt=2**63, description="Lockstep extension: the same limit as max_tokens"
    )
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContentPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, lt=2**63, description="deprecated alias")
    max_completion_tokens: int | None = Field(None, ge=1, lt=2**63)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class ScoreRequest(RequestBody):
    """Teacher-forced logprobs of given text (Lockstep's `/v1/score`, see docs/server.md)."""

    model: str
    prompt: Prompt | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    top_logprobs: int = Field(0, ge=0, le=20)
    add_special_tokens: bool = Field(
        True, description="for a text prompt: let the tokenizer add its special tokens"
    )
    cache_salt: str | None = Field(None, max_length=256)


class TokenizeRequest(RequestBody):
    """vLLM's `/tokenize`: a text prompt, or chat messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = Field(
        None, description="default: true for a prompt, false for messages (the template)"
    )
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(RequestBody):
    """vLLM's `/detokenize`: token ids back to text."""

    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0, lt=2**63)]], Field(max_length=1 << 20)]
