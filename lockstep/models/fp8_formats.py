"""FP8 checkpoint formats in Hugging Face folders: what a `quantization_config` means, which
are refused, and how each format's tensors map to the canonical FP8 names (spec.py).

Supported (the scheme names are lockstep/ops/fp8.py's):

  quant_method "fp8", weight_block_size [128, 128]       -> "block"
      {linear}.weight e4m3, {linear}.weight_scale_inv fp32 [ceil(N/128), ceil(K/128)]
      (Qwen's and DeepSeek's FP8 releases; activations dynamic per token and 128 columns)
  quant_method "fp8", no block size, activation_scheme "static"   -> "tensor"
      {linear}.weight e4m3, {linear}.weight_scale [] and {linear}.input_scale []
  quant_method "modelopt" (or a "quantization" block), quant_algo "FP8"   -> "tensor"
      {linear}.weight e4m3, {linear}.weight_scale [] and {linear}.input_scale []
  quant_method "compressed-tensors", format "float-quantized", one config group of 8-bit
  float weights and input activations:
      weights "channel" + activations "token", dynamic          -> "channel"
          {linear}.weight_scale [N, 1] (or [N])
      weights "tensor" + activations "tensor", static            -> "tensor"
          {linear}.weight_scale [1] (or []), {linear}.input_scale [1] (or [])
      weights "block" [128, 128] + activations "group" 128, dynamic   -> "block"
          {linear}.weight_scale [ceil(N/128), ceil(K/128)]

Refused, each in one line naming the field: any other method, algorithm, bit width or
block size; and dynamic per-TENSOR activation scales ("fp8" with activation_scheme
"dynamic" and no block size, or compressed-tensors "tensor" activations with dynamic true):
that scale is the maximum over the whole batch, so a token's result would depend on its
batch-mates, which no deterministic mode can serve. Use per-token (compressed-tensors
FP8_DYNAMIC), block-wise, or static scales instead.

Which linears are FP8 is read from the files: a projection whose weight is stored as
float8_e4m3fn is quantized, the others (a config's ignore list) are not.

KV cache scales (lockstep/ops/fp8.py, "FP8 KV cache"): static, one k and one v scale per
attention layer, used when the cache is FP8 (`--kv-dtype fp8_e4m3`). Declared by

  modelopt            kv_cache_quant_algo "FP8" (beside quant_algo; in config.json's
                      quantization_config or hf_quant_config.json's "quantization")
  compressed-tensors  kv_cache_scheme {num_bits 8, type float, strategy tensor, dynamic false}
  fp8                 no field: the tensors, where a folder has them (Qwen's and DeepSeek's
                      own FP8 releases have none, and run at scale 1.0)

and stored per layer, after "model.layers.{i}.self_attn.", as

  k_proj.k_scale, v_proj.v_scale         modelopt
  k_scale, v_scale                       compressed-tensors (and vLLM-style fp8 exports)
  k_proj.output_scale, v_proj.output_scale   older compressed-tensors
  kv_scale                               one scale for both (AutoFP8-style fp8 exports)

each a scalar ([] or [1]) of any float dtype. Refused, each in one line: a dynamic KV cache
scheme (its scale would be taken over the batch in flight, so a token's K/V would depend on
its batch-mates), any other KV algorithm, bit width or strategy (per-head scales included), a
declared scheme without scale tensors, an asymmetric scheme, a layer missing its k or v scale, and a scale that is
not finite and > 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lockstep.errors import ModelLoadError

PER_TENSOR_DYNAMIC = (
    "dynamic per-tensor activation scales take the maximum over the whole batch, so a "
    "token's result would depend on its batch-mates; Lockstep serves FP8 activations per "
    "token (compressed-tensors FP8_DYNAMIC), per 128-column block (quant_method fp8 with "
    "weight_block_size [128, 128]) or with static scales (ModelOpt FP8)"
)
SUPPORTED = (
    "supported: quant_method fp8 (weight_block_size [128, 128], or per-tensor with "
    "activation_scheme static), modelopt quant_algo FP8, compressed-tensors float 8-bit "
    "(channel weights + dynamic token activations, tensor weights + static tensor activations, "
    "or 128x128 block weights + dynamic 128-group activations)"
)
DYNAMIC_KV = (
    "dynamic KV cache scales are taken over the batch in flight, so a token's cached K/V "
    "would depend on its batch-mates; Lockstep serves static per-layer KV scales "
    "(kv_cache_scheme dynamic false, or ModelOpt kv_cache_quant_algo FP8)"
)
# After "model.layers.{i}.self_attn.": the file's name of a layer's K/V cache scale, and which
# scale it is ("kv": one scale for both).
KV_SCALE_NAMES = {
    "k_proj.k_scale": "k", "v_proj.v_scale": "v",
    "k_scale": "k", "v_scale": "v",
    "k_proj.output_scale": "k", "v_proj.output_scale": "v",
    "kv_scale": "kv",
}  # fmt: skip


@dataclass(frozen=True)
class Fp8Format:
    """One checkpoint format: the scheme, and each canonical scale name's suffix in files."""

    scheme: str
    method: str  # for messages: "fp8", "modelopt", "compressed-tensors"
    weight_scale_key: str = "weight_scale"  # "weight_scale_inv" for quant_method fp8 block

    def canonical(self, key: str) -> str:
        """The canonical name of file tensor `key` (spec.py)."""
        suffix = "." + self.weight_scale_key
        if self.weight_scale_key != "weight_scale" and key.endswith(suffix):
            return key[: -len(suffix)] + ".weight_scale"
        return key

    def canonical_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Scales in their canonical shape and float32: [N, 1] -> [N] ("channel"), [1] -> []
        ("tensor"); any other shape is left for the decoder's shape check to name."""
        if not name.endswith(("_scale", "_scale_inv")):
            return tensor
        if self.scheme == "channel" and tensor.dim() == 2 and tensor.shape[1] == 1:
            tensor = tensor.reshape(-1)
        if self.scheme == "tensor" and tensor.numel() == 1 and tensor.dim() == 1:
            tensor = tensor.reshape(())
        return tensor.to(torch.float32) if tensor.is_floating_point() else tensor


def fp8_format(config: dict[str, Any], where: str) -> Fp8Format | None:
    """The FP8 format a config.json declares (None: unquantized); refuses what is not
    supported with a `ModelLoadError` naming the field."""
    quant = config.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise ModelLoadError(f"{where}: quantization_config={quant!r} is invalid; {SUPPORTED}")
    method = quant.get("quant_method")
    if method == "fp8":
        return _fp8(quant, where)
    if method == "modelopt" or "quant_algo" in quant or "quantization" in quant:
        return _modelopt(quant, where)
    if method == "compressed-tensors":
        return _compressed_tensors(quant, where)
    raise ModelLoadError(
        f"{where}: quantization_config.quant_method={method!r} is not supported; {SUPPORTED}"
    )


def _refuse(where: str, field: str, value: Any, why: str = SUPPORTED) -> ModelLoadError:
    return ModelLoadError(f"{where}: quantization_config.{field}={value!r} is not supported; {why}")


def _fp8(quant: dict[str, Any], where: str) -> Fp8Format:
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(where, "fmt", fmt, "supported: e4m3")
    block = quant.get("weight_block_size")
    activation = quant.get("activation_scheme", "dynamic")
    if block is not None:
        if list(block) != [128, 128]:
            raise _refuse(where, "weight_block_size", block, "supported: [128, 128]")
        if activation != "dynamic":
            raise _refuse(where, "activation_scheme", activation, "block-wise FP8 is dynamic")
        return Fp8Format("block", "fp8", weight_scale_key="weight_scale_inv")
    if activation == "dynamic":
        raise _refuse(where, "activation_scheme", activation, PER_TENSOR_DYNAMIC)
    if activation != "static":
        raise _refuse(where, "activation_scheme", activation, "supported: static, dynamic")
    return Fp8Format("tensor", "fp8")


def _modelopt(quant: dict[str, Any], where: str) -> Fp8Format:
    inner = quant.get("quantization", quant)  # hf_quant_config.json nests it
    algo = inner.get("quant_algo")
    if algo != "FP8":
        raise _refuse(where, "quant_algo", algo, "supported ModelOpt quant_algo: FP8")
    return Fp8Format("tensor", "modelopt")


def _compressed_tensors(quant: dict[str, Any], where: str) -> Fp8Format:
    fmt = quant.get("format")
    if fmt != "float-quantized":
        raise _refuse(where, "format", fmt, "supported compressed-tensors format: float-quantized")
    groups = list((quant.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise _refuse(where, "config_groups", f"{len(groups)} groups", "supported: one group")
    weights, inputs = groups[0].get("weights") or {}, groups[0].get("input_activations") or {}
    for field, args in (("weights", weights), ("input_activations", inputs)):
        if (args.get("num_bits"), args.get("type")) != (8, "float"):
            got = f"num_bits {args.get('num_bits')} type {args.get('type')}"
            raise _refuse(where, f"config_groups.*.{field}", got, "supported: 8-bit float")
    w, a, dynamic = weights.get("strategy"), inputs.get("strategy"), inputs.get("dynamic")
    if a == "tensor" and dynamic:
        raise _refuse(where, "config_groups.*.input_activations.dynamic", dynamic,
                      PER_TENSOR_DYNAMIC)  # fmt: skip
    if (w, a, bool(dynamic)) == ("channel", "token", True):
        return Fp8Format("channel", "compressed-tensors")
    if (w, a, bool(dynamic)) == ("tensor", "tensor", False):
        return Fp8Format("tensor", "compressed-tensors")
    if (w, a, bool(dynamic)) == ("block", "group", True):
        if list(weights.get("block_structure") or []) != [128, 128]:
            raise _refuse(where, "config_groups.*.weights.block_structure",
                          weights.get("block_structure"), "supported: [128, 128]")  # fmt: skip
        if inputs.get("group_size") != 128:
            raise _refuse(where, "config_groups.*.input_activations.group_size",
                          inputs.get("group_size"), "supported: 128")  # fmt: skip
        return Fp8Format("block", "compressed-tensors")
    raise _refuse(where, "config_groups.*", f"weights {w} / activations {a} dynamic {dynamic}")


def kv_scale_name(key: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv") where tensor `key` is a layer's KV cache scale in one of the
    formats' names (module docstring), else None."""
    head, sep, leaf = key.partition(".self_attn.")
    if not sep or leaf not in KV_SCALE_NAMES or not head.startswith("model.layers."):
        return None
    index = head.removeprefix("model.layers.")
    return (int(index), KV_SCALE_NAMES[leaf]) if index.isdigit() else None


def kv_cache_declared(config: dict[str, Any], where: str) -> bool:
    """Whether the quantization config declares a static FP8 KV cache (module docstring);
    refuses a dynamic or unsupported KV cache scheme with a `ModelLoadError` naming the field."""
    quant = config.get("quantization_config")
    if not isinstance(quant, dict):
        return False
    inner = quant.get("quantization", quant)
    algo = inner.get("kv_cache_quant_algo") if isinstance(inner, dict) else None
    if algo is not None:
        if algo != "FP8":
            raise _refuse(where, "kv_cache_quant_algo", algo,
                          "supported ModelOpt kv_cache_quant_algo: FP8")  # fmt: skip
        return True
    scheme = quant.get("kv_cache_scheme")
    if scheme is None:
        return False
    if not isinstance(scheme, dict):
        raise _refuse(where, "kv_cache_scheme", scheme, "expected an object")
    if scheme.get("dynamic"):
        raise _refuse(where, "kv_cache_scheme.dynamic", scheme.get("dynamic"), DYNAMIC_KV)
    got = (scheme.get("num_bits"), scheme.get("type"))
    if got != (8, "float"):
        raise _refuse(where, "kv_cache_scheme", f"num_bits {got[0]} type {got[1]}",
                      "supported: 8-bit float")  # fmt: skip
    if scheme.get("strategy", "tensor") != "tensor":
        raise _refuse(where, "kv_cache_scheme.strategy", scheme.get("strategy"),
                      "supported: tensor (one static scale per layer)")  # fmt: skip
    if scheme.get("symmetric", True) is not True:
        raise _refuse(where, "kv_cache_scheme.symmetric", scheme.get("symmetric"),
                      "supported: true (no zero points)")  # fmt: skip
    return True
