"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight, GLM-4.7-Flash: `MlaSpec`),
run in the absorbed form for prefill and decode alike, so both compute every row the same way.

Canonical tensors (after "model.layers.{i}.", H hidden, n heads, dn / dr / dv the no-RoPE,
RoPE and value widths per head, R the KV latent's rank, Q the q LoRA rank):

    self_attn.q_proj.weight                [n (dn + dr), H]      (no q LoRA)
    self_attn.q_a_proj.weight              [Q, H]                (q LoRA)
    self_attn.q_a_layernorm.weight         [Q]
    self_attn.q_b_proj.weight              [n (dn + dr), Q]
    self_attn.kv_a_proj_with_mqa.weight    [R + dr, H]
    self_attn.kv_a_layernorm.weight        [R]
    self_attn.kv_b_proj.weight             [n (dn + dv), R]      (per head: W_UK rows, W_UV rows)
    self_attn.o_proj.weight                [H, n dv]

A token's cache row (one per layer, `MlaSpec.cache_width` values) is c | k_pe: the latent
c = rmsnorm(kv_a x[:R]) and its RoPE key k_pe = rope(kv_a x[R:]), shared by every head. The
scores of head h are q_nope_h . (W_UK_h c) + q_pe_h . k_pe = (W_UK_h^T q_nope_h | q_pe_h) .
(c | k_pe): W_UK is absorbed into the query, so attention is one MQA over the cache rows
with keys of R + dr values and values of R (the latent, the first R values of the same row);
W_UV_h then maps head h's output to dv values, and o_proj mixes the heads.

                   x ──> [q_a | kv_a] ──> rmsnorm ──> q_b ──> q_nope ──W_UK^T──> q_lat ─┐
                                     └──> c, rope(k_pe) ──> cache row                  │
    out <── o_proj <── W_UV per head <── latent_attention(q_lat | rope(q_pe), rows) <──┘

Prepared: the projections from x fused by rows (q_a | kv_a, or q | kv_a without a q LoRA),
q_b, the two norms (float32), W_UK_h^T [R, dn] and W_UV_h [dv, R] stacked per head, o. Where
the checkpoint's RoPE dims are interleaved pairs (`rope_interleave`), their rows are
reordered at load to rotate-half order (evens, then odds): a plain rotate-half RoPE then
computes transformers' interleaved rotation exactly, and queries and keys share the order, so
their dot products are unchanged. The q LoRA and KV norms use epsilon 1e-6 whatever the
config says, as transformers builds them. Every step but the attention is row-local; the
attention's rows depend only on cache rows 0..p of their sequence (`LatentAttentionOps`).

Tensor parallelism (lockstep/parallel/sharding.py): a rank holds its heads' rows of q_proj or
q_b_proj, its heads of W_UK^T and W_UV and their chunks of o (row-parallel by heads, dv
columns a head); q_a | kv_a and both norms are every rank's, so every rank computes the same
latent and RoPE key and keeps the same cache rows (the latent KV per rank: one row a token,
as at TP 1). Each head's attention is the same computation at any degree.

Block-FP8 checkpoints (DeepSeek-V3's own release, `ModelSpec.fp8`): q_a | kv_a (or q | kv_a),
q_b and o are FP8 linears, each with its `weight_scale` [ceil(N/128), ceil(K/128)] (spec.py);
the RoPE reorder moves e4m3 rows within their 128-row scale blocks only
(`fp8_rope_rows_reordered` refuses a layout where it would not). kv_b_proj is dequantized at
load (`absorbed`): W_UK^T and W_UV are slices of it per head, which its 128 x 128 scale blocks
do not follow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch

from lockstep.errors import ModelLoadError
from lockstep.models.blocks.base import (
    BuildContext,
    CacheBytes,
    LayoutEntry,
    Linear,
    PrepareContext,
    Step,
    linear,
    linear_entry,
    row_linear_entry,
)
from lockstep.models.blocks.prepare import fuse_fp8, fused_linear, prepare_common
from lockstep.ops.base import DenseOps, LatentAttentionOps
from lockstep.ops.fp8 import BLOCK, dequantize_weight
from lockstep.ops.moe import prepare_expert_weights
from lockstep.parallel.layers import RowParallelWeight

if TYPE_CHECKING:
    from lockstep.models.spec import MlaSpec, ModelSpec
    from lockstep.ops.base import Ops

# transformers builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default epsilon.
MLA_NORM_EPS = 1e-6


@dataclass
class LatentAttentionWeights:
    """One MLA layer, prepared (module docstring): `a` rows q_a | kv_a (or q | kv_a), `q_b`
    (None without a q LoRA), the norms, `w_uk` [n, R, dn'] (W_UK_h^T per head), `w_uv`
    [n, dv, R'] (W_UV_h per head), `o`, the layer's index among the cache layers, the score
    scale and the RoPE tables."""

    a: Linear
    q_b: Linear | None
    q_a_norm: torch.Tensor | None
    kv_a_norm: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    o: Linear
    kv_index: int
    scale: float
    cos: torch.Tensor
    sin: torch.Tensor


def _names(q_lora: bool) -> list[str]:
    q = (
        ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"]
        if q_lora
        else ["q_proj.weight"]
    )
    rest = [
        "kv_a_proj_with_mqa.weight",
        "kv_a_layernorm.weight",
        "kv_b_proj.weight",
        "o_proj.weight",
    ]
    return ["self_attn." + n for n in q + rest]


@dataclass(frozen=True)
class LatentAttention:
    """MLA with (`q_lora`) or without a low-rank query projection."""

    q_lora: bool = True

    prefix: ClassVar[str] = "self_attn"
    cache: ClassVar[str] = "kv"  # one latent row per token in the KV pool
    requires: ClassVar[tuple[type, ...]] = (DenseOps, LatentAttentionOps)

    def cache_bytes(self, spec: ModelSpec, kv_heads: int, kv_dtype: torch.dtype) -> CacheBytes:
        """The latent and the RoPE key of every cached token (576 values for DeepSeek-V3),
        whatever the head count: MLA keeps no per-head K or V."""
        assert spec.mla is not None
        return CacheBytes(per_token=spec.mla.cache_width * kv_dtype.itemsize)

    def step_hook(self, spec: ModelSpec, device: torch.device) -> None:
        """None: its cache is the KV pool, which needs no per-step work."""
        return None

    def weight_names(self, spec: ModelSpec) -> list[str]:
        return _names(self.q_lora)

    def weight_shape(self, spec: ModelSpec, name: str) -> tuple[int, ...]:
        m, n, h = _mla(spec), spec.num_heads, spec.hidden_size
        q_lora = m.q_lora_rank or 0
        return {
            "self_attn.q_proj.weight": (n * m.qk_head_dim, h),
            "self_attn.q_a_proj.weight": (q_lora, h),
            "self_attn.q_a_layernorm.weight": (q_lora,),
            "self_attn.q_b_proj.weight": (n * m.qk_head_dim, q_lora),
            "self_attn.kv_a_proj_with_mqa.weight": (m.cache_width, h),
            "self_attn.kv_a_layernorm.weight": (m.kv_lora_rank,),
            "self_attn.kv_b_proj.weight": (n * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
            "self_attn.o_proj.weight": (h, n * m.v_head_dim),
        }[name]

    def layout(self, spec: ModelSpec, layer: int, role: str) -> list[LayoutEntry]:
        a, t = f"model.layers.{layer}.self_attn.", f"layers.{layer}.{role}."
        first = "q_a_proj" if self.q_lora else "q_proj"
        entries = [_rope_linear_entry(spec, t + "a", [a + first, a + "kv_a_proj_with_mqa"])]
        if self.q_lora:
            entries += [
                LayoutEntry(t + "q_a_norm", "norm", [a + "q_a_layernorm.weight"]),
                _rope_linear_entry(spec, t + "q_b", [a + "q_b_proj"]),
            ]
        kv_b = [a + "kv_b_proj.weight"]
        if spec.is_fp8_linear(a + "kv_b_proj"):  # dequantized at load: weight, block scales
            kv_b.append(a + "kv_b_proj.weight_scale")
        entries += [
            LayoutEntry(t + "kv_a_norm", "norm", [a + "kv_a_layernorm.weight"]),
            LayoutEntry(t + "w_uk", "mla_absorb_k", kv_b),
            LayoutEntry(t + "w_uv", "mla_absorb_v", kv_b),
            row_linear_entry(spec, t + "o", a + "o_proj", "row_attention"),
        ]
        return entries

    def prepare(
        self, entry: LayoutEntry, parts: list[torch.Tensor], context: PrepareContext
    ) -> Any:
        """Common kinds (blocks/prepare.py), and: "mla_linear" (projections whose interleaved
        RoPE rows are reordered, `rope_rows_reordered`, then fused as one linear), "mla_fp8"
        (their block-FP8 form: e4m3 rows reordered within their scale blocks,
        `fp8_rope_rows_reordered`, then one FP8 linear), "mla_absorb_k" and "mla_absorb_v"
        (kv_b_proj, dequantized first where it is FP8 (its weight, then its block scales),
        split per head into W_UK^T and W_UV by `absorbed`, each head prepared as a linear and
        stacked)."""
        kind, spec = entry.kind, context.spec
        lo, hi = context.parallel.plan.heads
        if kind == "mla_fp8":  # MLA models are MoE models, whose FP8 scheme is "block"
            count = len(parts) // 2  # the weights, then their block scales
            names = entry.sources[:count]
            weights = [local_head_rows(spec, n, fp8_rope_rows_reordered(spec, n, w), lo, hi)
                       for n, w in zip(names, parts[:count], strict=True)]  # fmt: skip
            # A rank's query rows start and end on 128-row block edges (fp8_block_problem).
            scales = [local_head_rows(spec, n, s, lo, hi, BLOCK)
                      for n, s in zip(names, parts[count:], strict=True)]  # fmt: skip
            return fuse_fp8("block", weights + scales, context.ops, context.device,
                            entry.sources)  # fmt: skip
        if kind not in ("mla_linear", "mla_absorb_k", "mla_absorb_v"):
            return prepare_common(entry, parts, context)
        if kind == "mla_linear":
            # Reordered whole (the order is per head of the full tensor), then this rank's
            # heads' rows of the per-head projections; q_a and kv_a are every rank's.
            reordered = [local_head_rows(spec, n, rope_rows_reordered(spec, n, p), lo, hi)
                         for n, p in zip(entry.sources, parts, strict=True)]  # fmt: skip
            return fused_linear(reordered, context)
        scale = parts[1] if len(parts) > 1 else None  # parts: kv_b_proj[, its block scales]
        per_head = absorbed(spec, parts[0], kind[-1], scale)[lo:hi]
        per_head = per_head.to(device=context.device, dtype=context.dtype)
        return prepare_expert_weights(context.ops.prepare_linear_weight, per_head)

    def build(self, parts: dict[str, Any], context: BuildContext) -> LatentAttentionWeights:
        return LatentAttentionWeights(
            a=parts["a"], q_b=parts.get("q_b"), q_a_norm=parts.get("q_a_norm"),
            kv_a_norm=parts["kv_a_norm"], w_uk=parts["w_uk"], w_uv=parts["w_uv"], o=parts["o"],
            kv_index=context.cache_index, scale=_mla(context.spec).softmax_scale,
            cos=context.rope_cos, sin=context.rope_sin,
        )  # fmt: skip

    def forward(
        self, ops: Ops, x: torch.Tensor, w: LatentAttentionWeights, step: Step
    ) -> torch.Tensor:
        """The cache row written, then the absorbed attention (module docstring)."""
        mla_ops = cast(LatentAttentionOps, ops)
        batch = step.batch
        t, heads, rank = x.shape[0], w.w_uk.shape[0], w.w_uk.shape[1]
        rope_dim = 2 * w.cos.shape[1]
        a = linear(ops, x, w.a)
        kv = a[:, -(rank + rope_dim) :]
        if w.q_b is not None:
            assert w.q_a_norm is not None
            q_a = ops.rms_norm(a[:, : -(rank + rope_dim)].contiguous(), w.q_a_norm, MLA_NORM_EPS)
            q = linear(ops, q_a, w.q_b)
        else:
            q = a[:, : -(rank + rope_dim)]
        latent = ops.rms_norm(kv[:, :rank].contiguous(), w.kv_a_norm, MLA_NORM_EPS)
        cache = step.kv.k_cache(w.kv_index)
        # The RoPE parts are read in place (strided views of the projections): the cache row
        # and the query are each one op (`LatentAttentionOps.write_latent_row`, `latent_query`).
        mla_ops.write_latent_row(cache, latent, kv[:, rank:], batch.positions, w.cos, w.sin,
                                 batch.out_slots)  # fmt: skip
        q = q.reshape(t, heads, -1)
        nope = q.shape[2] - rope_dim
        # W_UK and W_UV, heads as groups: one op each (`LatentAttentionOps.grouped_linear`,
        # every head's rows the bits of its own linear).
        q_lat = mla_ops.grouped_linear(q[:, :, :nope], w.w_uk)
        query = mla_ops.latent_query(q_lat, q[:, :, nope:], batch.positions, w.cos, w.sin)
        o = mla_ops.latent_attention(query, cache, batch.meta, w.scale, rank)
        out = mla_ops.grouped_linear(o, w.w_uv).reshape(t, heads * w.w_uv.shape[1])
        if isinstance(w.o, RowParallelWeight):
            return step.parallel.row_linear(out, w.o, "attention")
        return linear(ops, out, w.o)


def _mla(spec: ModelSpec) -> MlaSpec:
    assert spec.mla is not None
    return spec.mla


def local_head_rows(
    spec: ModelSpec, source: str, weight: torch.Tensor, lo: int, hi: int, per_row: int = 1
) -> torch.Tensor:
    """Heads [lo, hi)'s rows of a per-head query projection (q_proj, q_b_proj: qk_head_dim
    rows a head), or of its block scales (`per_row` = 128 weight rows a scale row); any other
    source (q_a_proj, kv_a_proj_with_mqa) whole: the latent and the RoPE key are every
    head's, so every tensor-parallel rank computes them alike."""
    if not source.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
        return weight
    rows = _mla(spec).qk_head_dim
    return weight[lo * rows // per_row : -(-hi * rows // per_row)]


def _rope_linear_entry(spec: ModelSpec, target: str, modules: list[str]) -> LayoutEntry:
    """`linear_entry` over projections with RoPE rows: "mla_linear", or "mla_fp8" where they
    are FP8 (weights, then block scales), both reordered by `rope_row_order` at load."""
    entry = linear_entry(spec, target, modules)
    return entry._replace(kind="mla_fp8" if entry.kind == "fp8" else "mla_linear")


def rope_row_order(spec: ModelSpec, source: str, rows: int) -> torch.Tensor | None:
    """The row order that puts the RoPE rows of `source` (a checkpoint weight of `rows` rows)
    in rotate-half order when the checkpoint interleaves them (module docstring): new row i is
    old row order[i]; None where nothing moves (q_a_proj, or no `rope_interleave`). The RoPE
    rows are each head's last dr rows of q_proj / q_b_proj and the last dr rows of
    kv_a_proj_with_mqa; within them, even dims first, then odd ones."""
    m = _mla(spec)
    if not m.rope_interleave or source.endswith("q_a_proj.weight"):
        return None
    dr = m.qk_rope_head_dim
    rotate_half = torch.cat([torch.arange(0, dr, 2), torch.arange(1, dr, 2)])
    order = torch.arange(rows)
    if source.endswith("kv_a_proj_with_mqa.weight"):
        order[m.kv_lora_rank :] = m.kv_lora_rank + rotate_half
        return order
    heads = order.view(spec.num_heads, m.qk_head_dim)
    heads[:, m.qk_nope_head_dim :] = heads[:, m.qk_nope_head_dim :][:, rotate_half]
    return order


def rope_rows_reordered(spec: ModelSpec, source: str, weight: torch.Tensor) -> torch.Tensor:
    """`weight` (a checkpoint tensor named `source`) with its rows in `rope_row_order`: a
    permutation, no value changes."""
    order = rope_row_order(spec, source, weight.shape[0])
    return weight if order is None else weight[order.to(weight.device)]


def fp8_rope_rows_reordered(spec: ModelSpec, source: str, weight: torch.Tensor) -> torch.Tensor:
    """An e4m3 `weight` with block scales ([ceil(N/128), ...]) in `rope_row_order`. The scales
    stay as they are, which is exact only if no row leaves its 128-row scale block: each
    head's RoPE rows must lie within one block (DeepSeek-V3's do: 128 + 64 rows per head, a
    512-row latent); a checkpoint whose RoPE rows cross a block is refused."""
    order = rope_row_order(spec, source, weight.shape[0])
    if order is None:
        return weight
    moved = (order // BLOCK != torch.arange(len(order)) // BLOCK).nonzero()
    if moved.numel():
        row = int(moved[0])
        raise ModelLoadError(
            f"{source}: its interleaved RoPE rows cross a {BLOCK}-row FP8 scale block (row "
            f"{int(order[row])} would move to row {row}), so reordering them for rotate-half "
            "RoPE would separate rows from their scales; supported: block-FP8 MLA projections "
            f"whose qk_rope_head_dim rows of each head lie within one {BLOCK}-row block"
        )
    # Indexed as bytes: the reorder copies e4m3 values exactly, whatever float8 ops exist.
    return weight.view(torch.uint8)[order.to(weight.device)].view(weight.dtype)


def absorbed(
    spec: ModelSpec, kv_b: torch.Tensor, part: str, block_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """kv_b_proj [n (dn + dv), R] split per head: "k" gives W_UK_h^T stacked [n, R, dn] (a
    linear from q_nope to the latent), "v" gives W_UV_h stacked [n, dv, R]. Slices and
    transposes only: no value is rounded. An e4m3 kv_b with its `block_scale` is dequantized
    first (fp32(Wq) * scale per 128 x 128 block, float32, as SGLang does): the absorbed form
    needs its per-head slices as plain matrices, which the block scales do not follow."""
    m = _mla(spec)
    if block_scale is not None:
        kv_b = dequantize_weight("block", kv_b, block_scale)
    per_head = kv_b.reshape(spec.num_heads, m.qk_nope_head_dim + m.v_head_dim, -1)
    if part == "k":
        return per_head[:, : m.qk_nope_head_dim].transpose(1, 2).contiguous()
    return per_head[:, m.qk_nope_head_dim :].contiguous()
