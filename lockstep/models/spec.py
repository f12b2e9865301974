"""Architecture description shared by every loader and the decoder.

Every supported family (lockstep/models/families: Llama, Mistral, Phi-3, Qwen2, Qwen3,
Qwen3-MoE, Qwen3.5, the hybrid MoE families Qwen3.5-MoE and Qwen3-Next, Gemma 3, and the
DeepSeek architecture: DeepSeek-V2, DeepSeek-V3 and GLM-4.7-Flash) is a pre-norm decoder with
rotary embeddings (lockstep/models/rope.py) whose layers are (norm, mixer, norm, MLP). The
family fills the fields below; `ModelSpec.layer_plans` names each layer's mixer and MLP block
(lockstep/models/blocks/plan.py), chosen from them: attention (q/k/v biases, q/k norm,
Qwen3.5's output gate, partial rotary embeddings, a sliding window), multi-head
latent attention (`ModelSpec.mla`), or in a hybrid model (`ModelSpec.linear`) Gated DeltaNet
in most layers; the dense SwiGLU (or GeGLU) MLP, or in the sparse layers of a
mixture-of-experts model (`ModelSpec.moe`) a router and routed experts, plus a gated or
(DeepSeek) ungated shared expert where the family has one. The hybrid families and Gemma 3
store their RMSNorm weights as w - 1 (`norm_style`); Gemma 3 also normalizes each mixer's and
MLP's output (its four norms per layer: `ModelSpec.norm_names`). Loaders produce a `ModelSpec`
plus a state dict in the canonical (Hugging Face) naming: each block's module docstring lists
its tensors (after "model.layers.{i}."); around them

    model.embed_tokens.weight                      [vocab, hidden]
    model.layers.{i}.input_layernorm.weight        [hidden]
    model.layers.{i}.post_attention_layernorm.weight
    model.norm.weight
    lm_head.weight                                 (absent when tie_word_embeddings)

An FP8 model (`ModelSpec.fp8`, lockstep/ops/fp8.py) stores each quantized linear's weight as
float8_e4m3fn and adds, beside `{linear}.weight`, in canonical names and shapes:

    {linear}.weight_scale   float32  "block": [ceil(N/128), ceil(K/128)]; "channel": [N];
                                     "tensor": []  (one scalar per checkpoint tensor)
    {linear}.input_scale    float32  [] ("tensor" only: the static activation scale)

Quantized linears are the attention and dense MLP projections (MLA's too: q_a, q_b,
kv_a_proj_with_mqa, o, and kv_b_proj, which the decoder dequantizes at load) and (block scheme
only) every expert's projections, shared experts included, less those `Fp8Spec.skipped` names;
embeddings, the LM head, norms, biases, routers (`mlp.gate`) and DeepSeek's correction bias
are never quantized.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lockstep.models.blocks.plan import LayerPlan

SCORING_FUNCTIONS = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2_sum")
LAYER_TYPES = ("linear_attention", "full_attention")
ATTENTION_TYPES = ("sliding_attention", "full_attention")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
# How a checkpoint stores its RMSNorm weights: as w ("plain") or as w - 1 ("offset": the
# hybrid families and Gemma 3, whose norms compute x * (1 + w)).
NORM_STYLES = ("plain", "offset")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("rope_type": "llama3"); None means plain RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (rope_type "yarn", DeepSeek-V2/V3), as transformers computes it: each
    frequency blends its interpolated (divided by `factor`) and extrapolated value by a linear
    ramp between the correction dims of `beta_fast` and `beta_slow` rotations over
    `original_max_position` (floored / ceiled when `truncate`), and the cos / sin tables are
    multiplied by `attention_factor`."""

    factor: float
    original_max_position: int
    beta_fast: float
    beta_slow: float
    attention_factor: float
    truncate: bool = True


@dataclass(frozen=True)
class LongRopeScaling:
    """LongRoPE (rope_type "longrope", Phi-3): per-frequency divisors of the plain RoPE
    frequencies, `short_factor` for positions below `original_max_position` and `long_factor`
    for the others (lockstep/models/rope.py says why by position), cos and sin multiplied by
    `attention_factor`."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position: int
    attention_factor: float

    def __post_init__(self) -> None:
        if len(self.short_factor) != len(self.long_factor):
            raise ValueError(f"LongRoPE short_factor has {len(self.short_factor)} entries, "
                             f"long_factor {len(self.long_factor)}")  # fmt: skip


@dataclass(frozen=True)
class MlaSpec:
    """Multi-head latent attention (DeepSeek-V2/V3, blocks/mla.py). Each token's query is
    `qk_nope_head_dim` + `qk_rope_head_dim` wide per head (through a LoRA of rank
    `q_lora_rank`, or one q_proj when None); its key and value come from one latent of
    `kv_lora_rank` (normalized) plus one RoPE key of `qk_rope_head_dim` shared by every head,
    which is all the cache keeps. `rope_interleave`: the checkpoint's RoPE dims are
    interleaved pairs (DeepSeek's layout; the loader reorders them to rotate-half).
    `softmax_scale` multiplies the scores (qk_head_dim ** -0.5, times YaRN's mscale squared
    where the config sets mscale_all_dim)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Values the cache keeps per token and layer: the latent, then the RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoeSpec:
    """The routed experts of a mixture-of-experts model (docs/design.md, "Mixture of experts").

    Each token's router logits (fp32) pick its `top_k` experts, ties toward the lower expert
    id; their weights are the softmax probabilities, renormalized over the k when
    `renormalize` (Hugging Face's `norm_topk_prob`). Every expert is a SwiGLU MLP of width
    `intermediate_size`. Layers in `sparse_layers` use the experts; the others use the dense
    MLP of `ModelSpec.intermediate_size`. No capacity limit.

    `shared_expert_size` > 0 (Qwen3-Next, Qwen3.5-MoE): every sparse layer also runs a shared
    SwiGLU expert of that width on every token, gated per token by a sigmoid of one more
    linear row: out = routed + sigmoid(x . g) * shared(x) (blocks/moe.py). DeepSeek's shared
    experts (`shared_expert_gated` False) are one SwiGLU of that width added ungated.

    DeepSeek routing (lockstep/ops/moe.py, "DeepSeek routing"): `scoring` "sigmoid" scores
    each expert by sigmoid(logit) and chooses by score + the expert's correction bias
    (`correction_bias`, a tensor of the checkpoint) while weighting by the unbiased score;
    `groups` > 1 first keeps the `topk_groups` best groups of experts by `group_score` ("max"
    of a group's scores, DeepSeek-V2's group_limited_greedy; "top2_sum", the sum of its two
    best biased scores, DeepSeek-V3); the weights are then multiplied by `routed_scaling`."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: tuple[int, ...]
    shared_expert_size: int = 0
    shared_expert_gated: bool = True
    scoring: str = "softmax"
    correction_bias: bool = False
    groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"
    routed_scaling: float = 1.0

    @property
    def deepseek_routing(self) -> bool:
        """Whether routing goes beyond softmax top-k (sigmoid scores, a correction bias,
        expert groups or a routed scaling factor): `Ops.moe` needs `DeepseekRoutingOps`."""
        return (self.scoring != "softmax" or self.correction_bias or self.groups > 1
                or self.routed_scaling != 1.0)  # fmt: skip

    def __post_init__(self) -> None:
        if self.scoring not in SCORING_FUNCTIONS:
            raise ValueError(f"scoring_func={self.scoring!r}: supported {SCORING_FUNCTIONS}")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"group score {self.group_score!r}: supported {GROUP_SCORES}")
        if self.groups < 1 or self.num_experts % self.groups:
            raise ValueError(
                f"n_group={self.groups} must be >= 1 and divide n_routed_experts={self.num_experts}"
            )
        if not 1 <= self.topk_groups <= self.groups:
            raise ValueError(f"topk_group={self.topk_groups} must be between 1 and n_group="
                             f"{self.groups}")  # fmt: skip
        if self.groups > 1 and self.top_k > self.topk_groups * (self.num_experts // self.groups):
            raise ValueError(
                f"num_experts_per_tok={self.top_k} exceeds the experts of topk_group="
                f"{self.topk_groups} groups"
            )
        if (
            self.group_score == "top2_sum"
            and self.groups > 1
            and self.num_experts // self.groups < 2
        ):
            raise ValueError("a top2_sum group score needs at least 2 experts per group")
        if not self.routed_scaling > 0:
            raise ValueError(f"routed_scaling_factor={self.routed_scaling} must be > 0")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} must be between 1 and num_experts="
                f"{self.num_experts}"
            )
        if list(self.sparse_layers) != sorted(set(self.sparse_layers)):
            raise ValueError(f"sparse_layers={self.sparse_layers} must be sorted and unique")
        if self.shared_expert_size < 0:
            raise ValueError(
                f"shared_expert_intermediate_size={self.shared_expert_size} must be >= 0"
            )


# MLA's projections (blocks/mla.py): kv_b_proj is dequantized at load (the absorbed form
# splits it per head), the others run as FP8 linears.
MLA_QUANTIZABLE = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
QUANTIZABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               *MLA_QUANTIZABLE)  # fmt: skip


@dataclass(frozen=True)
class Fp8Spec:
    """FP8 linears (lockstep/ops/fp8.py): the scheme of every quantized linear and the
    linears left unquantized (their module names, e.g. "model.layers.0.mlp.down_proj")."""

    scheme: str
    skipped: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        from lockstep.ops.fp8 import SCHEMES

        if self.scheme not in SCHEMES:
            raise ValueError(f"FP8 scheme {self.scheme!r} is invalid: expected one of {SCHEMES}")


@dataclass(frozen=True)
class KvCacheScales:
    """A checkpoint's static FP8 KV cache scales (lockstep/ops/fp8.py, "FP8 KV cache"), one
    pair per K/V layer in `ModelSpec.kv_layers` order: K is stored as e4m3_sat(k / k[i]) and
    read as k[i] times the stored value, V likewise. Each is an fp32 value (as a float),
    finite and > 0. Used with an FP8 cache only; a cache of the model dtype ignores them."""

    k: tuple[float, ...]
    v: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.k) != len(self.v):
            raise ValueError(f"{len(self.k)} k scales but {len(self.v)} v scales")
        bad = [s for s in (*self.k, *self.v) if not (0.0 < s < float("inf"))]
        if bad:
            raise ValueError(f"KV cache scale {bad[0]!r} is invalid: expected finite and > 0")


@dataclass(frozen=True)
class LinearAttentionSpec:
    """The Gated DeltaNet layers of a hybrid model (docs/design.md, "Linear attention").

    `layer_types[i]` is "linear_attention" or "full_attention". A linear layer projects q, k
    (`num_key_heads` x `key_head_dim`) and v (`num_value_heads` x `value_head_dim`), runs them
    through a causal depthwise convolution of width `conv_kernel` and SiLU, L2-normalizes q
    and k, and applies the gated delta rule; each key head serves num_value_heads /
    num_key_heads value heads.

    `grouped_projections`: how checkpoints store the input projections (blocks/
    gated_deltanet.py): False, four linears q | k | v, z, b, a (Qwen3.5); True, two linears
    whose rows are grouped by key head, [q k v z] and [b a] per key head (Qwen3-Next). The
    math is the same."""

    layer_types: tuple[str, ...]
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    grouped_projections: bool = False

    def __post_init__(self) -> None:
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"layer_types holds {bad[0]!r}: supported layer types {LAYER_TYPES}")
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"linear_num_value_heads={self.num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.num_key_heads}"
            )
        if self.conv_kernel < 1:
            raise ValueError(f"linear_conv_kernel_dim={self.conv_kernel} must be >= 1")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q | k | v."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class SlidingWindowSpec:
    """Sliding-window attention layers interleaved with global ones (Gemma 3).

    `layer_types[i]` is "sliding_attention" or "full_attention". A sliding layer's query at
    position p sees keys p - window + 1 .. p (transformers' `kv_idx > q_idx - window`) and
    rotates by its own RoPE base `rope_theta`, unscaled (Gemma 3), or where `rope_theta` is
    None by the model's RoPE, as full layers do (Mistral, Phi-3). Sliding layers keep every key in the KV pool (the window is a
    mask), so a radix hit serves them as it serves full layers."""

    window: int
    layer_types: tuple[str, ...]
    rope_theta: float | None

    def __post_init__(self) -> None:
        bad = [t for t in self.layer_types if t not in ATTENTION_TYPES]
        if bad:
            raise ValueError(
                f"layer_types holds {bad[0]!r}: supported layer types {ATTENTION_TYPES}"
            )
        if self.window < 1:
            raise ValueError(f"sliding_window={self.window} must be >= 1")


@dataclass(frozen=True)
class ModelSpec:
    """A model's shapes and the variants of its layers, as its family (lockstep/models/
    families) reads them from a config. `family` names that family for messages and files;
    nothing branches on it: a new family fills these fields and touches no code here."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = field(default=None)
    moe: MoeSpec | None = field(default=None)
    linear: LinearAttentionSpec | None = field(default=None)
    partial_rotary_factor: float = 1.0  # share of head_dim that RoPE rotates
    fp8: Fp8Spec | None = field(default=None)
    # Gemma 3's variations on the decoder (families/gemma3.py): sliding-window layers, a GeGLU
    # MLP ("gelu_tanh"), norms after the mixer and the MLP as well as before ("sandwich"),
    # embeddings times sqrt(hidden_size) rounded to the model dtype, the attention scores'
    # scale when it is not head_dim ** -0.5, RoPE positions divided by a linear factor, and
    # logits soft-capped to (-cap, cap) by cap * tanh(logits / cap).
    sliding: SlidingWindowSpec | None = field(default=None)
    mlp_activation: str = "silu"
    sandwich_norms: bool = False
    embed_scale: bool = False
    attention_scale: float | None = None
    rope_linear_factor: float = 1.0
    final_logit_softcap: float | None = None
    # DeepSeek's multi-head latent attention (blocks/mla.py) and YaRN RoPE scaling.
    mla: MlaSpec | None = field(default=None)
    yarn: YarnScaling | None = field(default=None)
    norm_style: str = "plain"  # NORM_STYLES
    # Full attention gated by sigmoid(gate), the gate rows after each head's query rows in
    # q_proj (Qwen3.5's and the hybrid MoE families' attention layers).
    output_gate: bool = False
    longrope: LongRopeScaling | None = field(default=None)  # Phi-3's RoPE scaling
    kv_cache_scales: KvCacheScales | None = field(default=None)  # a checkpoint's, FP8 cache

    def __post_init__(self) -> None:
        if self.longrope is not None and len(self.longrope.short_factor) != self.rotary_dim // 2:
            raise ValueError(
                f"LongRoPE factors have {len(self.longrope.short_factor)} entries for "
                f"{self.rotary_dim // 2} rotary frequencies"
            )
        if self.norm_style not in NORM_STYLES:
            raise ValueError(f"norm style {self.norm_style!r}: supported {NORM_STYLES}")
        if self.mla is not None and self.rotary_dim != self.mla.qk_rope_head_dim:
            raise ValueError(f"an MLA model rotates qk_rope_head_dim={self.mla.qk_rope_head_dim}"
                             f" dims, not {self.rotary_dim}")  # fmt: skip
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(f"mlp activation {self.mlp_activation!r}: supported {MLP_ACTIVATIONS}")
        if self.sliding is not None and len(self.sliding.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.sliding.layer_types)} entries for "
                f"num_hidden_layers={self.num_layers}"
            )
        if self.final_logit_softcap is not None and not self.final_logit_softcap > 0:
            raise ValueError(f"final_logit_softcapping={self.final_logit_softcap} must be > 0")
        if self.rope_linear_factor <= 0:
            raise ValueError(f"linear RoPE factor {self.rope_linear_factor} must be > 0")
        if self.linear is not None and len(self.linear.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.linear.layer_types)} entries for num_hidden_layers="
                f"{self.num_layers}"
            )
        if self.rotary_dim % 2 or self.rotary_dim < 2:
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor} with head_dim="
                f"{self.head_dim} gives {self.rotary_dim} rotary dims: expected an even number"
            )
        if self.moe is not None and any(
            not 0 <= i < self.num_layers for i in self.moe.sparse_layers
        ):
            raise ValueError(
                f"sparse_layers={self.moe.sparse_layers} name layers outside 0..{self.num_layers - 1}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.kv_cache_scales is not None:
            self._check_kv_cache_scales(self.kv_cache_scales)

    def _check_kv_cache_scales(self, scales: KvCacheScales) -> None:
        if self.mla is not None:
            raise ValueError(
                "KV cache scales with multi-head latent attention are not supported: the FP8 "
                "latent cache has scale 1.0 (checkpoint k_scale/v_scale apply to K/V caches)"
            )
        if len(scales.k) != len(self.kv_layers):
            raise ValueError(f"{len(scales.k)} KV cache scale pairs for {len(self.kv_layers)} "
                             "attention layers")  # fmt: skip

    def is_fp8_linear(self, module: str) -> bool:
        """Whether the linear `module` ("model.layers.3.self_attn.q_proj") is stored in FP8."""
        return (
            self.fp8 is not None
            and module.rsplit(".", 1)[-1] in QUANTIZABLE
            and module not in self.fp8.skipped
        )

    @property
    def layer_plans(self) -> tuple[LayerPlan, ...]:
        """Each layer's mixer and MLP, from the fields above (lockstep/models/blocks/plan.py)."""
        # Imported here: the blocks import modules that import this one.
        from lockstep.models.blocks.plan import plan_layers

        return plan_layers(self)

    @property
    def norm_kind(self) -> str:
        """How RMSNorm weights are prepared (blocks/prepare.py): "norm1p" where the checkpoint
        stores w - 1 (`norm_style` "offset"), else "norm"."""
        return "norm1p" if self.norm_style == "offset" else "norm"

    def window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`'s attention (None: it sees every earlier key)."""
        if self.sliding is None or self.sliding.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding.window

    def norm_names(self) -> tuple[tuple[str, str], ...]:
        """Each layer's norms as (prepared field, canonical leaf after "model.layers.{i}."),
        in load order: the norm before the mixer, after it (sandwich only), before the MLP
        and after it (sandwich only). Gemma names the norm before its MLP
        pre_feedforward_layernorm and the one after its mixer post_attention_layernorm."""
        if not self.sandwich_norms:
            return (("input_norm", "input_layernorm.weight"),
                    ("post_norm", "post_attention_layernorm.weight"))  # fmt: skip
        return (("input_norm", "input_layernorm.weight"),
                ("mixer_norm", "post_attention_layernorm.weight"),
                ("post_norm", "pre_feedforward_layernorm.weight"),
                ("mlp_norm", "post_feedforward_layernorm.weight"))  # fmt: skip

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def hybrid(self) -> bool:
        """Whether some layers are linear attention (Qwen3.5, Qwen3.5-MoE, Qwen3-Next)."""
        return self.linear is not None

    def is_linear(self, layer: int) -> bool:
        """Whether layer `layer` is a linear-attention (Gated DeltaNet) layer."""
        return self.linear is not None and self.linear.layer_types[layer] == "linear_attention"

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers whose mixer keeps K/V per token (every layer but the linear-attention
        ones), in order: the KV pool's layers."""
        return tuple(i for i, plan in enumerate(self.layer_plans) if plan.mixer.cache == "kv")

    @property
    def cache_kv_heads(self) -> int:
        """Heads of one KV pool row: the KV heads, or 1 for MLA's latent."""
        return 1 if self.mla is not None else self.num_kv_heads

    @property
    def cache_head_dim(self) -> int:
        """Values per head of one KV pool row: head_dim, or MLA's latent + RoPE key."""
        return self.mla.cache_width if self.mla is not None else self.head_dim

    @property
    def cache_values(self) -> bool:
        """Whether the KV pool keeps values apart from keys (MLA reads its values from the
        key rows: the latent is both)."""
        return self.mla is None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the routed experts (else the dense MLP)."""
        return self.moe is not None and layer in self.moe.sparse_layers

    @property
    def num_parameters(self) -> int:
        """Every weight but biases (DeepSeek routers' correction biases too) and q/k norms
        (which published counts leave out too)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.mla is not None:
            m, heads = self.mla, self.num_heads
            q_out = heads * m.qk_head_dim
            q = h * q_out if m.q_lora_rank is None else m.q_lora_rank * (h + 1 + q_out)
            kv = h * m.cache_width + m.kv_lora_rank * (
                1 + heads * (m.qk_nope_head_dim + m.v_head_dim)
            )
            attn = q + kv + heads * m.v_head_dim * h
        dense = attn + 3 * h * i + len(self.norm_names()) * h
        total = v * h + self.num_layers * dense + h + (0 if self.tie_word_embeddings else v * h)
        if self.linear is not None:
            lin = self.linear
            mixer = h * (lin.conv_dim + lin.value_dim + 2 * lin.num_value_heads)
            mixer += lin.value_dim * h + lin.conv_dim * lin.conv_kernel
            mixer += 2 * lin.num_value_heads + lin.value_head_dim  # A_log, dt_bias, norm
            num_linear = self.num_layers - len(self.kv_layers)
            total += num_linear * (mixer - attn) + len(self.kv_layers) * self.q_size * h
        if self.moe is not None:
            e = self.moe.num_experts
            sparse_mlp = e * h + e * 3 * h * self.moe.intermediate_size
            if self.moe.shared_expert_size:
                sparse_mlp += 3 * h * self.moe.shared_expert_size  # its MLP
                sparse_mlp += h if self.moe.shared_expert_gated else 0  # and gate row
            total += len(self.moe.sparse_layers) * (sparse_mlp - 3 * h * i)
        return total
