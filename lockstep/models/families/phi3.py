"""Phi-3 and Phi-4-mini (Phi3ForCausalLM, model_type phi3): Llama's layers stored fused, with
LongRoPE and an optional sliding window.

The checkpoint fuses q | k | v into `self_attn.qkv_proj` and gate | up into
`mlp.gate_up_proj`; the loader reads each canonical projection as its rows of the fused
tensor (`parts`), which the attention and MLP blocks fuse again in the same order, so no value
moves. RoPE (`rope_parameters`, or the older `rope_scaling` with a top-level
`original_max_position_embeddings`): default, or "longrope" with its short and long factors
(`LongRopeScaling`: by position, lockstep/models/rope.py), rotating the first
`partial_rotary_factor` of each head (Phi-4-mini: 0.75). `sliding_window` (Phi-3-mini-4k:
2047) windows every layer, as Mistral's does.
"""

from __future__ import annotations

import math
from typing import Any

from lockstep.errors import ModelLoadError
from lockstep.models.families.base import Family, Parts, decoder_spec, sliding_spec
from lockstep.models.spec import LongRopeScaling, ModelSpec


def _longrope(config: dict[str, Any], params: dict[str, Any], where: str) -> LongRopeScaling:
    """transformers' _compute_longrope_parameters: the attention factor, where the config
    does not set one, from the context's extension factor (max over original positions)."""
    try:
        original = int(params.get("original_max_position_embeddings")
                       or config["original_max_position_embeddings"])  # fmt: skip
        short, long = params["short_factor"], params["long_factor"]
    except KeyError as exc:
        raise ModelLoadError(f"{where}: longrope RoPE scaling lacks {exc.args[0]}") from None
    factor = params.get("factor") or int(config.get("max_position_embeddings", original)) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    try:
        return LongRopeScaling(tuple(map(float, short)), tuple(map(float, long)), original,
                               float(attention))  # fmt: skip
    except ValueError as exc:
        raise ModelLoadError(f"{where}: {exc}") from None


def spec(config: dict[str, Any], where: str) -> ModelSpec:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "longrope"):
        raise ModelLoadError(
            f"{where}: rope_type {rope_type!r} is not supported; supported: default, longrope"
        )
    longrope = _longrope(config, params, where) if rope_type == "longrope" else None
    # The base and rotated share, read by decoder_spec as a plain RoPE's.
    plain = {k: params[k] for k in ("rope_theta", "partial_rotary_factor") if k in params}
    config = {**config, "rope_parameters": {**plain, "rope_type": "default"}}
    return decoder_spec(
        config, where, "phi3", sliding=sliding_spec(config, where), longrope=longrope
    )


def parts(name: str, spec: ModelSpec) -> Parts:
    """q, k and v as rows of qkv_proj; gate and up as rows of gate_up_proj."""
    if name.endswith(".self_attn.qkv_proj.weight"):
        module, q, kv = name.removesuffix("qkv_proj.weight"), spec.q_size, spec.kv_size
        return ((module + "q_proj.weight", slice(0, q)),
                (module + "k_proj.weight", slice(q, q + kv)),
                (module + "v_proj.weight", slice(q + kv, q + 2 * kv)))  # fmt: skip
    if name.endswith(".mlp.gate_up_proj.weight"):
        module, i = name.removesuffix("gate_up_proj.weight"), spec.intermediate_size
        return ((module + "gate_proj.weight", slice(0, i)),
                (module + "up_proj.weight", slice(i, 2 * i)))  # fmt: skip
    return ((name, None),)


FAMILY = Family("phi3", ("phi3",), ("Phi3ForCausalLM",), spec, parts=parts)
