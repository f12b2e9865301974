"""Tiny FP8 folders with static KV cache scales in each checkpoint format Lockstep reads
(lockstep/models/fp8_formats.py), and a float64 emulation of the FP8 KV cache for the
reference model of tests/support/tiny_fp8.py.

The folder is tiny_fp8.py's tiny Qwen3 with K and V made large: q_norm / 256 and k_norm x
256 (the scores are unchanged), v_proj x 256 and o_proj / 256 (the layer's output is
unchanged). Every weight change is a power of two, so the model is the same function, but its
keys and values reach beyond 448, where an FP8 cache at scale 1.0 saturates. Its KV scales
are calibrated as ModelOpt calibrates them: the largest |k| and |v| of each layer over a
calibration prompt, / 448 (times a margin), run through the float model. Then the formats:

  modelopt             self_attn.k_proj.k_scale, v_proj.v_scale; kv_cache_quant_algo FP8
  modelopt-file        the same, with the quantization in hf_quant_config.json only
  compressed-tensors   self_attn.k_scale, v_scale; kv_cache_scheme (tensor, static)
  compressed-tensors-output   the same with older compressed-tensors' names,
                       self_attn.k_proj.output_scale, v_proj.output_scale
  fp8-block            self_attn.k_scale, v_scale beside Qwen-style block FP8 weights
  fp8-block-kv_scale   self_attn.kv_scale, one scale for K and V (the larger of the two)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward

from tests.support.tiny_fp8 import edit_tensors, float64_reference, write_fp8_folder

KV_FORMATS = ("modelopt", "modelopt-file", "compressed-tensors", "compressed-tensors-output",
              "fp8-block", "fp8-block-kv_scale")  # fmt: skip
WEIGHTS = {"modelopt": "modelopt", "modelopt-file": "modelopt",
           "compressed-tensors": "compressed-tensors",
           "compressed-tensors-output": "compressed-tensors", "fp8-block": "fp8-block",
           "fp8-block-kv_scale": "fp8-block"}  # fmt: skip
BOOST = 256.0
MARGIN = 1.25  # headroom over the calibration prompt's largest value
CALIBRATION = list(range(3, 250, 7))
_EMULATION = "lockstep_fp8_kv_emulation"


def _boost(model: Any) -> None:
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.q_norm.weight.div_(BOOST)
        attn.k_norm.weight.mul_(BOOST)
        attn.v_proj.weight.mul_(BOOST)
        attn.o_proj.weight.div_(BOOST)


class KvCacheEmulation:
    """transformers' eager attention over K and V as an FP8 cache holds them, in float64:
    each value rounded to fp32 (what Lockstep computes and writes), divided by its layer's
    fp32 scale in fp32, rounded to e4m3 (saturating, nearest even), times the scale. With
    `scales` None it records each layer's largest |k| and |v| instead (calibration)."""

    def __init__(self, scales: dict[int, tuple[float, float]] | None) -> None:
        self.scales = scales
        self.amax: dict[int, list[float]] = {}

    def __call__(self, module: Any, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        layer = module.layer_idx
        if self.scales is None:
            seen = self.amax.setdefault(layer, [0.0, 0.0])
            seen[0] = max(seen[0], key.abs().max().item())
            seen[1] = max(seen[1], value.abs().max().item())
        else:
            key = _through_cache(key, self.scales[layer][0])
            value = _through_cache(value, self.scales[layer][1])
        return eager_attention_forward(module, query, key, value, *args, **kwargs)


def _through_cache(x: torch.Tensor, scale: float) -> torch.Tensor:
    s = torch.tensor(scale, dtype=torch.float32)
    q = (x.to(torch.float32) / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.to(x.dtype) * s.to(x.dtype)


def emulate_kv_cache(model: Any, emulation: KvCacheEmulation) -> Any:
    """`model` with its attention run by `emulation`."""
    AttentionInterface.register(_EMULATION, emulation)
    AttentionMaskInterface.register(_EMULATION, eager_mask)  # the causal mask eager attention takes
    model.config._attn_implementation = _EMULATION
    return model


def _calibrated_scales(model: Any) -> dict[int, tuple[float, float]]:
    emulation = KvCacheEmulation(None)
    with torch.no_grad():
        emulate_kv_cache(model, emulation)(torch.tensor([CALIBRATION]))
    model.config._attn_implementation = "eager"
    # Rounded to fp32 values, as the files store them.
    return {
        layer: tuple(float(torch.tensor(a * MARGIN / 448.0, dtype=torch.float32)) for a in amax)
        for layer, amax in emulation.amax.items()
    }


def write_kv_scaled_folder(folder: Path, kv_format: str) -> tuple[Any, dict]:
    """Write the module docstring's folder in `kv_format` (KV_FORMATS); returns the float32
    transformers model and the scales written, {layer: (k_scale, v_scale)} (for
    fp8-block-kv_scale both are the one kv_scale)."""
    fmt = WEIGHTS[kv_format]
    model = write_fp8_folder(folder, fmt, edit=_boost)
    scales = _calibrated_scales(model)
    if kv_format == "fp8-block-kv_scale":
        scales = {i: (max(kv),) * 2 for i, kv in scales.items()}
    tensors: dict[str, torch.Tensor | None] = {}
    for i, (k, v) in scales.items():
        at = f"model/layers/{i}/self_attn/"
        if fmt == "modelopt":
            tensors[at + "k_proj/k_scale"] = torch.tensor(k)
            tensors[at + "v_proj/v_scale"] = torch.tensor(v)
            # The static input scale of o_proj covers the boosted values.
            tensors[at + "o_proj/input_scale"] = torch.tensor(8.0 * BOOST / 448.0)
        elif kv_format == "fp8-block-kv_scale":
            tensors[at + "kv_scale"] = torch.tensor(k)
        elif kv_format == "compressed-tensors-output":
            tensors[at + "k_proj/output_scale"] = torch.tensor([k])
            tensors[at + "v_proj/output_scale"] = torch.tensor([v])
        else:  # compressed-tensors stores [1] tensors
            tensors[at + "k_scale"] = torch.tensor([k])
            tensors[at + "v_scale"] = torch.tensor([v])
    edit_tensors(folder, **tensors)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    quant = config["quantization_config"]
    if fmt == "compressed-tensors":
        quant["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                    "dynamic": False, "symmetric": True}  # fmt: skip
    if kv_format == "modelopt-file":
        del config["quantization_config"]
        algo = {k: quant[k] for k in ("quant_algo", "kv_cache_quant_algo", "exclude_modules")}
        producer = {"name": "modelopt", "version": "0.0"}
        (folder / "hf_quant_config.json").write_text(
            json.dumps({"producer": producer, "quantization": algo})
        )
    config_path.write_text(json.dumps(config))
    return model, scales


def kv_reference(model: Any, folder: Path, kv_format: str, scales: dict) -> Any:
    """The float64 reference of the folder's quantized model (tiny_fp8.float64_reference)
    with its attention over the emulated FP8 KV cache at `scales`."""
    reference = float64_reference(model, folder, WEIGHTS[kv_format])
    return emulate_kv_cache(reference, KvCacheEmulation(scales))
