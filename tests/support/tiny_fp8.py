"""Tiny FP8 Hugging Face folders that tests write themselves, in each supported checkpoint
format, and an independent float64 reference of the quantized model (transformers' own model
with its projections replaced by FP8 emulations written here, not with lockstep's code).

The model is a tiny random Qwen3 (tests/support/tiny_hf.py) with hidden size 192, so the 128-wide K
blocks of q/k/v and gate/up end in a partial block, and every fused part has a multiple of 128
rows; or a tiny Qwen3-MoE of the same width whose experts are quantized one checkpoint tensor
each (in any format: block-wise as Qwen3-30B-A3B-FP8; per-tensor experts with input scales
that differ by expert, `_expert_input_factor`); or a tiny DeepSeek-V3
(DEEPSEEK_SHAPE) quantized as DeepSeek-V3's own release is: every MLA projection (kv_b_proj
included), dense MLP, shared expert and routed expert block-wise, routers, the correction bias,
norms, embeddings and LM head not. Its projections are quantized here the way each format's
tools do: block-wise (Qwen/DeepSeek "fp8"), per-tensor with static input scales (ModelOpt),
per-channel with dynamic per-token activations (compressed-tensors). `skip` leaves projections
unquantized (a config's ignore list).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.support.tiny_hf import save_tiny

E4M3 = torch.float8_e4m3fn
FORMATS = ("fp8-block", "modelopt", "compressed-tensors")
SCHEME = {"fp8-block": "block", "modelopt": "tensor", "compressed-tensors": "channel"}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")  # fmt: skip
# Stored FP8 but not run as an FP8 linear: MLA's kv_b_proj, which Lockstep (as SGLang)
# dequantizes at load for the absorbed form; the reference runs its dequantized weight.
DEQUANTIZED = ("kv_b_proj",)
SHAPE = dict(hidden_size=192, intermediate_size=256)
# The MoE folder: 8 experts of width 160, so each expert's gate and up (and down's K) end in a
# partial 128-row block, which the published format stores with its own scale row; hidden 192
# as above; layer 2 dense (tiny_hf.py's qwen3_moe), its gate | up fused by 128-row blocks.
MOE_SHAPE = dict(hidden_size=192, intermediate_size=256, moe_intermediate_size=160)
INPUT_AMAX = 8.0  # the static activation range of the ModelOpt folder's input scales
# The DeepSeek-V3 folder (tiny_hf.py's deepseek_v3 with these sizes): 128 x 128 blocks tile
# it as they tile DeepSeek-V3. Hidden 256 (two K blocks); q_a (128 rows) fused with kv_a
# (latent 128 + RoPE 64 = 192 rows: a partial last block); q_b of 2 heads of 64 + 64 rows, so
# each head's RoPE rows (reordered at load) stay in their block; kv_b of 2 x (64 + 64) rows;
# experts and the shared expert of width 128; layer 0 dense (width 384), layer 1 sparse.
DEEPSEEK_SHAPE = dict(
    hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64,
    qk_rope_head_dim=64, v_head_dim=64, moe_intermediate_size=128,
)  # fmt: skip
_SHAPES = {"qwen3": SHAPE, "qwen3_moe": MOE_SHAPE, "deepseek_v3": DEEPSEEK_SHAPE}


def _sat(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448.0, 448.0).to(E4M3)


def quantize(w: torch.Tensor, scheme: str) -> dict[str, torch.Tensor]:
    """A float32 weight [N, K] -> the format's tensors (canonical suffixes)."""
    n, k = w.shape
    if scheme == "block":
        scale = torch.empty(-(-n // 128), -(-k // 128))
        q = torch.empty(n, k, dtype=E4M3)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                tile = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
                scale[i, j] = tile.abs().max() / 448.0
                q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = _sat(tile / scale[i, j])
        return {"weight": q, "weight_scale": scale}
    if scheme == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / 448.0
        return {"weight": _sat(w / scale), "weight_scale": scale}
    scale = w.abs().max() / 448.0
    return {
        "weight": _sat(w / scale),
        "weight_scale": scale.reshape(()),
        "input_scale": torch.tensor(INPUT_AMAX / 448.0),
    }


def _quant_config(fmt: str, skip: list[str]) -> dict[str, Any]:
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128], "modules_to_not_convert": skip}  # fmt: skip
    if fmt == "modelopt":
        return {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                "exclude_modules": ["lm_head", *skip]}  # fmt: skip
    args = {"num_bits": 8, "type": "float", "symmetric": True}
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "ignore": ["lm_head", *skip],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {**args, "strategy": "channel", "dynamic": False},
            "input_activations": {**args, "strategy": "token", "dynamic": True},
        }},
    }  # fmt: skip


def write_fp8_folder(
    folder: Path,
    fmt: str,
    skip: tuple[str, ...] = (),
    family: str = "qwen3",
    edit: Callable[[Any], None] | None = None,
    **overrides: Any,
) -> Any:
    """Write a tiny Qwen3 (or, family "qwen3_moe", a tiny Qwen3-MoE: MOE_SHAPE; "deepseek_v3",
    a tiny DeepSeek-V3: DEEPSEEK_SHAPE, `fmt` "fp8-block" only) quantized in format `fmt`
    (FORMATS) to `folder`; `skip`: module names left unquantized; `edit`: changes the random
    model's weights in place before it is saved again by `save_pretrained` and quantized;
    `overrides`: config keys over the family's shape. Every projection is quantized, each
    expert's too (transformers saves them one tensor per expert, the published layout);
    routers and norms stay as they are. Returns the float32 transformers model it was made
    from."""
    model = save_tiny(family, folder, **{**_SHAPES[family], **overrides})
    if edit is not None:
        with torch.no_grad():
            edit(model)
        model.save_pretrained(folder)
    scheme = SCHEME[fmt]
    files = sorted(folder.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        tensors.update(load_file(path))
        path.unlink()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] not in PROJECTIONS + DEQUANTIZED or module in skip:
            out[name] = tensor
            continue
        for leaf, value in quantize(tensor.float(), scheme).items():
            if fmt == "fp8-block" and leaf == "weight_scale":
                leaf = "weight_scale_inv"
            if fmt == "compressed-tensors" and leaf == "weight_scale":
                value = value.to(torch.bfloat16)  # as llm-compressor stores them
            if leaf == "input_scale" and ".experts." in module:
                value = value * _expert_input_factor(module)
            out[f"{module}.{leaf}"] = value.contiguous()
        if fmt == "modelopt" and module.endswith(("k_proj", "v_proj")):
            out[f"{module}.{module[-6]}_scale"] = torch.tensor(1.0)  # KV scales of 1.0
    save_file(out, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    unconverted = list(skip)
    if family == "qwen3_moe":  # as Qwen3-30B-A3B-FP8's config lists its routers
        layers = config["num_hidden_layers"]
        unconverted += [f"model.layers.{i}.mlp.gate" for i in range(layers)]
    config["quantization_config"] = _quant_config(fmt, unconverted)
    (folder / "config.json").write_text(json.dumps(config))
    return model


def _expert_input_factor(module: str) -> float:
    """Per-expert static input scales differ, as calibration gives them (ModelOpt MoE
    folders): expert e's gate and up take 1 + e/4 and 1 + e/8 times the base scale, down
    1 + e/16, so the layer's largest (what Lockstep quantizes with) is one expert's."""
    e = int(module.split(".experts.")[1].split(".")[0])
    part = module.rsplit(".", 1)[-1]
    return 1.0 + e / {"gate_proj": 4, "up_proj": 8, "down_proj": 16}[part]


def set_quantization_config(folder: Path, **changes: Any) -> None:
    """Edit the folder's quantization_config (None deletes a key)."""
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config["quantization_config"].pop(key, None)
        else:
            config["quantization_config"][key] = value
    (folder / "config.json").write_text(json.dumps(config))


def edit_tensors(folder: Path, **changes: torch.Tensor | None) -> None:
    """Replace (or with None delete) tensors of the folder's one safetensors file; keys are
    tensor names with "/" for "."."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    for key, value in changes.items():
        name = key.replace("/", ".")
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, str(path))


class Fp8Emulation(torch.nn.Module):
    """A quantized projection in float64, from the folder's own tensors: the activation is
    rounded to fp32, quantized (per token and 128-column group, per token, or with the static
    scale), and y = sum over 128-wide K blocks, ascending, of (sx * sw) * (Xq . Wq)."""

    def __init__(self, scheme: str, parts: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.scheme = scheme
        self.wq = parts["weight"].to(torch.float64)
        scale = parts["weight_scale"].to(torch.float32).to(torch.float64)
        n, k = self.wq.shape
        if scheme == "block":
            scale = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        else:
            scale = scale.reshape(-1, 1).expand(n, k)
        self.sw = scale
        self.input_scale = parts.get("input_scale")

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.to(torch.float32)
        if self.scheme == "tensor":
            s = self.input_scale.to(torch.float32)
            return _sat(x / s).to(torch.float64), s.to(torch.float64).expand(x.shape)
        group = 128 if self.scheme == "block" else x.shape[-1]
        qs, ss = [], []
        for start in range(0, x.shape[-1], group):
            part = x[..., start : start + group]
            s = part.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10) / 448.0
            qs.append(_sat(part / s).to(torch.float64))
            ss.append(s.to(torch.float64).expand(part.shape))
        return torch.cat(qs, -1), torch.cat(ss, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, sx = self._quantize(x)
        out = 0
        for start in range(0, xq.shape[-1], 128):
            cols = slice(start, start + 128)
            partial = xq[..., cols] @ self.wq[:, cols].T
            out = out + partial * sx[..., start : start + 1] * self.sw[:, start]
        return out


class Fp8ExpertsEmulation(torch.nn.Module):
    """transformers' experts module (forward(hidden_states, top_k_index, top_k_weights)) with
    every expert's gate, up and down an `Fp8Emulation` of its checkpoint tensors: a token's
    output is the sum over its k experts of weight * down(silu(gate x) * up x), float64."""

    def __init__(self, experts: list[dict[str, Fp8Emulation]]) -> None:
        super().__init__()
        self.experts = experts

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for t in range(hidden_states.shape[0]):
            x = hidden_states[t : t + 1]
            for e, w in zip(top_k_index[t].tolist(), top_k_weights[t], strict=True):
                proj = self.experts[e]
                h = torch.nn.functional.silu(proj["gate_proj"](x)) * proj["up_proj"](x)
                out[t] += w.to(out.dtype) * proj["down_proj"](h)[0]
        return out


def dequantized_linear(weight: torch.Tensor, scale: torch.Tensor) -> torch.nn.Linear:
    """A float64 linear of the block-FP8 weight's exact value Wq * scale (no activation
    quantization): MLA's kv_b_proj as Lockstep runs it."""
    n, k = weight.shape
    sw = scale.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    linear = torch.nn.Linear(k, n, bias=False, dtype=torch.float64)
    with torch.no_grad():
        linear.weight.copy_(weight.double() * sw)
    return linear


def float64_reference(model: Any, folder: Path, fmt: str, skip: tuple[str, ...] = ()) -> Any:
    """`model` (from write_fp8_folder) in float64 with its quantized projections replaced by
    `Fp8Emulation`s built from the folder's tensors (a MoE model's experts modules by
    `Fp8ExpertsEmulation`s, MLA's kv_b_proj by its `dequantized_linear`)."""
    model = model.to(torch.float64)
    tensors = load_file(folder / "model.safetensors")
    scale_key = "weight_scale_inv" if fmt == "fp8-block" else "weight_scale"
    for name, module in list(model.named_modules()):
        if not name.endswith(".mlp.experts"):
            continue
        inputs = {}  # per-tensor experts: one static scale per projection, the layer's largest
        if fmt == "modelopt":
            for proj, parts in (("gate_up", ("gate_proj", "up_proj")), ("down", ("down_proj",))):
                inputs[proj] = torch.stack([tensors[f"{name}.{e}.{p}.input_scale"]
                                            for e in range(module.num_experts)
                                            for p in parts]).amax()  # fmt: skip
        experts = [
            {
                p: Fp8Emulation(SCHEME[fmt], {
                    "weight": tensors[f"{name}.{e}.{p}.weight"],
                    "weight_scale": tensors[f"{name}.{e}.{p}.{scale_key}"],
                    **({"input_scale": inputs["down" if p == "down_proj" else "gate_up"]}
                       if inputs else {}),
                })
                for p in ("gate_proj", "up_proj", "down_proj")
            }
            for e in range(module.num_experts)
        ]  # fmt: skip
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        parent.experts = Fp8ExpertsEmulation(experts)
    for name, _ in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        if leaf in DEQUANTIZED and name not in skip:
            weight, scale = tensors[f"{name}.weight"], tensors[f"{name}.{scale_key}"]
            setattr(parent, leaf, dequantized_linear(weight, scale))
        if leaf not in PROJECTIONS or name in skip:
            continue
        parts = {
            "weight": tensors[f"{name}.weight"],
            "weight_scale": tensors[f"{name}.{scale_key}"],
        }
        if fmt == "modelopt":
            parts["input_scale"] = tensors[f"{name}.input_scale"]
        setattr(parent, leaf, Fp8Emulation(SCHEME[fmt], parts))
    return model
