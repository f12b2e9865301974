"""What a model family is, as Hugging Face checkpoints describe it, and the config reading the
families share.

A `Family` maps a config.json (its `model_type`, or its `architectures`) to a `ModelSpec`, and
each tensor name its checkpoints store to the canonical name (lockstep/models/spec.py), or to
None for a tensor that is not served (a vision tower); a checkpoint tensor that fuses several
canonical ones (Phi-3's qkv_proj) is read as their row ranges (`Family.parts`). Everything a family does not understand
is refused with one line naming the key, the value and what is supported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lockstep.errors import ModelLoadError
from lockstep.models.spec import ATTENTION_TYPES, ModelSpec, RopeScaling, SlidingWindowSpec

# Config keys every family here refuses when set (each would change the math without a flag
# in ModelSpec to carry it), with the value that is supported.
_REFUSED = (
    ("hidden_act", lambda v: v not in (None, "silu")),
    ("mlp_bias", bool),
    ("use_sliding_window", bool),
)
SUPPORTED_FEATURES = (
    "supported: Llama/Qwen2/Qwen3/Qwen3-MoE models with silu MLPs, no o_proj/MLP bias, no "
    "sliding window"
)


def same_name(key: str) -> str | None:
    """The checkpoint stores canonical names (what `save_pretrained` writes for these families)."""
    return key


# A checkpoint tensor's canonical parts: (canonical name, its rows of the tensor; None: all).
Parts = tuple[tuple[str, slice | None], ...]


def whole(name: str, spec: ModelSpec) -> Parts:
    """A checkpoint tensor that is one canonical tensor."""
    return ((name, None),)


@dataclass(frozen=True)
class Family:
    """One family: the `model_types` and `architectures` its configs carry, the config -> spec
    mapping (`spec(config, where)`, `where` naming the file for errors), the checkpoint
    tensor name -> canonical name mapping (None: not served) and, for a checkpoint tensor
    that fuses canonical ones, their rows (`parts(name, spec)`, after `tensor_name`; the
    loader reads each part as a slice of the stored rows, so no value changes).
    `mtp_tensor_name(key, num_layers)`: for a family whose checkpoints ship
    multi-token-prediction layers, each checkpoint tensor's name in the MTP drafter's model
    (lockstep/models/mtp.py: a one-layer decoder's canonical names, and `mtp.enorm`,
    `mtp.hnorm`, `mtp.eh_proj`), None for the rest; `mtp_example` names one such tensor."""

    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    spec: Callable[[dict[str, Any], str], ModelSpec]
    tensor_name: Callable[[str], str | None] = same_name
    parts: Callable[[str, ModelSpec], Parts] = whole
    mtp_tensor_name: Callable[[str, int], str | None] | None = None
    mtp_example: str = ""


def rope(config: dict[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from either transformers 5's rope_parameters or the older
    rope_theta + rope_scaling keys."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ModelLoadError(
            f"{where}: rope_type {rope_type!r} is not supported; supported: default, llama3"
        )
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(params["original_max_position_embeddings"]),
        )
    except KeyError as exc:
        raise ModelLoadError(f"{where}: llama3 RoPE scaling lacks {exc.args[0]}") from None
    return theta, scaling


def sliding_window(config: dict[str, Any]) -> int | None:
    """The window a config puts on its attention (None: none): `sliding_window`, unless
    `use_sliding_window` is false (Qwen2's and Qwen3's switch, which their configs set beside
    a window they do not apply)."""
    window = config.get("sliding_window")
    if window is None or config.get("use_sliding_window") is False:
        return None
    return int(window)


def sliding_spec(config: dict[str, Any], where: str) -> SlidingWindowSpec | None:
    """The window of a config whose attention layers share the model's RoPE (Mistral, Phi-3):
    None without a window; else on every layer, or on those `layer_types` names
    "sliding_attention" (Ministral)."""
    window = sliding_window(config)
    if window is None:
        return None
    layers = int(config.get("num_hidden_layers", 0))  # missing: decoder_spec says so
    types = config.get("layer_types") or ["sliding_attention"] * layers
    if not isinstance(types, list) or len(types) != layers:
        raise ModelLoadError(f"{where}: layer_types={types!r} must name one of {ATTENTION_TYPES} "
                             f"for each of the {layers} layers")  # fmt: skip
    try:  # refuses a layer type other than ATTENTION_TYPES
        return SlidingWindowSpec(window, tuple(types), rope_theta=None)
    except ValueError as exc:
        raise ModelLoadError(f"{where}: {exc}") from None


def decoder_spec(
    config: dict[str, Any],
    where: str,
    family: str,
    attention_bias: bool = False,
    rotary_default: float = 1.0,
    **flags: Any,
) -> ModelSpec:
    """The spec of a pre-norm RoPE decoder from the config keys every family here shares;
    `flags`: the family's own `ModelSpec` fields (qkv_bias, moe, ...), or callables of the
    layer count that make them. `attention_bias`: whether the config's attention_bias key may
    be true (Qwen2's q/k/v biases); elsewhere it would put a bias on o_proj too, which no
    block has. `rotary_default`: the share of each head RoPE rotates when the config does not
    say (partial_rotary_factor). A config whose attention has a sliding window
    (`sliding_window`) is refused unless the family reads it (passes `sliding`, None or a
    `SlidingWindowSpec`): a window is applied or refused, never ignored."""
    if "sliding" not in flags and sliding_window(config) is not None:
        raise ModelLoadError(
            f"{where}: sliding_window={config['sliding_window']!r} is not supported for "
            f"model_type {config.get('model_type')!r}; supported: null or use_sliding_window "
            "false (the Mistral and Gemma 3 families apply a window)"
        )
    for key, refused in _REFUSED:
        if refused(config.get(key)):
            raise ModelLoadError(
                f"{where}: {key}={config.get(key)!r} is not supported; {SUPPORTED_FEATURES}"
            )
    if config.get("attention_bias") and not attention_bias:
        raise ModelLoadError(
            f"{where}: attention_bias={config.get('attention_bias')!r} is not supported; "
            f"{SUPPORTED_FEATURES}"
        )
    theta, scaling = rope(config, where)
    rope_params = config.get("rope_parameters") or {}
    rotary = rope_params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    try:
        heads = int(config["num_attention_heads"])
        layers = int(config["num_hidden_layers"])
        made = {k: v(layers) if callable(v) else v for k, v in flags.items()}
        return ModelSpec(
            family=family,
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            rope_theta=theta,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            partial_rotary_factor=float(rotary if rotary is not None else rotary_default),
            **made,
        )
    except KeyError as exc:
        raise ModelLoadError(f"{where}: required key {exc.args[0]} is missing") from None
    except ValueError as exc:
        raise ModelLoadError(f"{where}: inconsistent model shape: {exc}") from None
