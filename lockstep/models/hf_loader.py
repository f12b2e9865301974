"""Loading a Hugging Face model folder: config.json, *.safetensors and tokenizer.json.

Supported: model_type llama, qwen2 (q/k/v biases), qwen3 (q/k RMSNorm, explicit head_dim),
qwen3_moe (Qwen3 attention, routed experts: lockstep.models.moe) and the Qwen3.5 hybrids:
qwen3_5_text (Qwen3_5ForCausalLM) and the text model of qwen3_5 (Qwen3_5ForConditionalGeneration,
its `text_config`). Tensor names in these checkpoints are the canonical ones (spec.py), except
a Qwen3.5 multimodal checkpoint's `model.language_model.*`, read as `model.*`. The loader lists
exactly what the files hold, so the decoder's strict load sees any tensor this loader does not
understand. The only tensors left out, each for a stated reason, are old checkpoints' rotary
inv_freq buffers, an lm_head.weight stored beside tied embeddings, and a Qwen3.5 checkpoint's
vision tower (`model.visual.*`: text only is served) and multi-token-prediction head (`mtp.*`,
which transformers does not load either), and FP8 checkpoints' k/v cache scales.

Qwen3.5's multimodal RoPE (`mrope_section`) gives text tokens the same position on all three
axes, which is plain RoPE on the rotated dims: text-only serving needs nothing more.

FP8 checkpoints (a `quantization_config`): the formats, their refusals and their tensor names
are in fp8_formats.py; which projections are FP8 is read from the stored dtypes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tokenizers
import torch
from safetensors import safe_open

from lockstep.errors import ModelLoadError
from lockstep.models.fp8_formats import KV_SCALE_SUFFIXES, Fp8Format, fp8_format
from lockstep.models.moe import hf_moe_spec, refuse_unsupported_moe
from lockstep.models.spec import (
    MOE_FAMILIES,
    QUANTIZABLE,
    Fp8Spec,
    LinearAttentionSpec,
    ModelSpec,
    RopeScaling,
)
from lockstep.models.tokenizer import Tokenizer, chat_stop_token_ids

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_text")
_INDEX_FILE = "model.safetensors.index.json"
# Read as float32 whatever the model dtype: norms, and Gated DeltaNet's decay parameters and
# convolution (small, and kept in float32 by the decoder).
_KEPT_FLOAT32 = ("norm.weight", ".A_log", ".dt_bias", ".conv1d.weight")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None


def _rope(config: dict[str, Any], folder: Path) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from either transformers 5's rope_parameters or the older
    rope_theta + rope_scaling keys."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ModelLoadError(
            f"{folder}/config.json: rope_type {rope_type!r} is not supported; supported: "
            "default, llama3"
        )
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(params["original_max_position_embeddings"]),
        )
    except KeyError as exc:
        raise ModelLoadError(
            f"{folder}/config.json: llama3 RoPE scaling lacks {exc.args[0]}"
        ) from None
    return theta, scaling


def _text_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    """A Qwen3.5 multimodal config's text model, as a qwen3_5_text config."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(f"{where}: model_type 'qwen3_5' without a text_config object")
    tie = text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    return {**text, "model_type": "qwen3_5_text", "tie_word_embeddings": tie}


def _linear_spec(config: dict[str, Any], layers: int, where: str) -> LinearAttentionSpec:
    """The Gated DeltaNet layers of a Qwen3.5 config (layer_types, or transformers' default
    pattern from full_attention_interval)."""
    types = config.get("layer_types")
    if types is None:
        interval = int(config.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention"
                 for i in range(layers)]  # fmt: skip
    if not isinstance(types, list):
        raise ModelLoadError(f"{where}: layer_types={types!r} is not a list")
    return LinearAttentionSpec(
        layer_types=tuple(types),
        num_key_heads=int(config.get("linear_num_key_heads", 16)),
        num_value_heads=int(config.get("linear_num_value_heads", 32)),
        key_head_dim=int(config.get("linear_key_head_dim", 128)),
        value_head_dim=int(config.get("linear_value_head_dim", 128)),
        conv_kernel=int(config.get("linear_conv_kernel_dim", 4)),
    )


def hf_spec(config: dict[str, Any], folder: Path) -> ModelSpec:
    where = f"{folder}/config.json"
    if config.get("model_type") == "qwen3_5":
        config = _text_config(config, where)
    model_type = config.get("model_type")
    # Before the model_type: "a shared expert" says more than "deepseek_v3 is not supported".
    refuse_unsupported_moe(config, where)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{where}: model_type {model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    refused = {
        "hidden_act": config.get("hidden_act", "silu") != "silu",
        # Llama and Qwen3 put this bias on o_proj too, which ModelSpec has no flag for.
        "attention_bias": bool(config.get("attention_bias")) and model_type != "qwen2",
        "mlp_bias": bool(config.get("mlp_bias")),
        "use_sliding_window": bool(config.get("use_sliding_window")),
    }
    for key, bad in refused.items():
        if bad:
            raise ModelLoadError(
                f"{where}: {key}={config.get(key)!r} is not supported; supported: Llama/Qwen2/Qwen3"
                "/Qwen3-MoE models with silu MLPs, no o_proj/MLP bias, no sliding window"
            )
    theta, scaling = _rope(config, folder)
    hybrid = model_type == "qwen3_5_text"
    rope_params = config.get("rope_parameters") or {}
    rotary = rope_params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    try:
        heads = int(config["num_attention_heads"])
        layers = int(config["num_hidden_layers"])
        moe = hf_moe_spec(config, layers, where) if model_type in MOE_FAMILIES else None
        return ModelSpec(
            family="qwen3_5" if hybrid else model_type,
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
            qkv_bias=model_type == "qwen2",
            qk_norm=model_type in ("qwen3", "qwen3_moe") or hybrid,
            rope_scaling=scaling,
            moe=moe,
            linear=_linear_spec(config, layers, where) if hybrid else None,
            partial_rotary_factor=float(rotary if rotary is not None else (0.25 if hybrid else 1)),
        )
    except KeyError as exc:
        raise ModelLoadError(f"{where}: required key {exc.args[0]} is missing") from None
    except ValueError as exc:
        raise ModelLoadError(f"{where}: inconsistent model shape: {exc}") from None


class SafetensorsWeights:
    """The folder's tensors, read one at a time from memory-mapped safetensors files, in
    canonical names (an FP8 format's scale names and shapes made canonical)."""

    def __init__(self, folder: Path, spec: ModelSpec, fmt: Fp8Format | None = None) -> None:
        self._fmt = fmt
        index = folder / _INDEX_FILE
        if index.exists():
            weight_map: dict[str, str] = _read_json(index).get("weight_map", {})
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(
                f"{folder} has no *.safetensors weights; supported weight files: *.safetensors "
                f"(sharded with {_INDEX_FILE})"
            )
        self._where: dict[str, tuple[Path, str]] = {}  # canonical name -> (file, key in file)
        self.fp8_modules: set[str] = set()  # linears whose weight is stored as e4m3
        kv_scales = []
        for file_name in files:
            path = folder / file_name
            if not path.exists():
                named = " named in the index" if index.exists() else ""
                raise ModelLoadError(f"{folder}: weight file {file_name}{named} is missing")
            with safe_open(path, framework="pt") as handle:
                keys = list(handle.keys())
                fp8 = {k for k in keys if handle.get_slice(k).get_dtype() == "F8_E4M3"}
            for key in keys:
                if key.endswith("rotary_emb.inv_freq"):
                    continue  # a buffer derived from rope_theta, saved by old checkpoints
                if key == "lm_head.weight" and spec.tie_word_embeddings:
                    continue  # tied: transformers ignores the copy and uses the embedding
                if fmt is not None and key.endswith(KV_SCALE_SUFFIXES):
                    kv_scales.append(key)  # the FP8 KV cache's scale is 1.0 (fp8_formats.py)
                    continue
                if key in fp8:
                    self._check_fp8_weight(folder, key)
                    self.fp8_modules.add(key.removesuffix(".weight"))
                name = key if fmt is None else fmt.canonical(key)
                if spec.hybrid:
                    if key.startswith(("model.visual.", "mtp.")):
                        continue  # vision tower and multi-token prediction: not served
                    if key.startswith("model.language_model."):
                        name = "model." + key[len("model.language_model.") :]
                self._where[name] = (path, key)
        if kv_scales:
            logger.warning(
                "%s: %d k/v cache scales (e.g. %s) are not used: the FP8 KV cache has scale 1.0",
                folder, len(kv_scales), kv_scales[0],
            )  # fmt: skip

    def _check_fp8_weight(self, folder: Path, key: str) -> None:
        if self._fmt is None:
            raise ModelLoadError(
                f"{folder}: tensor {key!r} is float8_e4m3fn but config.json has no "
                "quantization_config naming its scales"
            )
        if not key.endswith(".weight") or key.rsplit(".", 2)[-2] not in QUANTIZABLE:
            raise ModelLoadError(
                f"{folder}: tensor {key!r} is float8_e4m3fn; FP8 is supported for the "
                f"projections {', '.join(QUANTIZABLE)} only"
            )

    def names(self) -> list[str]:
        return list(self._where)

    def iter(
        self, dtype: torch.dtype, device: torch.device | str
    ) -> Iterator[tuple[str, torch.Tensor]]:
        by_file: dict[Path, list[str]] = {}
        for name, (path, _) in self._where.items():
            by_file.setdefault(path, []).append(name)
        for path, names in by_file.items():
            with safe_open(path, framework="pt", device="cpu") as handle:
                for name in names:
                    tensor = handle.get_tensor(self._where[name][1])
                    if self._fmt is not None:
                        tensor = self._fmt.canonical_tensor(name, tensor)
                    if name.endswith(_KEPT_FLOAT32):
                        target = torch.float32
                    elif tensor.dtype == torch.float8_e4m3fn or name.endswith("_scale"):
                        target = tensor.dtype  # FP8 weights and their scales: as stored
                    else:
                        target = dtype
                    yield name, tensor.to(device=device, dtype=target).contiguous()


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as text or as a serialized AddedToken."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _chat_template(folder: Path, tokenizer_config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"  # where transformers >= 4.43 saves it
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8")
    json_file = folder / "chat_template.json"
    template = tokenizer_config.get("chat_template")
    if template is None and json_file.exists():
        template = _read_json(json_file).get("chat_template")
    if isinstance(template, list):  # named templates: the one called "default" is the chat one
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list) else {int(value)}


def hf_tokenizer(folder: Path, config: dict[str, Any]) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.exists():
        raise ModelLoadError(
            f"{folder} has no tokenizer.json; a Hugging Face model folder needs config.json, "
            "*.safetensors and tokenizer.json"
        )
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a bare Exception on a malformed file
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
    tok_config_path = folder / "tokenizer_config.json"
    tok_config = _read_json(tok_config_path) if tok_config_path.exists() else {}
    gen_config_path = folder / "generation_config.json"
    gen_config = _read_json(gen_config_path) if gen_config_path.exists() else {}

    if "bos_token" in tok_config:  # may be null on purpose (Qwen): then there is no BOS
        bos_text = _token_text(tok_config["bos_token"])
        bos_id = backend.token_to_id(bos_text) if bos_text else None
    else:
        bos_id = config.get("bos_token_id")
    if "add_bos_token" in tok_config:
        add_bos = bool(tok_config["add_bos_token"])
    else:
        # No flag: the tokenizer.json post-processor decides, as in transformers.
        with_specials = backend.encode("a", add_special_tokens=True).ids
        add_bos = bos_id is not None and with_specials[:1] == [bos_id]

    eos_text = _token_text(tok_config.get("eos_token"))
    primary_eos = backend.token_to_id(eos_text) if eos_text else None
    config_eos = _ids(config.get("eos_token_id"))
    if primary_eos is None and config_eos:
        primary_eos = min(config_eos)
    eos_ids = _ids(gen_config.get("eos_token_id")) | config_eos
    if primary_eos is not None:
        eos_ids.add(primary_eos)
    template = _chat_template(folder, tok_config)
    if template is not None:
        eos_ids |= chat_stop_token_ids(backend)
    return Tokenizer(
        backend,
        bos_token_id=bos_id,
        eos_token_ids=eos_ids,
        add_bos=add_bos,
        chat_template=template,
        eos_token_id=primary_eos,
    )


def load_hf_folder(folder: Path) -> tuple[ModelSpec, Tokenizer, SafetensorsWeights]:
    config_path = folder / "config.json"
    if not config_path.exists():
        raise ModelLoadError(
            f"{folder} has no config.json; a Hugging Face model folder needs config.json, "
            "*.safetensors and tokenizer.json"
        )
    config = _read_json(config_path)
    spec = hf_spec(config, folder)
    fmt = fp8_format(config, f"{folder}/config.json")
    tokenizer = hf_tokenizer(folder, config)
    weights = SafetensorsWeights(folder, spec, fmt)
    if fmt is not None:
        spec = _fp8_spec(spec, fmt, weights, folder)
    return spec, tokenizer, weights


def _fp8_spec(
    spec: ModelSpec, fmt: Fp8Format, weights: SafetensorsWeights, folder: Path
) -> ModelSpec:
    """`spec` with its FP8 linears: those stored as e4m3; the other projections are skipped.
    A missing scale is named here as the file names it (e.g. `weight_scale_inv`)."""
    if not weights.fp8_modules:
        raise ModelLoadError(
            f"{folder}: config.json declares {fmt.method} FP8 quantization but no weight is "
            "stored as float8_e4m3fn"
        )
    present = set(weights.names())
    needed = ["weight_scale"] + (["input_scale"] if fmt.scheme == "tensor" else [])
    for module in sorted(weights.fp8_modules):
        for leaf in needed:
            if f"{module}.{leaf}" not in present:
                key = fmt.weight_scale_key if leaf == "weight_scale" else leaf
                raise ModelLoadError(
                    f"{folder}: tensor {module}.{key} is missing: {module}.weight is "
                    f"float8_e4m3fn and {fmt.method} FP8 ({fmt.scheme} scheme) needs its {leaf}"
                )
    modules = {n.removesuffix(".weight") for n in present if n.endswith(".weight")}
    skipped = sorted(
        m for m in modules - weights.fp8_modules if m.rsplit(".", 1)[-1] in QUANTIZABLE
    )
    try:
        return dataclasses.replace(spec, fp8=Fp8Spec(fmt.scheme, tuple(skipped)))
    except ValueError as exc:
        raise ModelLoadError(f"{folder}/config.json: {exc}") from None
