"""The model families Lockstep serves from Hugging Face folders, one module each, behind one
registry keyed by config.json's `model_type` (or, without one, its `architectures`). To add a
family: a module here with its `FAMILY`, listed in `FAMILIES` (docs/map.md)."""

from __future__ import annotations

from typing import Any

from lockstep.errors import ModelLoadError
from lockstep.models.families import (
    deepseek_v2,
    deepseek_v3,
    gemma3,
    glm4_moe_lite,
    llama,
    mistral,
    phi3,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)
from lockstep.models.families.base import Family
from lockstep.models.moe import refuse_unsupported_moe

__all__ = ["FAMILIES", "Family", "family_named", "family_of"]

FAMILIES: tuple[Family, ...] = tuple(
    m.FAMILY
    for m in (
        llama,
        mistral,
        phi3,
        qwen2,
        qwen3,
        qwen3_moe,
        qwen3_5,
        qwen3_5_moe,
        qwen3_next,
        gemma3,
        deepseek_v2,
        deepseek_v3,
        glm4_moe_lite,
    )  # fmt: skip
)
SUPPORTED_MODEL_TYPES = tuple(t for f in FAMILIES for t in f.model_types)
_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}
_BY_ARCHITECTURE = {a: f for f in FAMILIES for a in f.architectures}
_BY_NAME = {f.name: f for f in FAMILIES}


def family_named(name: str) -> Family:
    """The family a `ModelSpec.family` names (every spec is built by one of `FAMILIES`)."""
    return _BY_NAME[name]


def family_of(config: dict[str, Any], where: str) -> Family:
    """The family of a config.json, by `model_type`, else by its first known `architectures`
    entry; an unknown one is refused in one line listing the supported model types."""
    # Before the model_type: "a shared expert" says more than "deepseek_v3 is not supported".
    refuse_unsupported_moe(config, where)
    if isinstance(config.get("text_config"), dict):  # a multimodal wrapper's text model
        refuse_unsupported_moe(config["text_config"], where)
    model_type = config.get("model_type")
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    architectures = config.get("architectures") or []
    known = [_BY_ARCHITECTURE[a] for a in architectures if a in _BY_ARCHITECTURE]
    if model_type is None and known:
        return known[0]
    raise ModelLoadError(
        f"{where}: model_type {model_type!r} is not supported; supported: "
        f"{', '.join(SUPPORTED_MODEL_TYPES)} (the config's architectures: {architectures})"
    )
