"""The one decoder for the Llama, Qwen2, Qwen3 and Qwen3-MoE families.

A pre-norm transformer with rotary embeddings, grouped-query attention and a SwiGLU MLP, or in
the sparse layers of a mixture-of-experts model a router and routed SwiGLU experts (`Ops.moe`).
All arithmetic goes through an `Ops` backend (lockstep.ops), so the same model code runs the
deterministic CPU kernels, the Triton kernels, the fast yardstick and the float64 reference.

Weights are loaded strictly: every tensor the loader yields must be expected and every expected
tensor must arrive, else `ModelLoadError`. q/k/v are fused into one projection and gate/up into
another at load time (fewer, larger matmuls); fusing concatenates rows, so each output element's
reduction is unchanged. A sparse layer's experts are stacked into one gate_up [E, 2I, K] and one
down [E, H, I] tensor (lockstep.ops.moe, "Weights").

Position invariance: every op here is row-local (its row's bits depend only on that row) except
attention, whose rows depend only on the keys 0..p of their own sequence. New K/V are written to
the cache before attention, so prefix keys and new keys are read from one layout.

Tensor parallelism: a decoder holds one rank's shard (`TensorParallel`, lockstep.parallel): its
heads of qkv, its intermediate columns of gate-up, its reduction chunks of o and down, its
vocabulary rows of the embedding and the LM head. At TP 1 it holds everything, and o and down
are still reduced chunk by chunk (deterministic mode), so that TP 1 gives the bits of TP 8.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from lockstep.errors import ModelLoadError
from lockstep.models.forward_batch import ForwardBatch
from lockstep.models.moe import split_fused_experts
from lockstep.models.spec import ModelSpec, expected_weight_names, expected_weight_shape
from lockstep.ops.base import AttentionInput, AttentionMeta, LayerKV, Ops, build_attention_meta
from lockstep.ops.moe import MoeLayer, prepare_expert_weights
from lockstep.parallel.layers import RowParallelWeight, TensorParallel, default_reduction
from lockstep.parallel.sharding import ShardPlan

if TYPE_CHECKING:
    from lockstep.models.resolver import LoadedModel


class KVStorage(Protocol):
    def k_cache(self, layer: int) -> torch.Tensor: ...

    def v_cache(self, layer: int) -> torch.Tensor: ...


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # prepared linear weight, rows q | k | v
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: RowParallelWeight
    post_norm: torch.Tensor
    gate_up: torch.Tensor | None  # dense layers: prepared linear weight, rows gate | up
    down: RowParallelWeight | None
    router: torch.Tensor | None  # sparse layers: prepared linear weight [E, H]
    experts_gate_up: torch.Tensor | None  # sparse layers: [E, 2I, K'] (lockstep.ops.moe)
    experts_down: torch.Tensor | None  # sparse layers: [E, H, I']


def rope_tables(spec: ModelSpec, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_position, head_dim/2] float32, computed once in float64 (so every step and
    every device type indexes the same table instead of recomputing angles)."""
    half = spec.head_dim // 2
    exponent = torch.arange(half, dtype=torch.float64) * 2.0 / spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta**exponent)
    s = spec.rope_scaling
    if s is not None:
        # Llama 3 frequency scaling: long wavelengths are divided by `factor`, short ones kept,
        # the band between is interpolated smoothly.
        wavelen = 2 * math.pi / inv_freq
        low_wavelen = s.original_max_position / s.low_freq_factor
        high_wavelen = s.original_max_position / s.high_freq_factor
        smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / s.factor + smooth * inv_freq, scaled)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(torch.float32), angles.sin().to(torch.float32)


class Decoder:
    """Holds the weights on one device and runs forward steps through an `Ops` backend."""

    def __init__(
        self,
        spec: ModelSpec,
        ops: Ops,
        dtype: torch.dtype,
        device: torch.device,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        max_position: int,
        parallel: TensorParallel,
    ) -> None:
        self.spec = spec
        self.parallel = parallel
        self.plan = parallel.plan
        self.ops = ops
        self.dtype = dtype
        self.device = device
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.max_position = max_position
        self.act_dtype = torch.float32 if device.type == "cpu" else dtype
        cos, sin = rope_tables(spec, max_position)
        self.rope_cos = cos.to(device)
        self.rope_sin = sin.to(device)
        self.attention_inputs = [
            AttentionInput(self.plan.heads[1] - self.plan.heads[0], w.q_norm, w.k_norm, spec.rms_norm_eps,
                           self.rope_cos, self.rope_sin)
            for w in layers
        ]  # fmt: skip
        self.moe_layers = [
            None if w.router is None or spec.moe is None
            else MoeLayer(w.router, w.experts_gate_up, w.experts_down, spec.moe.top_k,
                          spec.moe.renormalize)
            for w in layers
        ]  # fmt: skip
        self.scale = 1.0 / math.sqrt(spec.head_dim)

    @classmethod
    def load(
        cls,
        loaded: LoadedModel,
        ops: Ops,
        dtype: torch.dtype,
        device: torch.device | str,
        max_position: int | None = None,
        parallel: TensorParallel | None = None,
    ) -> Decoder:
        """Load `loaded`'s weights strictly, keep `parallel`'s shard of them (default: TP 1,
        the mode's default reduction), convert them to `dtype` on `device` and fuse the
        projections. Missing or unexpected tensors raise `ModelLoadError`."""
        device = torch.device(device)
        spec = loaded.spec
        if parallel is None:
            parallel = TensorParallel.single(ops, ShardPlan(spec, 1, 0), default_reduction(ops))
        got = _collect(loaded.iter_weights(dtype, device), spec, loaded.source, dtype)
        parts = {
            target: _prepare(spec, target, kind, [got[n] for n in names], parallel, dtype, device)
            for target, kind, names in _consume(weight_layout(spec), got)
        }
        layers = [
            LayerWeights(**{f: parts.pop(f"layers.{i}.{f}", None) for f in _LAYER_FIELDS})
            for i in range(spec.num_layers)
        ]
        return cls(
            spec, ops, dtype, device, parts["embed"], layers, parts["final_norm"],
            parts["lm_head"], max_position or spec.max_position, parallel,
        )  # fmt: skip

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        """Replace every weight, in place, from canonical (name, tensor) pairs (spec.py): the
        tensors keep their storage, so captured CUDA graphs replay the new weights.

        All or nothing: every tensor is read to the host and checked (names, shapes) before
        any weight changes, so a bad checkpoint raises `ModelLoadError` with the old weights
        intact. `lm_head.weight` of a model with tied embeddings is ignored (a trainer's
        `state_dict()` lists it; the embedding is the head). transformers' fused expert
        tensors (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, what its MoE models'
        `state_dict()` holds) are taken as the per-expert tensors they contain."""
        spec = self.spec
        if spec.tie_word_embeddings:
            weights = ((n, t) for n, t in weights if n != "lm_head.weight")
        if spec.moe is not None:
            weights = split_fused_experts(weights)
        cpu = torch.device("cpu")
        got = _collect(((n, t.detach()) for n, t in weights), spec, source, self.dtype, cpu)
        with torch.no_grad():
            for target, kind, names in _consume(weight_layout(spec), got):
                parts = [got[n] for n in names]
                new = _prepare(spec, target, kind, parts, self.parallel, self.dtype, self.device)
                self._tensor_at(target).copy_(new)  # type: ignore[arg-type]

    def _tensor_at(self, target: str) -> torch.Tensor | RowParallelWeight:
        """The live tensor a `weight_layout` target names ("layers.3.qkv", "embed", ...)."""
        if target.startswith("layers."):
            _, index, name = target.split(".")
            tensor = getattr(self.layers[int(index)], name)
        else:
            tensor = getattr(self, target)
        assert tensor is not None, target
        return tensor

    def forward(self, batch: ForwardBatch, kv: KVStorage) -> torch.Tensor:
        """Run one step: write every row's K/V into `kv` at `batch.out_slots` and return the
        float32 logits [R, vocab] of `batch.logit_rows`."""
        spec, ops, parallel = self.spec, self.ops, self.parallel
        t = batch.num_tokens
        h = parallel.embed(batch.token_ids, self.embed).to(self.act_dtype)
        residual: torch.Tensor | None = None
        for i, w in enumerate(self.layers):
            if residual is None:
                residual = h
                x = ops.rms_norm(h, w.input_norm, spec.rms_norm_eps)
            else:
                x, residual = ops.add_rms_norm(h, residual, w.input_norm, spec.rms_norm_eps)
            qkv = ops.linear(x, w.qkv, w.qkv_bias)
            layer_kv = LayerKV(kv.k_cache(i), kv.v_cache(i))
            q = ops.attention_input(
                qkv, self.attention_inputs[i], batch.positions, batch.out_slots, layer_kv
            )
            o = ops.attention(q, layer_kv, batch.meta, self.scale)
            h = parallel.row_linear(o.reshape(t, -1), w.o, "attention")
            x, residual = ops.add_rms_norm(h, residual, w.post_norm, spec.rms_norm_eps)
            moe = self.moe_layers[i]
            if moe is not None:
                h = ops.moe(x, moe)
            else:
                assert w.gate_up is not None and w.down is not None
                act = ops.silu_mul(ops.linear(x, w.gate_up))
                h = parallel.row_linear(act, w.down, "mlp")
        assert residual is not None
        x, _ = ops.add_rms_norm(h, residual, self.final_norm, spec.rms_norm_eps)
        x = x.index_select(0, batch.logit_rows)
        return parallel.logits(x, self.lm_head)

    def read_kv(self, kv: KVStorage, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [layers, n, Hkv, D] (this rank's KV heads) at `slots` of `kv`."""
        index = slots.to(device=self.device, dtype=torch.int64)
        layers = range(self.spec.num_layers)
        k = torch.stack([kv.k_cache(i).index_select(0, index) for i in layers])
        v = torch.stack([kv.v_cache(i).index_select(0, index) for i in layers])
        return k, v

    def logits_for_sequence(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [T, vocab] float32 of one cold full prefill of `token_ids`, in a scratch KV
        cache of exactly len(token_ids) slots. For tests and reference comparisons."""
        return self.cold_prefill(token_ids)[0]

    def cold_prefill(self, token_ids: list[int]) -> tuple[torch.Tensor, ScratchKV]:
        """One cold full prefill of `token_ids` in a private KV cache (slot j holds position
        j): every position's logits [T, vocab] float32, and the cache it wrote."""
        n = len(token_ids)
        kv = ScratchKV(self.spec, n, self.dtype, self.device, self.plan.num_local_kv_heads)
        positions = list(range(n))
        meta: AttentionMeta = build_attention_meta([n], [0], [positions])
        batch = ForwardBatch.from_lists(token_ids, positions, positions, meta, positions)
        return self.forward(batch.to(self.device), kv), kv


class ScratchKV:
    """A private KV cache for `cold_prefill`, k and v [layers, n, Hkv, D] (the engine uses the
    shared KV pool); Hkv: `num_kv_heads`, this rank's KV heads (default: the model's)."""

    def __init__(
        self,
        spec: ModelSpec,
        n: int,
        dtype: torch.dtype,
        device: torch.device,
        num_kv_heads: int | None = None,
    ) -> None:
        shape = (spec.num_layers, n, num_kv_heads or spec.num_kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def k_cache(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.v[layer]


_LAYER_FIELDS = tuple(f.name for f in dataclasses.fields(LayerWeights))


def weight_layout(spec: ModelSpec) -> list[tuple[str, str, list[str]]]:
    """How canonical tensors become the decoder's: (target, kind, source names), in load
    order. Kinds: "norm" (float32), "bias" (float32, concatenated), "embed" (as is), "linear"
    (rows concatenated, then `Ops.prepare_linear_weight`), "row_attention" and "row_mlp"
    (row-parallel: `TensorParallel.row_weight`) and "experts" (the sources are
    expert-major, the same number per expert: each expert's rows concatenated, then stacked
    and prepared by `prepare_expert_weights`)."""
    layout: list[tuple[str, str, list[str]]] = []
    for i in range(spec.num_layers):
        p, t = f"model.layers.{i}.", f"layers.{i}."
        a = p + "self_attn."
        layout.append((t + "input_norm", "norm", [p + "input_layernorm.weight"]))
        layout.append((t + "qkv", "linear", [a + f"{x}_proj.weight" for x in "qkv"]))
        if spec.qkv_bias:
            layout.append((t + "qkv_bias", "bias", [a + f"{x}_proj.bias" for x in "qkv"]))
        if spec.qk_norm:
            layout.append((t + "q_norm", "norm", [a + "q_norm.weight"]))
            layout.append((t + "k_norm", "norm", [a + "k_norm.weight"]))
        layout.append((t + "o", "row_attention", [a + "o_proj.weight"]))
        layout.append((t + "post_norm", "norm", [p + "post_attention_layernorm.weight"]))
        if spec.is_sparse(i):
            assert spec.moe is not None
            experts = [f"{p}mlp.experts.{e}." for e in range(spec.moe.num_experts)]
            layout.append((t + "router", "linear", [p + "mlp.gate.weight"]))
            gate_up = [e + f"{proj}_proj.weight" for e in experts for proj in ("gate", "up")]
            layout.append((t + "experts_gate_up", "experts", gate_up))
            down = [e + "down_proj.weight" for e in experts]
            layout.append((t + "experts_down", "experts", down))
        else:
            gate_up = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
            layout.append((t + "gate_up", "linear", gate_up))
            layout.append((t + "down", "row_mlp", [p + "mlp.down_proj.weight"]))
    layout.append(("embed", "embed", ["model.embed_tokens.weight"]))
    head = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
    layout.append(("lm_head", "linear", [head]))
    layout.append(("final_norm", "norm", ["model.norm.weight"]))
    return layout


def _prepare(
    spec: ModelSpec,
    target: str,
    kind: str,
    parts: list[torch.Tensor],
    parallel: TensorParallel,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | RowParallelWeight:
    ops = parallel.ops
    parts = _shard(parallel.plan, target, parts)
    if kind in ("norm", "bias"):
        return torch.cat(parts).to(device=device, dtype=torch.float32)
    fused = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    fused = fused.to(device=device, dtype=dtype)
    if kind in ("row_attention", "row_mlp"):
        return parallel.row_weight(fused, kind.removeprefix("row_"))
    if kind == "experts":
        assert spec.moe is not None
        # Expert-major sources, so the concatenated rows are expert e's rows at block e.
        stacked = fused.view(spec.moe.num_experts, -1, fused.shape[1])
        return prepare_expert_weights(ops.prepare_linear_weight, stacked)
    return fused if kind == "embed" else ops.prepare_linear_weight(fused.contiguous())


def _shard(plan: ShardPlan, target: str, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's rows of a column-parallel or vocabulary-parallel target's sources (q | k | v
    by heads, gate | up by intermediate columns, the embedding and LM head by vocabulary
    rows); every other target whole (row-parallel ones are cut by `row_weight`)."""
    if plan.tp == 1:
        return parts
    d = plan.spec.head_dim
    if target.endswith((".qkv", ".qkv_bias")):
        (h0, h1), (k0, k1) = plan.heads, plan.kv_heads
        q, k, v = parts
        return [q[h0 * d : h1 * d], k[k0 * d : k1 * d], v[k0 * d : k1 * d]]
    if target.endswith(".gate_up"):
        lo, hi = plan.intermediate
        return [p[lo:hi] for p in parts]
    if target in ("embed", "lm_head"):
        lo, hi = plan.vocab_rows()
        return [p[lo:hi] for p in parts]
    return parts


def _consume(
    layout: list[tuple[str, str, list[str]]], got: dict[str, torch.Tensor]
) -> Iterator[tuple[str, str, list[str]]]:
    """Yield the layout's entries, dropping each source tensor from `got` after its last use
    (so a load holds one copy of the model, not two)."""
    uses = Counter(n for _, _, names in layout for n in names)
    for entry in layout:
        yield entry
        for name in entry[2]:
            uses[name] -= 1
            if not uses[name]:
                del got[name]


def _collect(
    weights: Iterable[tuple[str, torch.Tensor]],
    spec: ModelSpec,
    source: str,
    dtype: torch.dtype,
    device: torch.device | None = None,
) -> dict[str, torch.Tensor]:
    """Every expected tensor, by canonical name, checked: no unexpected, duplicate, missing
    or wrongly shaped tensor (`ModelLoadError` names the first). With `device`, each tensor
    is copied there (norms and biases as float32, the rest as `dtype`) as it arrives."""
    expected = set(expected_weight_names(spec))
    got: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name not in expected:
            raise ModelLoadError(f"{source}: unexpected tensor {name!r} for this architecture")
        if name in got:
            raise ModelLoadError(f"{source}: tensor {name!r} appears twice")
        shape = expected_weight_shape(spec, name)
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(
                f"{source}: tensor {name!r} has shape {list(tensor.shape)}, expected"
                f" {list(shape)} for this model"
            )
        if device is not None:
            keep = torch.float32 if name.endswith(("norm.weight", ".bias")) else dtype
            tensor = tensor.to(device=device, dtype=keep, copy=True)
        got[name] = tensor
    missing = [n for n in expected_weight_names(spec) if n not in got]
    if missing:
        raise ModelLoadError(
            f"{source}: {len(missing)} expected tensor(s) missing, first {missing[0]!r}"
        )
    return got
