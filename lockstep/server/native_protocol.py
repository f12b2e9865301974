"""Request bodies of SGLang's native API (`/generate` and its companions, docs/server.md).

The fields are SGLang's (0.5.5, and what 0.5.23 added), with its names and defaults, held to
the same kinds as the OpenAI bodies (protocol.py): implemented fields are declared; fields
that cannot change the output (ids, labels, routing hints) are declared too, with a
description that starts "accepted:"; SGLang fields Lockstep does not implement are accepted
only at their neutral value and otherwise refused with a 400 naming them (`UNSUPPORTED_*`);
anything else is refused as unrecognized. Strict types, strings
checked to be valid Unicode, integers below 2**63.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from lockstep.server.protocol import (
    INT64_MAX,
    RequestBody,
    StrictModel,
    TokenIds,
    strip_neutral_unsupported,
)

Int64 = Annotated[int, Field(ge=0, le=INT64_MAX)]


def _none(value: Any) -> bool:
    return value is None


def _false(value: Any) -> bool:
    return value is None or value is False


def _zero(value: Any) -> bool:
    return value is None or value == 0


def _one(value: Any) -> bool:
    return value is None or value == 1


# SGLang sampling fields with no Lockstep implementation, each with its neutral value's test
# (SGLang 0.5.5's SamplingParams, and what 0.5.23 added).
UNSUPPORTED_SAMPLING: dict[str, Any] = {
    "stop_regex": _none,
    "structural_tag": _none,
    "custom_params": _none,
    "stream_interval": _one,
    "sampling_seed_list": _none,
    "beam_width": lambda v: v is None or v in (0, 1),
    "watermark": _none,
}

# SGLang request fields with no Lockstep implementation, each with its neutral value's test:
# SGLang 0.5.5's GenerateReqInput and what 0.5.23 added (multimodal inputs and their
# settings, LoRA, hidden states and other extra outputs, sessions, reasoning budgets,
# disaggregation (refused with its own message, protocol.DISAGGREGATION_FIELDS), the
# server's internal bookkeeping).
UNSUPPORTED_GENERATE: dict[str, Any] = {
    "input_embeds": _none,
    "image_data": _none,
    "video_data": _none,
    "audio_data": _none,
    "modalities": _none,
    "mm_hashes": _none,
    "mm_content_hashes": _none,
    "use_audio_in_video": _false,
    "video_config": _none,
    "images_config": _none,
    "mm_processor_kwargs": _none,
    "max_dynamic_patch": _none,
    "min_dynamic_patch": _none,
    "image_max_dynamic_patch": _none,
    "video_max_dynamic_patch": _none,
    "positional_embed_overrides": _none,
    "need_wait_for_mm_inputs": _none,
    "num_items_assigned": _none,
    "encoder_urls": _none,
    "watermark": _none,
    "token_ids_logprob": _none,
    "return_sampling_mask": _false,
    "sampling_logprobs_mode": _none,
    "return_flat_raw_top_logprobs": _false,
    "return_flat_raw_output_top_logprobs": _false,
    "return_flat_raw_top_logprobs_b64": _false,
    "return_hidden_states": _false,
    "routed_experts_start_len": _zero,
    "return_indexer_topk": _false,
    "return_entropy": _false,
    "return_bytes": _false,
    "return_prompt_token_ids": _false,
    "multi_item_delimiter_indices": _none,
    "token_indices_to_pool": _none,
    "session_params": _none,
    "lora_path": _none,
    "lora_id": _none,
    "custom_logit_processor": _none,
    "require_reasoning": _false,
    "max_thinking_tokens": _none,
    "bootstrap_host": _none,
    "bootstrap_port": _none,
    "bootstrap_room": _none,
    "bootstrap_pair_key": _none,
    "decode_tp_size": _none,
    "disagg_prefill_dp_rank": _none,
    "kv_hints": _none,
    # Data-parallel ranks inside one server: Lockstep has one, rank 0.
    "data_parallel_rank": _zero,
    "routed_dp_rank": _zero,
    "priority": _zero,
    "background": _false,
    # Filled in by SGLang's own HTTP server: a client has no reason to send them.
    "validation_time": _none,
    "received_time": _none,
    "http_worker_ipc": _none,
}


class NativeSamplingParams(StrictModel):
    """SGLang's `sampling_params` object."""

    max_new_tokens: int = Field(128, ge=0, le=INT64_MAX, description="0: score the input only")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0: greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=INT64_MAX, description="-1 (or 0) disables it")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    stop_token_ids: list[Int64] | None = Field(None, max_length=64)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = Field(
        True, description="accepted: the fast tokenizers decode the same either way"
    )
    no_stop_trim: bool = Field(False, description="keep the matched stop string in the text")
    n: int = Field(1, ge=1, le=16, description="sample i of n uses sampling_seed + i")
    sampling_seed: Int64 | None = Field(None, description="the per-request seed")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="minus this per occurrence")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="minus this once per token")
    repetition_penalty: float = Field(
        1.0, gt=0.0, le=100.0, description="tokens of the prompt or output: / r if > 0 else * r"
    )
    min_new_tokens: int = Field(0, ge=0, lt=2**63, description="no EOS or stop before")
    logit_bias: dict[str, float] | None = Field(
        None, max_length=1024, description="token id -> bias in [-100, 100], added to its logit"
    )
    regex: str | None = Field(None, description="the output matches this regex")
    json_schema: str | None = Field(None, description="the output follows this JSON schema")
    ebnf: str | None = Field(None, description="the output follows this GBNF/EBNF grammar")

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return strip_neutral_unsupported(data, UNSUPPORTED_SAMPLING, "sampling_params.")


PerItem = Annotated[list[Any], Field(min_length=1)]


class GenerateRequest(RequestBody):
    """SGLang's `POST /generate`: one prompt or a batch, as `text` or `input_ids`; each
    per-request field is one value for all, or a list with one per prompt."""

    text: str | Annotated[list[str], Field(min_length=1)] | None = None
    input_ids: TokenIds | Annotated[list[TokenIds], Field(min_length=1)] | None = None
    sampling_params: (
        NativeSamplingParams | Annotated[list[NativeSamplingParams], Field(min_length=1)] | None
    ) = None
    rid: str | Annotated[list[str], Field(min_length=1)] | None = None
    return_logprob: bool | Annotated[list[bool], Field(min_length=1)] | None = None
    logprob_start_len: int | Annotated[list[int], Field(min_length=1)] | None = None
    top_logprobs_num: int | Annotated[list[int], Field(min_length=1)] | None = None
    return_text_in_logprobs: bool = False
    return_routed_experts: bool | Annotated[list[bool], Field(min_length=1)] | None = Field(
        None,
        description="MoE models served with --enable-return-routed-experts: meta_info."
        "routed_experts, base64 of int32 [prompt + output - 1, num_hidden_layers, top_k]",
    )
    stream: bool = False
    log_metrics: bool = Field(True, description="accepted: the metrics count every request")
    no_logs: bool = Field(False, description="accepted: the request log holds no prompt text")
    model: str | None = Field(
        None, max_length=256, description="accepted: a router's field; one model is served"
    )
    extra_key: str | None = Field(
        None,
        max_length=256,
        description="requests share prefix-cache entries only with the same key",
    )
    cache_salt: str | None = Field(
        None,
        max_length=256,
        description="requests share prefix-cache entries only with the same salt (and extra_key)",
    )
    # Accepted with any value: ids, labels and routing hints that cannot change the output.
    conversation_id: str | None = Field(None, max_length=256, description="accepted: logging")
    session_id: str | None = Field(None, max_length=256, description="accepted: an identity only")
    routing_key: str | None = Field(None, max_length=256, description="accepted: a routing hint")
    custom_labels: dict[str, str] | None = Field(
        None, max_length=64, description="accepted: metric labels"
    )
    external_trace_header: dict[str, Any] | None = Field(
        None, max_length=64, description="accepted: trace context"
    )

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return strip_neutral_unsupported(data, UNSUPPORTED_GENERATE)


class AbortRequest(RequestBody):
    """SGLang's `POST /abort_request`."""

    rid: str = ""
    abort_all: bool = False


class UpdateWeightsFromDiskRequest(RequestBody):
    """SGLang's `POST /update_weights_from_disk`."""

    model_path: str = Field(min_length=1, max_length=4096)
    load_format: str | None = Field(None, description="None or 'auto': the format is detected")
    abort_all_requests: bool = Field(
        False, description="abort requests in flight instead of letting them finish first"
    )
    weight_version: str | None = Field(None, max_length=256)
    flush_cache: bool = Field(True, description="must be true: the cached KV is the old model's")
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = Field(0, ge=0, le=INT64_MAX)
