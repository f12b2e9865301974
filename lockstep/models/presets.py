"""Random-weight models with real shapes ("random:qwen3-8b"), for benchmarks and GPU tests.

No machine here reaches a model hub, so the large shapes exist only as presets. Weights are
reproducible and independent of how they are produced: each tensor comes from its own
generator, seeded by (random_seed, tensor name), on the target device, so iteration order,
which tensors are skipped, and how many devices share the work change nothing. Values are
drawn in float32 and then cast, so a bf16 model holds the bf16 roundings of the float32 one.

Scales keep activations O(1) through many layers: projections N(0, 1/fan_in), embeddings
N(0, 0.02^2) (Gemma's, scaled by sqrt(hidden), O(1)), biases N(0, 0.1^2), every norm weight
1 (stored as 0 where the family stores w - 1). Gated DeltaNet layers: conv weights N(0, 1/kernel), dt_bias 1, A_log = log(A) with A
uniform in [1, 16).

FP8 presets ("-fp8": block-wise, "-fp8-static": per-tensor with static input scales,
"-fp8-channel": per-channel weights) draw the same float32 projections and quantize them as
the checkpoint formats do (`lockstep.ops.fp8.quantize_weight`); a static input scale covers
activations up to +-STATIC_INPUT_AMAX. Embeddings, LM head, norms and MoE routers stay
unquantized; the MoE presets' "-fp8" twins quantize every expert block-wise, as
Qwen3-30B-A3B-FP8 does, and the DeepSeeks' ("tiny-deepseek-v3-fp8" has widths of whole
128-row blocks) their MLA projections too, as DeepSeek-V3's own FP8 release does.

The tokenizer is byte-level: ids 0-255 are the bytes, then a few special tokens, then unused
ids up to the vocabulary size, with a ChatML template, so text prompts work end to end.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import tokenizers
import torch
from tokenizers import AddedToken, decoders, pre_tokenizers
from tokenizers.models import BPE

from lockstep.errors import ModelLoadError
from lockstep.models.blocks import expected_weight_names, expected_weight_shape
from lockstep.models.families import family_of
from lockstep.models.spec import (
    Fp8Spec,
    LinearAttentionSpec,
    ModelSpec,
    MoeSpec,
    SlidingWindowSpec,
)
from lockstep.models.tokenizer import Tokenizer, byte_level_alphabet
from lockstep.ops.fp8 import quantize_weight

STATIC_INPUT_AMAX = 16.0


@dataclass(frozen=True)
class Preset:
    spec: ModelSpec
    add_bos: bool  # as the real model's tokenizer does


def _preset(config: dict[str, Any], add_bos: bool) -> Preset:
    """A preset from the keys of its model's config.json, read by the family registry as a
    Hugging Face folder's are (lockstep/models/families): a preset has the spec the real
    checkpoint would get."""
    where = f"preset config {config['model_type']}"
    return Preset(family_of(config, where).spec(config, where), add_bos)


def _config(model_type: str, **keys: Any) -> dict[str, Any]:
    """A config.json's keys: `keys` over the defaults the presets share."""
    return {"model_type": model_type, "rms_norm_eps": 1e-6, "tie_word_embeddings": False} | keys


def _tiny(model_type: str, **keys: Any) -> dict[str, Any]:
    # head_dim 64, as real small models use (the CPU attention kernels take 32, 64 or 128);
    # num_heads * head_dim (256) differs from hidden_size (128), as in Qwen3, so a decoder that
    # confuses the two fails on the tiny models already.
    tiny = {
        "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "rope_theta": 10000.0, "max_position_embeddings": 4096,
    }  # fmt: skip
    return _config(model_type, **(tiny | keys))


def _qwen3(model_type: str = "qwen3", **keys: Any) -> dict[str, Any]:
    """Qwen3's (and Qwen3-MoE's) shared keys: vocabulary, RoPE base and context."""
    shared = {"vocab_size": 151936, "rope_theta": 1000000.0, "max_position_embeddings": 40960}
    return _config(model_type, **(shared | keys))


def _gemma3(
    vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, head_dim: int,
    window: int, linear_factor: float, max_position: int,
) -> ModelSpec:  # fmt: skip
    """Gemma 3's structure: five sliding-window layers (RoPE base 10,000) to one global layer
    (base 1,000,000, linearly scaled in the 4B and larger), scores scaled by
    query_pre_attn_scalar 256 ** -0.5, as the published configs have it."""
    types = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                  for i in range(layers))  # fmt: skip
    return ModelSpec(
        family="gemma3", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position=max_position,
        tie_word_embeddings=True, qk_norm=True,
        sliding=SlidingWindowSpec(window, types, 10_000.0), mlp_activation="gelu_tanh",
        sandwich_norms=True, embed_scale=True, norm_style="offset", attention_scale=256**-0.5,
        rope_linear_factor=linear_factor,
    )  # fmt: skip


def _yarn(factor: float, mscale: float, mscale_all_dim: float, original: int) -> dict[str, Any]:
    """DeepSeek's YaRN RoPE scaling keys."""
    return {"type": "yarn", "factor": factor, "mscale": mscale, "mscale_all_dim": mscale_all_dim,
            "original_max_position_embeddings": original, "beta_fast": 32, "beta_slow": 1}  # fmt: skip


def _deepseek(model_type: str, **keys: Any) -> dict[str, Any]:
    """The keys DeepSeek-V2 and V3 configs share (DeepSeek-V3's values), under `keys`."""
    shared = {
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_shared_experts": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    }  # fmt: skip
    return _config(model_type, **(shared | keys))


def _hybrid_layers(num_layers: int, interval: int) -> tuple[str, ...]:
    """Qwen3.5's pattern: every `interval`-th layer full attention, the others linear."""
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(num_layers))  # fmt: skip


# Llama 3.1's RoPE scaling (its 8B and 70B configs).
_LLAMA31_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}  # fmt: skip
_LLAMA3 = {"vocab_size": 128256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 131072, "rope_scaling": _LLAMA31_ROPE}  # fmt: skip
# 8 experts, top 2, renormalized, every layer sparse: Qwen3-30B-A3B's structure, small.
_TINY_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
             "norm_topk_prob": True}  # fmt: skip
# Qwen3.5's Gated DeltaNet keys (transformers' Qwen3_5TextConfig names).
_QWEN35 = {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "linear_conv_kernel_dim": 4}

PRESETS: dict[str, Preset] = {
    "tiny": _preset(_tiny("llama"), add_bos=True),
    "tiny-qwen2": _preset(_tiny("qwen2", attention_bias=True, tie_word_embeddings=True),
                          add_bos=False),
    "tiny-qwen3": _preset(_tiny("qwen3"), add_bos=False),
    # Mistral v0.1's structure, small: every layer's attention windowed, over 16 keys.
    "tiny-mistral": _preset(_tiny("mistral", sliding_window=16), add_bos=True),
    "tiny-qwen3-moe": _preset(_tiny("qwen3_moe", **_TINY_MOE), add_bos=False),
    # Qwen3.5's structure, small: two Gated DeltaNet layers, then gated full attention with
    # a quarter of each head rotated; 2 key heads serving 4 value heads.
    "tiny-qwen3.5": _preset(
        _tiny("qwen3_5_text", **_QWEN35, num_hidden_layers=3, full_attention_interval=3,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
              linear_value_head_dim=32),
        add_bos=False,
    ),
    # Gemma 3's structure, small: a window of 16 keys, the sixth layer global (head_dim 64:
    # the CPU attention kernels take 32, 64 or 128).
    "tiny-gemma3": Preset(
        _gemma3(512, 128, 256, 6, 4, 2, 64, window=16, linear_factor=1.0, max_position=4096),
        add_bos=True,
    ),
    # google/gemma-3-4b-it's and gemma-3-12b-it's text models.
    "gemma3-4b": Preset(
        _gemma3(262208, 2560, 10240, 34, 8, 4, 256, window=1024, linear_factor=8.0,
                max_position=131072),
        add_bos=True,
    ),
    "gemma3-12b": Preset(
        _gemma3(262208, 3840, 15360, 48, 16, 8, 256, window=1024, linear_factor=8.0,
                max_position=131072),
        add_bos=True,
    ),
    # transformers' Qwen3_5TextConfig defaults ("Qwen3.5-9B style"), rope theta as Qwen3.5's.
    "qwen3.5-9b": _preset(
        _config("qwen3_5_text", vocab_size=248320, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                max_position_embeddings=32768, full_attention_interval=4, linear_num_key_heads=16,
                linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                **_QWEN35),
        add_bos=False,
    ),
    # The hybrid MoE families, small: tiny-qwen3.5's layers with 8 experts (top 2) and a
    # gated shared expert in every layer (Qwen3.5-MoE), or with its Gated DeltaNet inputs
    # grouped by key head and the middle layer dense (Qwen3-Next).
    "tiny-qwen3.5-moe": Preset(
        ModelSpec(
            family="qwen3_5_moe", vocab_size=512, hidden_size=128, intermediate_size=48,
            num_layers=3, num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=10000000.0,
            rms_norm_eps=1e-6, max_position=4096, tie_word_embeddings=False, qk_norm=True,
            partial_rotary_factor=0.25, norm_style="offset", output_gate=True,
            linear=LinearAttentionSpec(
                layer_types=_hybrid_layers(3, 3), num_key_heads=2, num_value_heads=4,
                key_head_dim=32, value_head_dim=32, conv_kernel=4,
            ),
            moe=MoeSpec(num_experts=8, top_k=2, intermediate_size=32, renormalize=True,
                        sparse_layers=(0, 1, 2), shared_expert_size=48),
        ),
        add_bos=False,
    ),
    "tiny-qwen3-next": Preset(
        ModelSpec(
            family="qwen3_next", vocab_size=512, hidden_size=128, intermediate_size=256,
            num_layers=3, num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=10000000.0,
            rms_norm_eps=1e-6, max_position=4096, tie_word_embeddings=False, qk_norm=True,
            partial_rotary_factor=0.25, norm_style="offset", output_gate=True,
            linear=LinearAttentionSpec(
                layer_types=_hybrid_layers(3, 3), num_key_heads=2, num_value_heads=4,
                key_head_dim=32, value_head_dim=32, conv_kernel=4, grouped_projections=True,
            ),
            moe=MoeSpec(num_experts=8, top_k=2, intermediate_size=32, renormalize=True,
                        sparse_layers=(0, 2), shared_expert_size=48),
        ),
        add_bos=False,
    ),
    # Qwen3.5-35B-A3B (transformers' Qwen3_5MoeTextConfig defaults, Qwen3.5's rope theta):
    # its bf16 weights fit one H200 (the bytes: docs/models.md, "Random presets").
    "qwen3.5-35b-a3b": Preset(
        ModelSpec(
            family="qwen3_5_moe", vocab_size=248320, hidden_size=2048, intermediate_size=512,
            num_layers=40, num_heads=16, num_kv_heads=2, head_dim=256, rope_theta=10000000.0,
            rms_norm_eps=1e-6, max_position=32768, tie_word_embeddings=False, qk_norm=True,
            partial_rotary_factor=0.25, norm_style="offset", output_gate=True,
            linear=LinearAttentionSpec(
                layer_types=_hybrid_layers(40, 4), num_key_heads=16, num_value_heads=32,
                key_head_dim=128, value_head_dim=128, conv_kernel=4,
            ),
            moe=MoeSpec(num_experts=256, top_k=8, intermediate_size=512, renormalize=True,
                        sparse_layers=tuple(range(40)), shared_expert_size=512),
        ),
        add_bos=False,
    ),
    # Qwen3-Next-80B-A3B: its bf16 weights exceed one H200 (docs/models.md), so the engine
    # refuses it there with that arithmetic and the degree that fits (--tp 2).
    "qwen3-next-80b-a3b": Preset(
        ModelSpec(
            family="qwen3_next", vocab_size=151936, hidden_size=2048, intermediate_size=5120,
            num_layers=48, num_heads=16, num_kv_heads=2, head_dim=256, rope_theta=10000000.0,
            rms_norm_eps=1e-6, max_position=32768, tie_word_embeddings=False, qk_norm=True,
            partial_rotary_factor=0.25, norm_style="offset", output_gate=True,
            linear=LinearAttentionSpec(
                layer_types=_hybrid_layers(48, 4), num_key_heads=16, num_value_heads=32,
                key_head_dim=128, value_head_dim=128, conv_kernel=4, grouped_projections=True,
            ),
            moe=MoeSpec(num_experts=512, top_k=10, intermediate_size=512, renormalize=True,
                        sparse_layers=tuple(range(48)), shared_expert_size=512),
        ),
        add_bos=False,
    ),
    # Qwen3.5-397B-A17B's text model, the largest hybrid MoE released: 15 x (3 Gated DeltaNet
    # + 1 gated full attention) layers, 512 experts of 1024 (top 10) and a shared expert of
    # 1024 in every layer, 16 key / 64 value linear heads; 396.35 B parameters. Its bf16
    # weights need 8 H200s (--tp 8: 92.5 GiB a GPU) and exceed 8 H100s.
    "qwen3.5-397b-a17b": Preset(
        ModelSpec(
            family="qwen3_5_moe", vocab_size=248320, hidden_size=4096, intermediate_size=1024,
            num_layers=60, num_heads=32, num_kv_heads=2, head_dim=256, rope_theta=10000000.0,
            rms_norm_eps=1e-6, max_position=32768, tie_word_embeddings=False, qk_norm=True,
            partial_rotary_factor=0.25, norm_style="offset", output_gate=True,
            linear=LinearAttentionSpec(
                layer_types=_hybrid_layers(60, 4), num_key_heads=16, num_value_heads=64,
                key_head_dim=128, value_head_dim=128, conv_kernel=4,
            ),
            moe=MoeSpec(num_experts=512, top_k=10, intermediate_size=1024, renormalize=True,
                        sparse_layers=tuple(range(60)), shared_expert_size=1024),
        ),
        add_bos=False,
    ),
    # The DeepSeek architecture (multi-head latent attention, DeepSeek MoE routing), small:
    # tiny-deepseek-v3 has a q LoRA, sigmoid routing within the best 2 of 4 expert groups with
    # a correction bias, one ungated shared expert, layer 0 dense and YaRN RoPE.
    "tiny-deepseek-v3": _preset(
        _deepseek("deepseek_v3", vocab_size=512, hidden_size=128, intermediate_size=256,
                  moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                  q_lora_rank=48, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
                  v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                  topk_group=2, first_k_dense_replace=1, max_position_embeddings=4096,
                  rope_scaling=_yarn(8.0, 1.0, 1.0, 512)),
        add_bos=False,
    ),
    # DeepSeek-V2-Lite (15.7 B): no q LoRA, softmax greedy routing, two shared experts.
    "deepseek-v2-lite": _preset(
        _deepseek("deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                  moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
                  q_lora_rank=None, n_routed_experts=64, num_experts_per_tok=6,
                  n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy",
                  norm_topk_prob=False, routed_scaling_factor=1.0,
                  max_position_embeddings=163840, rope_scaling=_yarn(40.0, 0.707, 0.707, 4096)),
        add_bos=True,
    ),
    # GLM-4.7-Flash (transformers' Glm4MoeLiteConfig defaults): DeepSeek-V3's attention and
    # routing without expert groups, value heads of 256.
    "glm-4.7-flash": _preset(
        _config("glm4_moe_lite", vocab_size=154880, hidden_size=2048, intermediate_size=10240,
                moe_intermediate_size=1536, num_hidden_layers=47, num_attention_heads=20,
                q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
                v_head_dim=256, n_routed_experts=64, num_experts_per_tok=4, n_shared_experts=1,
                n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.8,
                rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=202752),
        add_bos=False,
    ),
    # DeepSeek-V3 / R1 (671 B without its multi-token-prediction layer): 1.25 TiB in bf16,
    # refused on one GPU with that arithmetic; TP and EP 2-8 shard it (deepseek-v3-fp8, its
    # FP8 release, runs at tp 1).
    "deepseek-v3": _preset(
        _deepseek("deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                  moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                  q_lora_rank=1536, n_routed_experts=256, num_experts_per_tok=8, n_group=8,
                  topk_group=4, first_k_dense_replace=3, max_position_embeddings=163840,
                  rope_scaling=_yarn(40.0, 1.0, 1.0, 4096)),
        add_bos=True,
    ),
    # Mistral-7B-v0.1: a window of 4,096 keys in every layer.
    "mistral-7b-v0.1": _preset(
        _config("mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, rope_theta=10000.0, rms_norm_eps=1e-5,
                max_position_embeddings=32768, sliding_window=4096),
        add_bos=True,
    ),
    # Phi-3's structure, small: LongRoPE over three quarters of each head (Phi-4-mini's
    # share), long factors past an original context of 1,024 positions.
    "tiny-phi3": _preset(
        _config("phi3", vocab_size=512, hidden_size=256, intermediate_size=256,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=4096,
                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.75, "short_factor": [1.0] * 24,
                                 "long_factor": [1.0 + i / 8 for i in range(24)],
                                 "original_max_position_embeddings": 1024}),
        add_bos=True,
    ),
    # microsoft/Phi-3-mini-4k-instruct: a window of 2,047 keys in every layer, 3.82 B.
    "phi3-mini-4k": _preset(
        _config("phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096,
                sliding_window=2047),
        add_bos=True,
    ),
    "smollm2-135m": _preset(
        _config("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
                tie_word_embeddings=True),
        add_bos=False,
    ),
    "qwen2-0.5b": _preset(
        _config("qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True,
                attention_bias=True),
        add_bos=False,
    ),
    "qwen3-0.6b": _preset(
        _qwen3(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
               num_attention_heads=16, num_key_value_heads=8, head_dim=128,
               tie_word_embeddings=True),
        add_bos=False,
    ),
    "qwen3-8b": _preset(
        _qwen3(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128),
        add_bos=False,
    ),
    "qwen3-30b-a3b": _preset(
        _qwen3(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
               num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
               num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
               norm_topk_prob=True),
        add_bos=False,
    ),
    "llama3-8b": _preset(
        _config("llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, **_LLAMA3),
        add_bos=True,
    ),
    # Models larger than one GPU, for tensor parallelism (Llama 3.1 70B, Qwen3-32B shapes).
    "llama3-70b": _preset(
        _config("llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, head_dim=128, **_LLAMA3),
        add_bos=True,
    ),
    "qwen3-32b": _preset(
        _qwen3(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
               num_attention_heads=64, num_key_value_heads=8, head_dim=128),
        add_bos=False,
    ),
    # Qwen3-235B-A22B: 470 GB in bf16, more than any one GPU; 128 experts, so tensor and
    # expert parallelism of 2, 4 and 8 both shard it (lockstep/parallel/sharding.py).
    "qwen3-235b-a22b": _preset(
        _qwen3(model_type="qwen3_moe", hidden_size=4096, intermediate_size=12288,
               num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
               head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536,
               norm_topk_prob=True),
        add_bos=False,
    ),
}  # fmt: skip


def _fp8_variants() -> dict[str, Preset]:
    """FP8 twins of the Qwen3 and Qwen3-MoE presets: "-fp8" block-wise (Qwen's own FP8 release
    format), "-fp8-static" per-tensor static (ModelOpt), "-fp8-channel" per-channel
    (compressed-tensors FP8_DYNAMIC), experts and attention alike."""
    variants = {"-fp8": "block", "-fp8-static": "tensor", "-fp8-channel": "channel"}
    out = {}
    for base in ("tiny-qwen3", "qwen3-0.6b", "qwen3-8b", "tiny-qwen3-moe", "qwen3-30b-a3b"):
        preset = PRESETS[base]
        for suffix, scheme in variants.items():
            spec = dataclasses.replace(preset.spec, fp8=Fp8Spec(scheme))
            out[base + suffix] = Preset(spec, preset.add_bos)
    # Routers stay unquantized (`QUANTIZABLE`). The DeepSeeks as DeepSeek-V3's own release:
    # MLA projections too (kv_b_proj dequantized at load), the correction bias unquantized.
    for base in ("deepseek-v2-lite", "deepseek-v3"):
        preset = PRESETS[base]
        out[base + "-fp8"] = Preset(
            dataclasses.replace(preset.spec, fp8=Fp8Spec("block")), preset.add_bos
        )
    # tiny-deepseek-v3's q LoRA (48 rows) cannot fuse with kv_a by 128-row scale blocks: the
    # tiny FP8 DeepSeek-V3 has widths that 128 x 128 blocks tile, as DeepSeek-V3's do.
    tiny_deepseek = _deepseek(
        "deepseek_v3", vocab_size=512, hidden_size=256, intermediate_size=384,
        moe_intermediate_size=128, num_hidden_layers=3, num_attention_heads=2, q_lora_rank=128,
        kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        first_k_dense_replace=1, max_position_embeddings=4096,
        rope_scaling=_yarn(8.0, 1.0, 1.0, 512),
    )  # fmt: skip
    out["tiny-deepseek-v3-fp8"] = Preset(
        dataclasses.replace(_preset(tiny_deepseek, add_bos=False).spec, fp8=Fp8Spec("block")),
        add_bos=False,
    )
    return out


PRESETS.update(_fp8_variants())

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _tensor_seed(random_seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{random_seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class RandomWeights:
    """Weights of a preset, generated tensor by tensor on demand."""

    def __init__(self, spec: ModelSpec, random_seed: int) -> None:
        self._spec = spec
        self._seed = random_seed
        self._names = expected_weight_names(spec)
        self._quantized: tuple[str, dict[str, torch.Tensor]] | None = None  # the last module

    def names(self) -> list[str]:
        return list(self._names)

    def tensor(self, name: str, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """Canonical tensor `name`: FP8 weights as float8_e4m3fn, their scales float32, the
        rest drawn in float32 and cast to `dtype`."""
        module, _, leaf = name.rpartition(".")
        if self._spec.is_fp8_linear(module):
            return self._fp8_part(module, leaf, device)
        tensor = self._drawn(name, device)
        return tensor if name.endswith("norm.weight") else tensor.to(dtype)

    def _fp8_part(self, module: str, leaf: str, device: torch.device | str) -> torch.Tensor:
        """One of the FP8 linear `module`'s tensors, quantized once per module (the weight,
        weight_scale and input_scale names are consecutive in `names()`)."""
        if self._quantized is None or self._quantized[0] != module:
            assert self._spec.fp8 is not None
            q, scale, input_scale = quantize_weight(
                self._drawn(module + ".weight", device), self._spec.fp8.scheme,
                input_amax=STATIC_INPUT_AMAX,
            )  # fmt: skip
            if self._spec.fp8.scheme == "tensor":
                scale = scale[0]  # one scalar per tensor, as the checkpoint stores it
            parts = {"weight": q, "weight_scale": scale, "input_scale": input_scale}
            self._quantized = (module, parts)
        tensor = self._quantized[1][leaf]
        assert tensor is not None, (module, leaf)
        return tensor.to(device)

    def _drawn(self, name: str, device: torch.device | str) -> torch.Tensor:
        shape = expected_weight_shape(self._spec, name)
        if name.endswith("norm.weight"):
            stored_minus_one = self._spec.norm_kind == "norm1p" and ".linear_attn." not in name
            fill = torch.zeros if stored_minus_one else torch.ones
            return fill(shape, dtype=torch.float32, device=device)
        if name.endswith(".dt_bias"):
            return torch.ones(shape, dtype=torch.float32, device=device)
        generator = torch.Generator(device=device)
        generator.manual_seed(_tensor_seed(self._seed, name))
        if name.endswith(".A_log"):
            uniform = torch.rand(shape, generator=generator, dtype=torch.float32, device=device)
            return (uniform * 15 + 1).log()
        values = torch.randn(shape, generator=generator, dtype=torch.float32, device=device)
        if name.endswith(".conv1d.weight"):
            std = shape[-1] ** -0.5
        elif name.endswith((".bias", ".e_score_correction_bias")):
            std = 0.1
        elif "embed_tokens" in name:
            std = 0.02
        else:
            std = shape[1] ** -0.5
        return values.mul_(std)

    def iter(
        self, dtype: torch.dtype, device: torch.device | str
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self._names:
            yield name, self.tensor(name, dtype, device)


def byte_tokenizer(vocab_size: int, add_bos: bool) -> Tokenizer:
    """Bytes as ids 0-255, SPECIAL_TOKENS next, then "<|unused_N|>" up to vocab_size."""
    first_unused = 256 + len(SPECIAL_TOKENS)
    if vocab_size < first_unused:
        raise ModelLoadError(
            f"a byte tokenizer needs vocab_size >= {first_unused}, got {vocab_size}"
        )
    alphabet = byte_level_alphabet()
    vocab = {alphabet[b]: b for b in range(256)}
    for offset, token in enumerate(SPECIAL_TOKENS):
        vocab[token] = 256 + offset
    # Unused ids stay plain vocabulary entries: BPE without merges never produces them from
    # text, and registering ~150,000 added tokens would slow every encode.
    for index in range(first_unused, vocab_size):
        vocab[f"<|unused_{index}|>"] = index
    backend = tokenizers.Tokenizer(BPE(vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    return Tokenizer(
        backend,
        bos_token_id=vocab["<|bos|>"],
        eos_token_ids={vocab["<|eos|>"], vocab["<|im_end|>"]},
        eos_token_id=vocab["<|eos|>"],
        add_bos=add_bos,
        chat_template=CHATML_TEMPLATE,
    )


def load_preset(name: str, random_seed: int) -> tuple[ModelSpec, Tokenizer, RandomWeights]:
    """A preset by name; "NAME,layers=N" keeps the first N layers of the preset (the same
    tensors the whole preset has: each is drawn by its own name), for benchmarks and GPU
    tests of a few layers' work at real shapes without loading all of them."""
    base, _, option = name.partition(",")
    if base not in PRESETS:
        raise ModelLoadError(
            f"unknown preset random:{base}; presets: {', '.join('random:' + p for p in PRESETS)}"
        )
    preset = PRESETS[base]
    spec = preset.spec if not option else _first_layers(preset.spec, name, option)
    tokenizer = byte_tokenizer(spec.vocab_size, preset.add_bos)
    return spec, tokenizer, RandomWeights(spec, random_seed)


def _first_layers(spec: ModelSpec, name: str, option: str) -> ModelSpec:
    """`spec` cut to the layer count `option` ("layers=N") names: the per-layer fields (layer
    types of windowed and hybrid models, a MoE model's sparse layers) keep their first N
    layers' entries, so each kept layer is the layer it is in the whole preset."""
    key, _, value = option.partition("=")
    if key != "layers" or not value.isdigit() or not 1 <= int(value) <= spec.num_layers:
        raise ModelLoadError(
            f"random:{name}: expected random:NAME,layers=N with N in 1..{spec.num_layers}"
        )
    n = int(value)
    cut: dict[str, Any] = {"num_layers": n}
    for field in ("sliding", "linear"):
        per_layer = getattr(spec, field)
        if per_layer is not None:
            cut[field] = dataclasses.replace(per_layer, layer_types=per_layer.layer_types[:n])
    if spec.moe is not None:
        sparse = tuple(i for i in spec.moe.sparse_layers if i < n)
        cut["moe"] = dataclasses.replace(spec.moe, sparse_layers=sparse)
    return dataclasses.replace(spec, **cut)
