"""Saving a trained `LockstepForCausalLM` as a Hugging Face folder that transformers and
Lockstep both load: config.json, model.safetensors and the tokenizer files.

The tensors are the model's `state_dict()` as they are (norm weights float32, the rest in the
model dtype), so Lockstep loads back exactly the trained values. config.json is the source
folder's own (its `dtype` set to the model's) when the model came from a Hugging Face folder,
else one written from the spec (a GGUF file, a `random:` preset); the tokenizer files are the
source folder's, else `tokenizer_folder.hf_files` (the same token ids as Lockstep's tokenizer).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from lockstep.models.spec import ModelSpec
from lockstep.models.tokenizer_folder import hf_files

if TYPE_CHECKING:
    from lockstep.training.model import LockstepForCausalLM

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "qwen3_5": "Qwen3_5ForCausalLM"}  # fmt: skip
# config.json's model_type where it is not the family's name.
MODEL_TYPES = {"qwen3_5": "qwen3_5_text"}
# Files of a source folder that describe the model besides its weights.
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "chat_template.jinja")  # fmt: skip


def save_folder(model: LockstepForCausalLM, folder: Path) -> None:
    """Write `model` to `folder` (created if missing; files of the same names replaced)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {n: _host_copy(t) for n, t in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    dtype_name = str(model.dtype).removeprefix("torch.")
    source = Path(model.source)
    if (source / "config.json").is_file():
        for name in COPIED:
            if (source / name).is_file() and source.resolve() != folder.resolve():
                shutil.copyfile(source / name, folder / name)
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        config.pop("torch_dtype", None)
        config["dtype"] = dtype_name
    else:
        config = hf_config(model.spec, model.tokenizer.bos_token_id,
                           model.tokenizer.eos_token_id, dtype_name)  # fmt: skip
        for name, text in hf_files(model.tokenizer, model.spec.max_position).items():
            (folder / name).write_text(text, encoding="utf-8")
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def hf_config(
    spec: ModelSpec, bos_token_id: int | None, eos_token_id: int | None, dtype: str
) -> dict[str, Any]:
    """A transformers config.json for a spec of the families a `random:` preset or a GGUF
    file gives (Llama, Qwen2, Qwen3, Qwen3-MoE: its sparse layers as `mlp_only_layers`'
    complement; Qwen3.5: its layer types and Gated DeltaNet shapes), RoPE in transformers 5's
    `rope_parameters` (Lockstep reads it too). A trainer loaded from a folder copies that
    folder's config instead (`save_folder`)."""
    if spec.family not in ARCHITECTURES:
        raise ValueError(
            f"no config.json writer for family {spec.family!r}: supported "
            f"{', '.join(ARCHITECTURES)} (load the model from a folder to save it)"
        )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.rope_scaling is not None:
        s = spec.rope_scaling
        rope.update(rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
                    high_freq_factor=s.high_freq_factor,
                    original_max_position_embeddings=s.original_max_position)  # fmt: skip
    config: dict[str, Any] = {
        "model_type": MODEL_TYPES.get(spec.family, spec.family),
        "architectures": [ARCHITECTURES[spec.family]],
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": spec.rms_norm_eps,
        "max_position_embeddings": spec.max_position,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "rope_parameters": rope,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "dtype": dtype,
    }
    if spec.family == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    if spec.partial_rotary_factor != 1.0:
        rope["partial_rotary_factor"] = spec.partial_rotary_factor
    if spec.linear is not None:
        lin = spec.linear
        config.update(layer_types=list(lin.layer_types), linear_conv_kernel_dim=lin.conv_kernel,
                      linear_key_head_dim=lin.key_head_dim,
                      linear_value_head_dim=lin.value_head_dim,
                      linear_num_key_heads=lin.num_key_heads,
                      linear_num_value_heads=lin.num_value_heads)  # fmt: skip
    if spec.moe is not None:
        moe = spec.moe
        config.update(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                      moe_intermediate_size=moe.intermediate_size,
                      norm_topk_prob=moe.renormalize, decoder_sparse_step=1,
                      mlp_only_layers=[i for i in range(spec.num_layers)
                                       if i not in moe.sparse_layers])  # fmt: skip
    return config


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the host, contiguous and alone in its storage: safetensors refuses tensors
    that share memory, as the rows of one fused weight do (training/fused_parameters.py)."""
    host = tensor.detach().to("cpu").contiguous()
    return host if host.untyped_storage().nbytes() == host.nbytes else host.clone()
