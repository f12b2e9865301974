"""Loading a Hugging Face model folder: config.json, *.safetensors and tokenizer.json.

Which families are served, how their configs become a `ModelSpec` and how their tensor names
become canonical (spec.py) is each family's (lockstep/models/families); this module reads the
files. The loader lists exactly what the files hold, so the decoder's strict load sees any
tensor this loader does not understand. The only tensors left out, each for a stated reason,
are old checkpoints' rotary inv_freq buffers, an lm_head.weight stored beside tied embeddings,
FP8 checkpoints' k/v cache scales (read into the spec instead: `ModelSpec.kv_cache_scales`),
and what a family says it does not serve (Qwen3.5's vision tower).

FP8 checkpoints (a `quantization_config`): the formats, their refusals and their tensor names
are in fp8_formats.py; which projections are FP8 is read from the stored dtypes. DeepSeek's
multi-token-prediction layers are skipped before the FP8 checks (their FP8 tensors included).
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
from lockstep.models.families import Family, family_of
from lockstep.models.families.base import Parts
from lockstep.models.fp8_formats import (
    Fp8Format,
    fp8_format,
    kv_cache_declared,
    kv_scale_name,
)
from lockstep.models.spec import (
    QUANTIZABLE,
    Fp8Spec,
    KvCacheScales,
    ModelSpec,
)
from lockstep.models.tokenizer import Tokenizer, chat_stop_token_ids

logger = logging.getLogger(__name__)

_INDEX_FILE = "model.safetensors.index.json"
_MODELOPT_FILE = "hf_quant_config.json"
# Read as float32 whatever the model dtype: norms, and Gated DeltaNet's decay parameters and
# convolution (small, and kept in float32 by the decoder).
_KEPT_FLOAT32 = ("norm.weight", ".A_log", ".dt_bias", ".conv1d.weight")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None


def hf_spec(config: dict[str, Any], folder: Path) -> tuple[ModelSpec, Family]:
    """The folder's spec and family (lockstep/models/families), from its config.json."""
    where = f"{folder}/config.json"
    family = family_of(config, where)
    return family.spec(config, where), family


class SafetensorsWeights:
    """The folder's tensors, read one at a time from memory-mapped safetensors files, in
    canonical names (an FP8 format's scale names and shapes made canonical)."""

    def __init__(
        self,
        folder: Path,
        spec: ModelSpec,
        family: Family,
        fmt: Fp8Format | None = None,
        mtp: bool = False,
    ) -> None:
        """`mtp`: read a model's multi-token-prediction layer (lockstep/models/mtp.py; `family`
        names its tensors), which is past the last decoder layer, instead of skipping it."""
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
        # canonical name -> (file, key in file, its rows of that tensor; None: all of them)
        self._where: dict[str, tuple[Path, str, slice | None]] = {}
        self.fp8_modules: set[str] = set()  # linears whose weight is stored as e4m3
        # A layer's KV cache scales: (layer, "k" | "v" | "kv") -> (file, key in file).
        self.kv_scales: dict[tuple[int, str], tuple[Path, str]] = {}
        extra_layers: list[str] = []
        for file_name in files:
            path = folder / file_name
            if not path.exists():
                named = " named in the index" if index.exists() else ""
                raise ModelLoadError(f"{folder}: weight file {file_name}{named} is missing")
            with safe_open(path, framework="pt") as handle:
                keys = list(handle.keys())
                slices = {k: handle.get_slice(k) for k in keys}  # headers only: no data read
                fp8 = {k for k in keys if slices[k].get_dtype() == "F8_E4M3"}
                shapes = {k: slices[k].get_shape() for k in keys}
            for key in keys:
                if key.endswith("rotary_emb.inv_freq"):
                    continue  # a buffer derived from rope_theta, saved by old checkpoints
                if key == "lm_head.weight" and spec.tie_word_embeddings:
                    continue  # tied: transformers ignores the copy and uses the embedding
                if not mtp and _beyond_last_layer(key, spec):
                    # DeepSeek's multi-token-prediction layers, FP8 or not (their eh_proj and
                    # shared_head are no decoder projection): skipped before any FP8 check.
                    extra_layers.append(key)
                    continue
                kv_scale = kv_scale_name(key) if fmt is not None else None
                if kv_scale is not None:
                    if kv_scale in self.kv_scales:
                        raise ModelLoadError(
                            f"{folder}: tensors {self.kv_scales[kv_scale][1]} and {key} are "
                            "both the same layer's KV cache scale; expected one"
                        )
                    self.kv_scales[kv_scale] = (path, key)  # not a weight: `kv_cache_scales`
                    continue
                if key in fp8:
                    self._check_fp8_weight(folder, key)
                    self.fp8_modules.add(key.removesuffix(".weight"))
                name = family.tensor_name(key if fmt is None else fmt.canonical(key))
                if name is None:
                    continue  # the family does not serve it (a vision tower)
                parts = family.parts(name, spec)
                if parts != ((name, None),):
                    _check_fused_rows(folder, key, shapes[key], parts)
                for part, rows in parts:
                    self._where[part] = (path, key, rows)
        if extra_layers:
            logger.info(
                "%s: %d tensors of layers past the last decoder layer (e.g. %s, DeepSeek's "
                "multi-token prediction) are not loaded", folder, len(extra_layers),
                extra_layers[0],
            )  # fmt: skip

    def _check_fp8_weight(self, folder: Path, key: str) -> None:
        if self._fmt is None:
            raise ModelLoadError(
                f"{folder}: tensor {key!r} is float8_e4m3fn but config.json has no "
                "quantization_config naming its scales"
            )
        if not key.endswith(".weight") or key.rsplit(".", 2)[-2] not in QUANTIZABLE:
            # A router's fp32 logits choose the experts: Lockstep keeps them unquantized.
            is_router = key.endswith(".mlp.gate.weight")
            router = " (a MoE router, which must stay unquantized)" if is_router else ""
            raise ModelLoadError(
                f"{folder}: tensor {key!r} is float8_e4m3fn{router}; FP8 is supported for the "
                f"projections {', '.join(QUANTIZABLE)} only"
            )

    def names(self) -> list[str]:
        return list(self._where)

    def iter(
        self, dtype: torch.dtype, device: torch.device | str
    ) -> Iterator[tuple[str, torch.Tensor]]:
        by_file: dict[Path, list[str]] = {}
        for name, (path, _, _) in self._where.items():
            by_file.setdefault(path, []).append(name)
        for path, names in by_file.items():
            with safe_open(path, framework="pt", device="cpu") as handle:
                for name in names:
                    _, key, rows = self._where[name]
                    tensor = handle.get_tensor(key) if rows is None else handle.get_slice(key)[rows]
                    if self._fmt is not None:
                        tensor = self._fmt.canonical_tensor(name, tensor)
                    if name.endswith(_KEPT_FLOAT32):
                        target = torch.float32
                    elif tensor.dtype == torch.float8_e4m3fn or name.endswith("_scale"):
                        target = tensor.dtype  # FP8 weights and their scales: as stored
                    else:
                        target = dtype
                    yield name, tensor.to(device=device, dtype=target).contiguous()


def _check_fused_rows(folder: Path, key: str, shape: list[int], parts: Parts) -> None:
    """A fused tensor must hold exactly its parts' rows (a config that miscounts heads would
    otherwise read some rows as the wrong projection and leave others unread)."""
    want = max(rows.stop for _, rows in parts if rows is not None)
    if not shape or shape[0] != want:
        names = ", ".join(name.rsplit(".", 2)[-2] for name, _ in parts)
        raise ModelLoadError(f"{folder}: tensor {key!r} has shape {shape}, expected {want} rows "
                             f"({names}) for this config")  # fmt: skip


def _beyond_last_layer(key: str, spec: ModelSpec) -> bool:
    """Whether `key` belongs to a layer past the spec's last one in an MLA (DeepSeek) folder:
    its multi-token-prediction layers `model.layers.{num_layers + j}.*`, which are not run."""
    if spec.mla is None or not key.startswith("model.layers."):
        return False
    index = key.split(".", 3)[2]
    return index.isdigit() and int(index) >= spec.num_layers


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
    spec, family = hf_spec(config, folder)
    quant_where = f"{folder}/config.json"
    modelopt = folder / _MODELOPT_FILE
    if "quantization_config" not in config and modelopt.exists():
        # ModelOpt exports may state their quantization in this file only.
        config = {**config, "quantization_config": _read_json(modelopt)}
        quant_where = str(modelopt)
    fmt = fp8_format(config, quant_where)
    kv_declared = kv_cache_declared(config, quant_where)
    tokenizer = hf_tokenizer(folder, config)
    weights = SafetensorsWeights(folder, spec, family, fmt)
    if fmt is not None:
        spec = _fp8_spec(spec, fmt, weights, folder)
        scales = _kv_cache_scales(spec, weights, kv_declared, folder)
        if scales is not None:
            try:
                spec = dataclasses.replace(spec, kv_cache_scales=scales)
            except ValueError as exc:
                raise ModelLoadError(f"{folder}: {exc}") from None
    return spec, tokenizer, weights


def _kv_cache_scales(
    spec: ModelSpec, weights: SafetensorsWeights, declared: bool, folder: Path
) -> KvCacheScales | None:
    """The folder's static KV cache scales (fp8_formats.py), one k and one v per attention
    layer, or None where it has none (the FP8 cache then has scale 1.0). Each missing or
    malformed scale is named in one line."""
    found = weights.kv_scales
    if not found:
        if declared:
            raise ModelLoadError(
                f"{folder}: the quantization config declares an FP8 KV cache but no tensor "
                "holds its scales (e.g. model.layers.0.self_attn.k_scale)"
            )
        return None
    values: dict[tuple[int, str], float] = {}
    for (layer, role), (path, key) in sorted(found.items()):
        with safe_open(path, framework="pt", device="cpu") as handle:
            tensor = handle.get_tensor(key)
        if tensor.numel() != 1 or not tensor.is_floating_point():
            raise ModelLoadError(
                f"{folder}: KV cache scale {key} has dtype {tensor.dtype} shape "
                f"{list(tensor.shape)}; supported: one float scale per layer ([] or [1])"
            )
        value = float(tensor.to(torch.float32).reshape(()))
        if not 0.0 < value < float("inf"):
            raise ModelLoadError(f"{folder}: KV cache scale {key} = {value!r} is invalid: "
                                 "expected finite and > 0")  # fmt: skip
        values[layer, role] = value
    k, v = [], []
    for layer in spec.kv_layers:
        pair = [values.get((layer, r), values.get((layer, "kv"))) for r in "kv"]
        if (layer, "kv") in values and ((layer, "k") in values or (layer, "v") in values):
            raise ModelLoadError(f"{folder}: layer {layer} has both a kv_scale and a k_scale or "
                                 "v_scale; expected one or the other")  # fmt: skip
        for role, value in zip("kv", pair, strict=True):
            if value is None:
                raise ModelLoadError(
                    f"{folder}: layer {layer}'s KV cache {role}_scale is missing (other layers "
                    "have KV cache scales; each attention layer needs its k and v scales)"
                )
        k.append(pair[0])
        v.append(pair[1])
    stray = sorted({layer for layer, _ in values} - set(spec.kv_layers))
    if stray:
        raise ModelLoadError(f"{folder}: KV cache scales for layer {stray[0]}, which has no "
                             "K/V cache")  # fmt: skip
    return KvCacheScales(tuple(k), tuple(v))


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
