"""Request fields the OpenAI routes know but do not implement, per route.

Each is OpenAI's, vLLM's or SGLang's. It is accepted only at its neutral value (the value that asks
for nothing Lockstep lacks, usually the field's default) and dropped; any other value is
refused with a 400 whose `param` names it (`protocol.strip_neutral_unsupported`).
docs/server.md's request-field table lists every one of them with the reason, and
tests/server/test_server_field_table.py holds the table and these dicts to each other.
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


# Fields that carry prefill/decode disaggregation (SGLang's bootstrap fields, which
# sglang-router's PD mode adds; vLLM's KV-transfer parameters). Neutral at null; any other
# value is refused with a message of its own (`protocol.strip_neutral_unsupported`), since a
# router that sends them expects a prefill or decode worker, which Lockstep is not.
DISAGGREGATION_FIELDS = frozenset(
    {"bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
     "decode_tp_size", "disagg_prefill_dp_rank", "kv_transfer_params", "ec_transfer_params"}
)  # fmt: skip

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
    "ec_transfer_params": _none,
    # vLLM 0.34's: watermarks, thinking budgets, more outputs, repetition detection (the
    # newer form of the fields above), chunked streaming, multimodal payloads. Lockstep cuts
    # a prompt on the left (`truncate_prompt_tokens` keeps the last tokens), vLLM's default.
    "watermarking": _false,
    "thinking_token_budget": _none,
    "truncation_side": lambda v: v is None or v == "left",
    "logprob_token_ids": _none,
    "return_weight_versions": _false,
    "routed_experts_prompt_start": _zero,
    "return_token_offsets": _false,
    "repetition_detection": _none,
    "stream_interval": _one,
    "mm_payload": lambda v: v is None or v == "tensors",
    "return_mm_kwargs": _bool,
    # SGLang's (0.5.5, and what 0.5.23 added): hidden states and other extra outputs, stop
    # regexes, LoRA, sessions, server-side logits processors, watermarks, multimodal
    # settings, disaggregation (DISAGGREGATION_FIELDS) and data-parallel ranks (one here).
    "return_hidden_states": _false,
    "return_routed_experts": _false,
    "routed_experts_start_len": _zero,
    "return_cached_tokens_details": _false,
    "return_spec_tokens_details": _false,
    "stop_regex": _none,
    "lora_path": _none,
    "session_params": _none,
    "custom_params": _none,
    "custom_logit_processor": _none,
    "watermark": _none,
    "images_config": _none,
    "mm_processor_kwargs": _empty,
    "bootstrap_host": _none,
    "bootstrap_port": _none,
    "bootstrap_room": _none,
    "disagg_prefill_dp_rank": _none,
    "data_parallel_rank": _zero,
    "routed_dp_rank": _zero,
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
    # SGLang 0.5.23's chat extras: more outputs, a thinking config and task for templates that
    # define them, multimodal settings, prompt ids in place of the rendered messages.
    "return_prompt_token_ids": _false,
    "return_meta_info": _false,
    "return_input_ids_in_sglext": _false,
    "return_output_ids_in_sglext": _false,
    "return_sampling_mask": _false,
    "sampling_logprobs_mode": _none,
    "return_flat_raw_output_top_logprobs": _false,
    "return_flat_raw_top_logprobs_b64": _false,
    "thinking": _none,
    "task": _none,
    "max_dynamic_patch": _none,
    "min_dynamic_patch": _none,
    "use_audio_in_video": _false,
    "video_config": _none,
    "input_ids": _none,
    # vLLM 0.34's: the rendered prompt text in the response.
    "return_prompt_text": _false,
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
