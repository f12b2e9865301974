"""Architecture description shared by every loader and the decoder.

Every supported family (Llama, Qwen2, Qwen3, Qwen3-MoE) is the same pre-norm decoder with
rotary embeddings, grouped-query attention and SwiGLU MLPs; they differ only in the flags
below. In a mixture-of-experts model (`ModelSpec.moe`) the MLP of each sparse layer is a router
and a set of routed SwiGLU experts; the other layers keep the dense MLP. Loaders produce a
`ModelSpec` plus a state dict in the canonical (Hugging Face) naming:

    model.embed_tokens.weight                      [vocab, hidden]
    model.layers.{i}.input_layernorm.weight        [hidden]
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    model.layers.{i}.self_attn.{q,k,v}_proj.bias   (qkv_bias only)
    model.layers.{i}.self_attn.{q,k}_norm.weight   [head_dim] (qk_norm only)
    model.layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.weight  (dense layers)
    model.layers.{i}.mlp.gate.weight               [experts, hidden] (sparse layers: the router)
    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight   (sparse layers, e < experts)
    model.norm.weight
    lm_head.weight                                 (absent when tie_word_embeddings)

An FP8 model (`ModelSpec.fp8`, lockstep/ops/fp8.py) stores each quantized linear's weight as
float8_e4m3fn and adds, beside `{linear}.weight`, in canonical names and shapes:

    {linear}.weight_scale   float32  "block": [ceil(N/128), ceil(K/128)]; "channel": [N];
                                     "tensor": []  (one scalar per checkpoint tensor)
    {linear}.input_scale    float32  [] ("tensor" only: the static activation scale)

Quantized linears are the attention and dense MLP projections, less those `Fp8Spec.skipped`
names; embeddings, the LM head, norms, biases and routers are never quantized.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
MOE_FAMILIES = ("qwen3_moe",)


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("rope_type": "llama3"); None means plain RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int


@dataclass(frozen=True)
class MoeSpec:
    """The routed experts of a mixture-of-experts model (docs/design.md, "Mixture of experts").

    Each token's router logits (fp32) pick its `top_k` experts, ties toward the lower expert
    id; their weights are the softmax probabilities, renormalized over the k when
    `renormalize` (Hugging Face's `norm_topk_prob`). Every expert is a SwiGLU MLP of width
    `intermediate_size`. Layers in `sparse_layers` use the experts; the others use the dense
    MLP of `ModelSpec.intermediate_size`. No shared expert, no capacity limit."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: tuple[int, ...]

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} must be between 1 and num_experts="
                f"{self.num_experts}"
            )
        if list(self.sparse_layers) != sorted(set(self.sparse_layers)):
            raise ValueError(f"sparse_layers={self.sparse_layers} must be sorted and unique")


QUANTIZABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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
    moe: MoeSpec | None = field(default=None)
    fp8: Fp8Spec | None = field(default=None)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r}: supported families are {FAMILIES}")
        if (self.moe is not None) != (self.family in MOE_FAMILIES):
            raise ValueError(
                f"family={self.family!r} with moe={self.moe!r}: the mixture-of-experts families "
                f"{MOE_FAMILIES} need a MoeSpec, the others none"
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
        if self.fp8 is not None and self.moe is not None:
            raise ValueError(
                "FP8 weights are supported for dense models only, not mixture of experts"
            )

    def is_fp8_linear(self, module: str) -> bool:
        """Whether the linear `module` ("model.layers.3.self_attn.q_proj") is stored in FP8."""
        return (
            self.fp8 is not None
            and module.rsplit(".", 1)[-1] in QUANTIZABLE
            and module not in self.fp8.skipped
        )

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
        """Every weight but biases and q/k norms (which published counts leave out too)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        dense = attn + 3 * h * i + 2 * h
        total = v * h + self.num_layers * dense + h + (0 if self.tie_word_embeddings else v * h)
        if self.moe is not None:
            e = self.moe.num_experts
            sparse_mlp = e * h + e * 3 * h * self.moe.intermediate_size
            total += len(self.moe.sparse_layers) * (sparse_mlp - 3 * h * i)
        return total


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
        if spec.is_sparse(i):
            assert spec.moe is not None
            names.append(prefix + "mlp.gate.weight")
            for e in range(spec.moe.num_experts):
                names += [
                    f"{prefix}mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down")
                ]
        else:
            names += [f"{prefix}mlp.{proj}_proj.weight" for proj in ("gate", "up", "down")]
    if spec.fp8 is not None:
        names = [extra for name in names for extra in _with_fp8_scales(spec, name)]
    names.append("model.norm.weight")
    if not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def _with_fp8_scales(spec: ModelSpec, name: str) -> list[str]:
    """`name`, followed by its scale tensors when it is the weight of an FP8 linear."""
    module = name.removesuffix(".weight")
    if name == module or not spec.is_fp8_linear(module):
        return [name]
    assert spec.fp8 is not None
    extra = [module + ".input_scale"] if spec.fp8.scheme == "tensor" else []
    return [name, module + ".weight_scale", *extra]


def expected_weight_shape(spec: ModelSpec, name: str) -> tuple[int, ...]:
    """The shape of canonical tensor `name` (one of `expected_weight_names(spec)`)."""
    if name.endswith((".weight_scale", ".input_scale")):
        assert spec.fp8 is not None, name
        if name.endswith(".input_scale") or spec.fp8.scheme == "tensor":
            return ()
        n, k = expected_weight_shape(spec, name.removesuffix("_scale"))
        return (-(-n // 128), -(-k // 128)) if spec.fp8.scheme == "block" else (n,)
    h, q, kv = spec.hidden_size, spec.q_size, spec.kv_size
    leaf = name.rsplit(".", 2)[-2] if name.endswith((".weight", ".bias")) else name
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (spec.vocab_size, h)
    if name.endswith(".bias"):
        return (q,) if leaf == "q_proj" else (kv,)
    inter = spec.intermediate_size
    if ".mlp.experts." in name:
        assert spec.moe is not None, name
        inter = spec.moe.intermediate_size
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
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "down_proj": (h, inter),
    }
    if spec.moe is not None:
        shapes["gate"] = (spec.moe.num_experts, h)  # the router
    return shapes[leaf]
