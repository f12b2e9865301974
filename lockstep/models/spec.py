"""Architecture description shared by every loader and the decoder.

Every supported family (Llama, Qwen2, Qwen3) is the same pre-norm decoder with rotary
embeddings, grouped-query attention and a SwiGLU MLP; they differ only in the flags below.
Loaders produce a `ModelSpec` plus a state dict in the canonical (Hugging Face Llama) naming:

    model.embed_tokens.weight                      [vocab, hidden]
    model.layers.{i}.input_layernorm.weight        [hidden]
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    model.layers.{i}.self_attn.{q,k,v}_proj.bias   (qkv_bias only)
    model.layers.{i}.self_attn.{q,k}_norm.weight   [head_dim] (qk_norm only)
    model.layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.weight
    model.norm.weight
    lm_head.weight                                 (absent when tie_word_embeddings)
"""

from __future__ import annotations

from dataclasses import dataclass, field

FAMILIES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("rope_type": "llama3"); None means plain RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int


@dataclass(frozen=True)
class ModelSpec:
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

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r}: supported families are {FAMILIES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + head


def expected_weight_names(spec: ModelSpec) -> list[str]:
    """Every canonical tensor name (spec.py) a model of this spec has, in layer order."""
    names = ["model.embed_tokens.weight"]
    for i in range(spec.num_layers):
        prefix = f"model.layers.{i}."
        names.append(prefix + "input_layernorm.weight")
        for proj in ("q", "k", "v", "o"):
            names.append(f"{prefix}self_attn.{proj}_proj.weight")
        if spec.qkv_bias:
            names += [f"{prefix}self_attn.{proj}_proj.bias" for proj in ("q", "k", "v")]
        if spec.qk_norm:
            names += [prefix + "self_attn.q_norm.weight", prefix + "self_attn.k_norm.weight"]
        names.append(prefix + "post_attention_layernorm.weight")
        names += [f"{prefix}mlp.{proj}_proj.weight" for proj in ("gate", "up", "down")]
    names.append("model.norm.weight")
    if not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def expected_weight_shape(spec: ModelSpec, name: str) -> tuple[int, ...]:
    """The shape of canonical tensor `name` (one of `expected_weight_names(spec)`)."""
    h, q, kv = spec.hidden_size, spec.q_size, spec.kv_size
    leaf = name.rsplit(".", 2)[-2] if name.endswith((".weight", ".bias")) else name
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (spec.vocab_size, h)
    if name.endswith(".bias"):
        return (q,) if leaf == "q_proj" else (kv,)
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm": (h,),
        "post_attention_layernorm": (h,),
        "norm": (h,),
        "q_norm": (spec.head_dim,),
        "k_norm": (spec.head_dim,),
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (spec.intermediate_size, h),
        "up_proj": (spec.intermediate_size, h),
        "down_proj": (h, spec.intermediate_size),
    }
    return shapes[leaf]
