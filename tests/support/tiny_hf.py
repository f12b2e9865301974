"""Tiny random Hugging Face model folders that tests write themselves (no model hub here):
transformers builds and saves the model, which is also the reference implementation."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lockstep.models.presets import CHATML_TEMPLATE, byte_tokenizer


def _tiny_config(family: str, overrides: dict[str, Any]) -> Any:
    import transformers

    # head_dim 64 (the CPU kernels take 64 or 128); Qwen3's is explicit and != hidden / heads.
    common = dict(
        vocab_size=300, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
        rms_norm_eps=1e-6,
    )  # fmt: skip
    if family == "llama":
        rope = {
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        }  # fmt: skip
        return transformers.LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False)
    if family == "qwen2":
        return transformers.Qwen2Config(
            **common, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            tie_word_embeddings=True,
        )  # fmt: skip
    qwen3 = dict(
        common, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
    )  # fmt: skip
    if family == "gemma3":
        # Gemma 3's structure, small: local layers with a window of 8 keys (shorter than the
        # tests' prompts) around a global one whose RoPE is linearly scaled; a score scale
        # (query_pre_attn_scalar) that is not head_dim's.
        rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}  # fmt: skip
        gemma = dict(
            num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=48,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters=rope, tie_word_embeddings=True,
        )  # fmt: skip
        return transformers.Gemma3TextConfig(**{**qwen3, **gemma, **overrides})
    if family in ("mistral", "ministral"):
        # Llama's layers with an explicit head_dim and no window (Mistral v0.2 and later);
        # sliding_window=8 (shorter than the tests' prompts) windows every layer of Mistral
        # (v0.1), the layers layer_types names of Ministral (here around a full one).
        mistral = dict(sliding_window=None, rope_parameters={"rope_type": "default",
                                                             "rope_theta": 1e4})  # fmt: skip
        if family == "mistral":
            return transformers.MistralConfig(**{**qwen3, **mistral, **overrides})
        ministral = dict(
            num_hidden_layers=3, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )  # fmt: skip
        return transformers.MinistralConfig(**{**qwen3, **mistral, **ministral, **overrides})
    if family == "phi3":
        # Phi-3's fused qkv_proj and gate_up_proj with LongRoPE over half of each head
        # (Phi-4-mini rotates three quarters): short factors within the original context of
        # 128 positions, long ones past it.
        rng = torch.Generator().manual_seed(5)
        factors = [(1.0 + 3.0 * torch.rand(16, generator=rng)).tolist() for _ in range(2)]
        rope = {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                "short_factor": factors[0], "long_factor": factors[1],
                "original_max_position_embeddings": 128, "factor": 4.0}  # fmt: skip
        phi = dict(common, num_attention_heads=2, num_key_value_heads=1, rope_parameters=rope,
                   max_position_embeddings=512, original_max_position_embeddings=128,
                   sliding_window=None, tie_word_embeddings=False, bos_token_id=None,
                   eos_token_id=None, pad_token_id=None)  # fmt: skip
        return transformers.Phi3Config(**{**phi, **overrides})
    if family == "qwen3_5":
        # Qwen3.5's hybrid: 3 Gated DeltaNet layers then gated full attention with a quarter
        # of each head rotated; 2 key heads serving 4 value heads.
        hybrid = dict(
            num_hidden_layers=4, linear_conv_kernel_dim=4, linear_key_head_dim=32,
            linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                             "partial_rotary_factor": 0.25},
        )  # fmt: skip
        return transformers.Qwen3_5TextConfig(**{**qwen3, **hybrid, **overrides})
    if family in ("qwen3_5_moe", "qwen3_next"):
        # The hybrid MoE families: Qwen3.5's hybrid layout with 8 experts, top 2, and a gated
        # shared expert (widths 40 and 48: not multiples of the CPU's 16 lanes) in the sparse
        # layers. Qwen3-Next also keeps one layer dense (mlp_only_layers) and stores its Gated
        # DeltaNet projections grouped by key head.
        hybrid = dict(
            num_hidden_layers=4, linear_conv_kernel_dim=4, linear_key_head_dim=32,
            linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                             "partial_rotary_factor": 0.25},
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40,
            shared_expert_intermediate_size=48,
        )  # fmt: skip
        if family == "qwen3_5_moe":
            return transformers.Qwen3_5MoeTextConfig(**{**qwen3, **hybrid, **overrides})
        sparse = dict(decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True)
        return transformers.Qwen3NextConfig(**{**qwen3, **hybrid, **sparse, **overrides})
    if family in ("deepseek_v3", "deepseek_v2", "glm4_moe_lite"):
        # MLA (latent 64 + RoPE key 32: a cache row of 96) and DeepSeek routing over 8
        # experts of width 40, top 2, plus one ungated shared expert; layer 0 dense. V3: a q
        # LoRA, sigmoid scores within the best 2 of 4 groups, a correction bias (set by
        # save_tiny), YaRN with an mscale on both the tables and the scores. V2: no q LoRA,
        # softmax greedy routing scaled by 1.5. GLM-4.7-Flash: V3's routing without groups.
        mla = dict(
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64,
            q_lora_rank=48, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=40,
            n_shared_experts=1, tie_word_embeddings=False,
        )  # fmt: skip
        if family == "deepseek_v3":
            rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "mscale": 1.0,
                    "mscale_all_dim": 0.707, "original_max_position_embeddings": 64,
                    "beta_fast": 32, "beta_slow": 1}  # fmt: skip
            v3 = dict(n_group=4, topk_group=2, first_k_dense_replace=1, norm_topk_prob=True,
                      routed_scaling_factor=2.5, rope_parameters=rope)  # fmt: skip
            return transformers.DeepseekV3Config(**{**common, **mla, **v3, **overrides})
        if family == "deepseek_v2":
            rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "mscale": 0.707,
                    "mscale_all_dim": 0.707, "original_max_position_embeddings": 128}  # fmt: skip
            v2 = dict(q_lora_rank=None, first_k_dense_replace=1, topk_method="greedy",
                      routed_scaling_factor=1.5, norm_topk_prob=False, rope_parameters=rope)  # fmt: skip
            return transformers.DeepseekV2Config(**{**common, **mla, **v2, **overrides})
        glm = dict(n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.8,
                   mlp_layer_types=["dense", "sparse", "sparse"],
                   rope_parameters={"rope_type": "default", "rope_theta": 1e6})  # fmt: skip
        return transformers.Glm4MoeLiteConfig(**{**common, **mla, **glm, **overrides})
    if family == "qwen3_moe":
        # 8 experts, top 2, over 4 layers of which `decoder_sparse_step` and `mlp_only_layers`
        # make some dense; an expert width (40) that is not a multiple of the CPU's 16 lanes.
        moe = dict(
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True,
            num_hidden_layers=4, decoder_sparse_step=1, mlp_only_layers=[2],
        )  # fmt: skip
        return transformers.Qwen3MoeConfig(**{**qwen3, **moe, **overrides})
    return transformers.Qwen3Config(**{**qwen3, **overrides})


def save_tiny(family: str, folder: Path, seed: int | None = None, **config_overrides: Any) -> Any:
    """Write a tiny random `family` model (transformers' own) and a byte tokenizer to
    `folder`; returns the transformers model. `seed`: the weights (default: per family);
    `config_overrides`: config keys (the Qwen3, Gemma 3, DeepSeek, Mistral and Phi-3 families, e.g.
    decoder_sparse_step=2, sliding_window=8)."""
    import transformers

    overridable = ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next", "gemma3",
                   "deepseek_v3", "deepseek_v2", "glm4_moe_lite", "mistral", "ministral", "phi3")  # fmt: skip
    if config_overrides and family not in overridable:
        raise ValueError(f"config overrides are for {', '.join(overridable)}, not {family}")
    # The hybrid MoE seeds give models whose float32 logits are well-conditioned: with some
    # seeds transformers' own float32 logits are already 1e-4 from its float64 ones (a flat
    # router and the delta rule amplify rounding), which leaves nothing under the 1e-4
    # tolerance the reference tests use.
    default_seed = {"llama": 1, "qwen2": 2, "qwen3": 3, "qwen3_moe": 4, "qwen3_5": 5,
                    "qwen3_5_moe": 11, "qwen3_next": 7, "gemma3": 6, "deepseek_v3": 8,
                    "deepseek_v2": 9, "glm4_moe_lite": 10, "mistral": 12,
                    "ministral": 13, "phi3": 14}[family]  # fmt: skip
    torch.manual_seed(default_seed if seed is None else seed)
    model = transformers.AutoModelForCausalLM.from_config(
        _tiny_config(family, config_overrides), dtype=torch.float32
    ).eval()
    # Weights that make every part visible: O(1) activations, norms that are not all ones.
    with torch.no_grad():
        for name, param in model.named_parameters():
            stored_minus_one = family in ("qwen3_5", "qwen3_5_moe", "qwen3_next", "gemma3")
            if stored_minus_one and name.endswith("norm.weight") and "linear_attn" not in name:
                param.copy_(0.2 * torch.randn_like(param))  # stored as w - 1
            elif name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.2 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3: zero at init
                buffer.copy_(0.1 * torch.randn_like(buffer))
    model.save_pretrained(folder)
    byte_tokenizer(model.config.vocab_size, add_bos=False).backend.save(
        str(folder / "tokenizer.json")
    )
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": None, "eos_token": "<|eos|>", "chat_template": CHATML_TEMPLATE})
    )
    return model


def add_mtp_layer(folder: Path, seed: int = 0) -> None:
    """Give a tiny DeepSeek-V3 or Qwen3.5 folder written by `save_tiny` a multi-token-prediction
    layer, as the released checkpoints ship it and transformers does not save it: a file
    `mtp.safetensors` beside the model's, under the checkpoints' names (DeepSeek-V3:
    `model.layers.{num_hidden_layers}.*` with enorm, hnorm, eh_proj and shared_head; Qwen3.5:
    `mtp.fc`, `mtp.pre_fc_norm_*`, `mtp.norm`, `mtp.layers.0.*`), its decoder layer a perturbed
    copy of the model's last full-attention layer, and the config key that declares it."""
    from safetensors.torch import load_file, save_file

    config = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    h, layers = config["hidden_size"], config["num_hidden_layers"]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen)

    deepseek = config["model_type"] == "deepseek_v3"
    if deepseek:
        source, prefix = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
        one = 1.0  # norms stored as w
        own = {
            prefix + "embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
            prefix + "shared_head.head.weight": randn(config["vocab_size"], h) / h**0.5,
            prefix + "shared_head.norm.weight": one + 0.2 * randn(h),
            prefix + "enorm.weight": one + 0.2 * randn(h),
            prefix + "hnorm.weight": one + 0.2 * randn(h),
            prefix + "eh_proj.weight": randn(h, 2 * h) / (2 * h) ** 0.5,
        }
        config["num_nextn_predict_layers"] = 1
    else:
        full = [i for i, t in enumerate(config["layer_types"]) if t == "full_attention"]
        source, prefix = f"model.layers.{full[-1]}.", "mtp.layers.0."
        own = {  # norms stored as w - 1
            "mtp.fc.weight": randn(h, 2 * h) / (2 * h) ** 0.5,
            "mtp.pre_fc_norm_embedding.weight": 0.2 * randn(h),
            "mtp.pre_fc_norm_hidden.weight": 0.2 * randn(h),
            "mtp.norm.weight": 0.2 * randn(h),
        }
        config["mtp_num_hidden_layers"] = 1
    for name, tensor in state.items():
        if name.startswith(source):
            own[prefix + name.removeprefix(source)] = tensor + 0.05 * randn(*tensor.shape) * (
                tensor.std() if tensor.numel() > 1 else 1.0
            )
    save_file({k: v.contiguous() for k, v in own.items()}, str(folder / "mtp.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def write_hub_cache(
    cache: Path, repo_id: str, folder: Path, commit: str, ref: str = "main"
) -> Path:
    """Lay `folder`'s files out in a Hugging Face hub cache as `huggingface_hub` writes them:
    `models--org--name/blobs/<sha256>`, `snapshots/<commit>/<file>` as relative links to the
    blobs, and `refs/<ref>` holding the commit. Returns the snapshot folder."""
    import hashlib
    import os

    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for path in sorted(folder.iterdir()):
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / path.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


def check_serve_passes_every_scenario(
    family: str,
    tmp_path: Path,
    write: Callable[..., Any] = save_tiny,
    serve_args: tuple[str, ...] = (),
) -> None:
    """`lockstep check --serve --model <tiny `family` folder>` (CPU, one run): every scenario
    but restart passes (left out: a second server start, which the default model's end-to-end
    run in tests/unit/check/test_check.py covers), the radix one with cached tokens reported
    on every hit. `write(family, folder, vocab_size=...)` writes the folder (default
    `save_tiny`; e.g. an FP8 writer of tests/support/tiny_fp8.py); `serve_args`: more
    `lockstep serve` arguments (e.g. "--tp", "2")."""
    import argparse

    from lockstep.check.cli import add_check_parser
    from lockstep.check.compare import PASS

    folder = tmp_path / family
    folder.mkdir()
    write(family, folder, vocab_size=8192)  # the check draws token ids up to 8000
    out = tmp_path / "out.json"
    parser = argparse.ArgumentParser(prog="lockstep")
    add_check_parser(parser.add_subparsers())
    args = parser.parse_args([
        "check", "--serve", "--model", str(folder), "--max-model-len", "512", "--max-tokens",
        "8", "--concurrency", "4", "--device", "cpu", "--budget-s", "1800", "--no-progress",
        "--scenarios", "batch,prefix,radix,score,sampling,long", "--json", str(out),
        *(f"--serve-arg={arg}" for arg in serve_args),
    ])  # fmt: skip
    code = args.func(args)
    results = {r["name"]: r for r in json.loads(out.read_text())["scenarios"]}
    assert list(results) == ["batch", "prefix", "radix", "score", "sampling", "long"]
    for r in results.values():
        assert r["status"] == PASS, r
    assert code == 0
    assert results["radix"]["cached_tokens"] > 0
