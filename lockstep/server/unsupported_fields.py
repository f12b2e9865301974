"""Request fields the OpenAI routes know but do not implement, per route.

Each is OpenAI's or vLLM's. It is accepted only at its neutral value (the value that asks
for nothing Lockstep lacks, usually the field's default) and dropped; any other value is
refused with a 400 whose `param` names it (`protocol.strip_neutral_unsupported`).
docs/server.md's request-field table lists every one of them with the reason, and
tests/test_server_field_table.py holds the table and these dicts to each other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Neutral = Callable[[Any], bool]


def _none(value: Any) -> bool:
    return value is None


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {}


def _zero(value: Any) -> bool:
    return value is None or value == 0


def _one(value: Any) -> bool:
    return value is None or value == 1


def _false(value: Any) -> bool:
    return value is None or value is False


def _bool(value: Any) -> bool:
    return value is None or isinstance(value, bool)


_SHARED: dict[str, Neutral] = {
    # Server-side Python logits processors, an allow-list, the grammar backend's name (one
    # backend: llguidance), a whitespace pattern (JSON's layout is fixed) and vLLM's
    # repetition-pattern detection.
    "allowed_token_ids": _none,
    "logits_processors": _none,
    "guided_decoding_backend": _none,
    "guided_whitespace_pattern": _none,
    "max_repetition_pattern_size": _zero,
    "min_repetition_pattern_size": _zero,
    "repetition_min_count": _zero,
    # Beam search, priorities, disaggregation, custom extensions.
    "use_beam_search": _false,
    "length_penalty": _one,
    "priority": _zero,
    "request_id": _none,
    "kv_transfer_params": _none,
    "vllm_xargs": _none,
    # SGLang's: hidden states are not returned.
    "return_hidden_states": _false,
}

COMPLETION_UNSUPPORTED: dict[str, Neutral] = {
    **_SHARED,
    "suffix": lambda v: v is None or v == "",
    "prompt_embeds": _empty,
}

CHAT_UNSUPPORTED: dict[str, Neutral] = {
    **_SHARED,
    "functions": _empty,
    "function_call": lambda v: v is None or v == "none",
    "chat_template": _none,
    "mm_processor_kwargs": _empty,
    "media_io_kwargs": _empty,
    "include_reasoning": lambda v: v is None or v is True,
    "reasoning_effort": _none,
    "modalities": lambda v: v is None or v == ["text"],
    "audio": _none,
    "prediction": _none,
    "web_search_options": _none,
    "service_tier": lambda v: v is None or v == "auto",
    "store": _false,
    "metadata": _empty,
    "verbosity": _none,
    "prompt_cache_key": _none,
    "prompt_cache_retention": _none,
    "safety_identifier": _none,
    # SGLang's reasoning-parser switches (routers send them at SGLang's defaults, true): with
    # no reasoning parser, which Lockstep has not, SGLang leaves the reply whole either way.
    "separate_reasoning": _bool,
    "stream_reasoning": _bool,
}

STREAM_OPTIONS_UNSUPPORTED: dict[str, Neutral] = {"include_obfuscation": _false}

# Assistant-message fields of OpenAI's that a client echoing a reply back sends as null.
MESSAGE_UNSUPPORTED: dict[str, Neutral] = {
    "refusal": _none,
    "audio": _none,
    "function_call": _none,
}

UNSUPPORTED_FIELDS: dict[str, dict[str, Neutral]] = {
    "completions": COMPLETION_UNSUPPORTED,
    "chat": CHAT_UNSUPPORTED,
    "stream_options": STREAM_OPTIONS_UNSUPPORTED,
    "messages": MESSAGE_UNSUPPORTED,
}
