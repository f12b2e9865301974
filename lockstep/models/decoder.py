"""The one decoder for the Llama, Qwen2, Qwen3, Qwen3-MoE and Qwen3.5 families.

A pre-norm transformer with rotary embeddings, grouped-query attention and a SwiGLU MLP, or in
the sparse layers of a mixture-of-experts model a router and routed SwiGLU experts (`Ops.moe`).
All arithmetic goes through an `Ops` backend (lockstep.ops), so the same model code runs the
deterministic CPU kernels, the Triton kernels, the fast yardstick and the float64 reference.

Weights are loaded strictly: every tensor the loader yields must be expected and every expected
tensor must arrive, else `ModelLoadError`. q/k/v are fused into one projection and gate/up into
another at load time (fewer, larger matmuls); fusing concatenates rows, so each output element's
reduction is unchanged. FP8 linears (lockstep/ops/fp8.py) fuse the same way: weights by rows,
per-row and per-block scales with their rows (`_fuse_fp8`). A sparse layer's experts are stacked into one gate_up [E, 2I, K] and one
down [E, H, I] tensor (lockstep.ops.moe, "Weights").

Position invariance: every op here is row-local (its row's bits depend only on that row) except
attention, whose rows depend only on the keys 0..p of their own sequence. New K/V are written to
the cache before attention, so prefix keys and new keys are read from one layout.

Hybrid models (Qwen3.5): linear-attention layers run `gated_deltanet` (their rows depend on
their own sequence's earlier tokens through its `LinearState`); full-attention layers gate
their output by sigmoid(gate), the gate rows fused after q | k | v, and rotate part of each
head. Their RMSNorm weights are stored as w - 1; the loader adds the 1 once, in float32 (as
transformers does at every call). Only the full-attention layers have K/V in the cache.

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
from lockstep.models.linear_attention import (
    LinearLayout,
    LinearState,
    LinearWeights,
    gated_deltanet,
)
from lockstep.models.moe import split_fused_experts
from lockstep.models.spec import ModelSpec, expected_weight_names, expected_weight_shape
from lockstep.ops.base import AttentionInput, AttentionMeta, LayerKV, Ops, build_attention_meta
from lockstep.ops.fp8 import BLOCK, E4M3, Fp8Weight
from lockstep.ops.moe import MoeLayer, prepare_expert_weights
from lockstep.parallel.layers import RowParallelWeight, TensorParallel, default_reduction
from lockstep.parallel.sharding import ShardPlan

if TYPE_CHECKING:
    from lockstep.models.resolver import LoadedModel


class KVStorage(Protocol):
    def k_cache(self, layer: int) -> torch.Tensor: ...

    def v_cache(self, layer: int) -> torch.Tensor: ...


Linear = torch.Tensor | Fp8Weight  # a prepared linear weight, plain or FP8


def linear(ops: Ops, x: torch.Tensor, w: Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) through the backend's plain or FP8 linear, by the weight's kind."""
    if isinstance(w, Fp8Weight):
        return ops.fp8_linear(x, w, bias)
    return ops.linear(x, w, bias)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear | None  # prepared linear weight, rows q | k | v (| gate: hybrid models)
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear | RowParallelWeight | None
    post_norm: torch.Tensor
    gate_up: Linear | None  # dense layers: prepared linear weight, rows gate | up
    down: Linear | RowParallelWeight | None
    router: torch.Tensor | None  # sparse layers: prepared linear weight [E, H]
    experts_gate_up: torch.Tensor | None  # sparse layers: [E, 2I, K'] (lockstep.ops.moe)
    experts_down: torch.Tensor | None  # sparse layers: [E, H, I']
    gdn_in: torch.Tensor | None = None  # linear-attention layers (LinearWeights)
    gdn_conv: torch.Tensor | None = None
    gdn_a_log: torch.Tensor | None = None
    gdn_dt_bias: torch.Tensor | None = None
    gdn_norm: torch.Tensor | None = None
    gdn_out: torch.Tensor | None = None


def rope_tables(spec: ModelSpec, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_position, head_dim/2] float32, computed once in float64 (so every step and
    every device type indexes the same table instead of recomputing angles)."""
    half = spec.rotary_dim // 2
    exponent = torch.arange(half, dtype=torch.float64) * 2.0 / spec.rotary_dim
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
        kv_dtype: torch.dtype | None = None,
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
        self.kv_dtype = kv_dtype or dtype  # the KV cache's (float8_e4m3fn: lockstep/ops/fp8.py)
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
        kv_layers = spec.kv_layers
        self.kv_index = [kv_layers.index(i) if i in kv_layers else -1 for i in range(len(layers))]
        self.linear_layout = LinearLayout.of(spec, device) if spec.hybrid else None
        self.linear_weights = [
            None if w.gdn_in is None
            else LinearWeights(w.gdn_in, w.gdn_conv, w.gdn_a_log, w.gdn_dt_bias, w.gdn_norm,
                               w.gdn_out)
            for w in layers
        ]  # fmt: skip
        linear_index = [i for i in range(len(layers)) if spec.is_linear(i)]
        self.linear_index = [linear_index.index(i) if i in linear_index else -1
                             for i in range(len(layers))]  # fmt: skip

    @classmethod
    def load(
        cls,
        loaded: LoadedModel,
        ops: Ops,
        dtype: torch.dtype,
        device: torch.device | str,
        max_position: int | None = None,
        parallel: TensorParallel | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> Decoder:
        """Load `loaded`'s weights strictly, keep `parallel`'s shard of them (default: TP 1,
        the mode's default reduction), convert them to `dtype` on `device` (FP8 weights and
        their scales keep theirs) and fuse the projections. Missing or unexpected tensors raise
        `ModelLoadError`. `kv_dtype`: the KV cache's dtype (default `dtype`)."""
        device = torch.device(device)
        spec = loaded.spec
        if parallel is None:
            parallel = TensorParallel.single(ops, ShardPlan(spec, 1, 0), default_reduction(ops))
        if spec.hybrid:
            problem = getattr(ops, "linear_attention_problem", None)
            if not hasattr(ops, "gated_delta_rule"):
                problem = "it has no gated delta rule"
            if problem is not None:
                raise ModelLoadError(
                    f"{loaded.source}: hybrid (linear-attention) models are not supported by "
                    f"the {ops.name} backend ({problem}): run them with the cpu_deterministic "
                    "backend (--device cpu), or with --mode fast, which is not position invariant"
                )
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
            parts["lm_head"], max_position or spec.max_position, parallel, kv_dtype,
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
                old = self._tensor_at(target)
                if isinstance(old, Fp8Weight):
                    assert isinstance(new, Fp8Weight)
                    for live, fresh in zip(old.tensors(), new.tensors(), strict=True):
                        live.copy_(fresh)
                else:
                    old.copy_(new)  # type: ignore[arg-type]

    def _tensor_at(self, target: str) -> Linear | RowParallelWeight:
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
        h = parallel.embed(batch.token_ids, self.embed).to(self.act_dtype)
        residual: torch.Tensor | None = None
        # Rows per sequence on the host, once per step (the linear layers loop over them).
        rows = None if batch.linear_states is None else batch.meta.cu_q.diff().tolist()
        for i, w in enumerate(self.layers):
            if residual is None:
                residual = h
                x = ops.rms_norm(h, w.input_norm, spec.rms_norm_eps)
            else:
                x, residual = ops.add_rms_norm(h, residual, w.input_norm, spec.rms_norm_eps)
            gdn = self.linear_weights[i]
            if gdn is not None:
                assert self.linear_layout is not None
                h = gated_deltanet(ops, x, gdn, self.linear_index[i], batch,
                                   self.linear_layout, spec.rms_norm_eps, rows)  # fmt: skip
            else:
                h = self._attention(x, w, i, batch, kv)
            x, residual = ops.add_rms_norm(h, residual, w.post_norm, spec.rms_norm_eps)
            moe = self.moe_layers[i]
            if moe is not None:
                h = ops.moe(x, moe)
            else:
                assert w.gate_up is not None and w.down is not None
                act = ops.silu_mul(linear(ops, x, w.gate_up))
                if isinstance(w.down, Fp8Weight):
                    h = linear(ops, act, w.down)
                else:
                    h = parallel.row_linear(act, w.down, "mlp")
        assert residual is not None
        if batch.linear_states is not None and rows is not None:
            for state, n in zip(batch.linear_states, rows, strict=True):
                state.position += n
        x, _ = ops.add_rms_norm(h, residual, self.final_norm, spec.rms_norm_eps)
        x = x.index_select(0, batch.logit_rows)
        return parallel.logits(x, self.lm_head)

    def read_kv(self, kv: KVStorage, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [layers, n, Hkv, D] (this rank's KV heads) at `slots` of `kv`."""
        index = slots.to(device=self.device, dtype=torch.int64)
        layers = range(len(self.spec.kv_layers))
        k = torch.stack([kv.k_cache(i).index_select(0, index) for i in layers])
        v = torch.stack([kv.v_cache(i).index_select(0, index) for i in layers])
        return k, v

    def _attention(
        self, x: torch.Tensor, w: LayerWeights, i: int, batch: ForwardBatch, kv: KVStorage
    ) -> torch.Tensor:
        """Layer i's attention: K/V written to the cache, then causal attention, the output
        gate (hybrid models) and o_proj."""
        spec, ops, t = self.spec, self.ops, batch.num_tokens
        assert w.qkv is not None and w.o is not None
        qkv = linear(ops, x, w.qkv, w.qkv_bias)
        gate = None
        if spec.hybrid:
            gate = qkv[:, -spec.q_size :].contiguous()
            qkv = qkv[:, : -spec.q_size].contiguous()
        layer_kv = LayerKV(kv.k_cache(self.kv_index[i]), kv.v_cache(self.kv_index[i]))
        q = ops.attention_input(
            qkv, self.attention_inputs[i], batch.positions, batch.out_slots, layer_kv
        )
        o = ops.attention(q, layer_kv, batch.meta, self.scale).reshape(t, -1)
        if gate is not None:
            o = ops.gate_activation(o, gate, "sigmoid")
        if isinstance(w.o, Fp8Weight):
            return linear(ops, o, w.o)
        return self.parallel.row_linear(o, w.o, "attention")

    def new_linear_state(self) -> LinearState | None:
        """A fresh linear-attention state at position 0 (None for a model without)."""
        if self.linear_layout is None:
            return None
        return LinearState.resume(self.linear_layout, None)

    def logits_for_sequence(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [T, vocab] float32 of one cold full prefill of `token_ids`, in a scratch KV
        cache of exactly len(token_ids) slots. For tests and reference comparisons."""
        return self.cold_prefill(token_ids)[0]

    def cold_prefill(self, token_ids: list[int]) -> tuple[torch.Tensor, ScratchKV]:
        """One cold full prefill of `token_ids` in a private KV cache (slot j holds position
        j): every position's logits [T, vocab] float32, and the cache it wrote."""
        n = len(token_ids)
        kv = ScratchKV(self.spec, n, self.kv_dtype, self.device, self.plan.num_local_kv_heads)
        kv.linear_state = self.new_linear_state()
        states = None if kv.linear_state is None else [kv.linear_state]
        positions = list(range(n))
        meta: AttentionMeta = build_attention_meta([n], [0], [positions])
        batch = ForwardBatch.from_lists(token_ids, positions, positions, meta, positions, states)
        return self.forward(batch.to(self.device), kv), kv


class ScratchKV:
    """A private KV cache for `cold_prefill`, k and v [KV layers, n, Hkv, D] (the engine uses
    the shared KV pool), and the linear-attention state the prefill ended in (hybrid); Hkv:
    `num_kv_heads`, this rank's KV heads (default: the model's)."""

    def __init__(
        self,
        spec: ModelSpec,
        n: int,
        dtype: torch.dtype,
        device: torch.device,
        num_kv_heads: int | None = None,
    ) -> None:
        shape = (len(spec.kv_layers), n, num_kv_heads or spec.num_kv_heads, spec.head_dim)
        self.linear_state: LinearState | None = None
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def k_cache(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.v[layer]


_LAYER_FIELDS = tuple(f.name for f in dataclasses.fields(LayerWeights))
# Tensors kept in float32 whatever the model dtype (name endings).
FLOAT32_TENSORS = ("norm.weight", ".bias", ".A_log", ".dt_bias", ".conv1d.weight")


def weight_layout(spec: ModelSpec) -> list[tuple[str, str, list[str]]]:
    """How canonical tensors become the decoder's: (target, kind, source names), in load
    order. Kinds: "norm" (float32), "norm1p" (float32, plus one: Qwen3.5 stores w - 1),
    "conv" (float32 [channels, kernel]), "bias" (float32, concatenated), "embed" (as is),
    "linear" (rows concatenated, then `Ops.prepare_linear_weight`), "qkv_gate" (q_proj's
    per-head query and gate rows separated: q | k | v | gate, then "linear"), "row_attention"
    and "row_mlp" (row-parallel: `TensorParallel.row_weight`) and "experts" (the sources are
    expert-major, the same number per expert: each expert's rows concatenated, then stacked
    and prepared by `prepare_expert_weights`) and "fp8" (an FP8 linear: its parts' weights,
    then their weight scales, then their input scales ("tensor"), fused by `_fuse_fp8`)."""
    layout: list[tuple[str, str, list[str]]] = []
    norm = "norm1p" if spec.hybrid else "norm"

    def add_linear(target: str, modules: list[str]) -> None:
        fp8 = [spec.is_fp8_linear(m) for m in modules]
        if not any(fp8):
            layout.append((target, "linear", [m + ".weight" for m in modules]))
            return
        if not all(fp8):
            raise ModelLoadError(
                f"{modules[fp8.index(False)]} is not FP8 but {modules[fp8.index(True)]} is: "
                "projections fused into one matmul must share one format"
            )
        assert spec.fp8 is not None
        suffixes = [".weight", ".weight_scale"] + (
            [".input_scale"] if spec.fp8.scheme == "tensor" else []
        )
        layout.append((target, "fp8", [m + s for s in suffixes for m in modules]))

    for i in range(spec.num_layers):
        p, t = f"model.layers.{i}.", f"layers.{i}."
        a = p + "self_attn."
        layout.append((t + "input_norm", norm, [p + "input_layernorm.weight"]))
        if spec.is_linear(i):
            g = p + "linear_attn."
            ins = [g + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")]
            layout.append((t + "gdn_in", "linear", ins))
            layout.append((t + "gdn_conv", "conv", [g + "conv1d.weight"]))
            layout.append((t + "gdn_a_log", "norm", [g + "A_log"]))
            layout.append((t + "gdn_dt_bias", "norm", [g + "dt_bias"]))
            layout.append((t + "gdn_norm", "norm", [g + "norm.weight"]))
            layout.append((t + "gdn_out", "linear", [g + "out_proj.weight"]))
        else:
            if spec.hybrid:
                layout.append((t + "qkv", "qkv_gate", [a + f"{x}_proj.weight" for x in "qkv"]))
            else:
                add_linear(t + "qkv", [a + f"{x}_proj" for x in "qkv"])
            if spec.qkv_bias:
                layout.append((t + "qkv_bias", "bias", [a + f"{x}_proj.bias" for x in "qkv"]))
            if spec.qk_norm:
                layout.append((t + "q_norm", norm, [a + "q_norm.weight"]))
                layout.append((t + "k_norm", norm, [a + "k_norm.weight"]))
            if spec.is_fp8_linear(a + "o_proj"):
                add_linear(t + "o", [a + "o_proj"])
            else:
                layout.append((t + "o", "row_attention", [a + "o_proj.weight"]))
        layout.append((t + "post_norm", norm, [p + "post_attention_layernorm.weight"]))
        if spec.is_sparse(i):
            assert spec.moe is not None
            experts = [f"{p}mlp.experts.{e}." for e in range(spec.moe.num_experts)]
            layout.append((t + "router", "linear", [p + "mlp.gate.weight"]))
            gate_up = [e + f"{proj}_proj.weight" for e in experts for proj in ("gate", "up")]
            layout.append((t + "experts_gate_up", "experts", gate_up))
            down = [e + "down_proj.weight" for e in experts]
            layout.append((t + "experts_down", "experts", down))
        else:
            add_linear(t + "gate_up", [p + "mlp.gate_proj", p + "mlp.up_proj"])
            if spec.is_fp8_linear(p + "mlp.down_proj"):
                add_linear(t + "down", [p + "mlp.down_proj"])
            else:
                layout.append((t + "down", "row_mlp", [p + "mlp.down_proj.weight"]))
    layout.append(("embed", "embed", ["model.embed_tokens.weight"]))
    head = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
    layout.append(("lm_head", "linear", [head]))
    layout.append(("final_norm", norm, ["model.norm.weight"]))
    return layout


def _prepare(
    spec: ModelSpec,
    target: str,
    kind: str,
    parts: list[torch.Tensor],
    parallel: TensorParallel,
    dtype: torch.dtype,
    device: torch.device,
) -> Linear | RowParallelWeight:
    ops = parallel.ops
    if kind == "fp8":  # FP8 models run at tp=1 (lockstep.parallel.sharding): never sharded
        assert spec.fp8 is not None
        return _fuse_fp8(spec.fp8.scheme, parts, ops, device)
    parts = _shard(parallel.plan, target, parts)
    if kind in ("norm", "bias"):
        return torch.cat(parts).to(device=device, dtype=torch.float32)
    if kind == "norm1p":
        return torch.cat(parts).to(device=device, dtype=torch.float32) + 1.0
    if kind == "conv":
        weight = parts[0].to(device=device, dtype=torch.float32)
        return weight.reshape(weight.shape[0], -1).contiguous()
    if kind == "qkv_gate":
        q_gate = parts[0].reshape(spec.num_heads, 2, spec.head_dim, -1)
        parts = [q_gate[:, 0].reshape(spec.q_size, -1), parts[1], parts[2],
                 q_gate[:, 1].reshape(spec.q_size, -1)]  # fmt: skip
        kind = "linear"
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


def _fuse_fp8(scheme: str, parts: list[torch.Tensor], ops: Ops, device: torch.device) -> Fp8Weight:
    """One FP8 linear from its parts' (weights, weight scales[, input scales]) in canonical
    form (spec.py): weights and per-row or per-block scales concatenated by rows; a "tensor"
    part's scalar repeated over its rows; the parts' static input scales, which all see the
    same activation, merged into their maximum (docs/models.md)."""
    count = len(parts) // (3 if scheme == "tensor" else 2)
    weights, scales = parts[:count], parts[count : 2 * count]
    if scheme == "block" and count > 1:
        uneven = next((w for w in weights[:-1] if w.shape[0] % BLOCK), None)
        if uneven is not None:
            raise ModelLoadError(
                f"FP8 block scales cannot be fused: a part has {uneven.shape[0]} rows, not a "
                f"multiple of {BLOCK}"
            )
    if scheme == "tensor":
        scales = [s.reshape(1).expand(w.shape[0]) for w, s in zip(weights, scales, strict=True)]
    weight = torch.cat(weights, dim=0).to(device).contiguous()
    weight_scale = torch.cat(scales, dim=0).to(device=device, dtype=torch.float32).contiguous()
    input_scale = None
    if scheme == "tensor":
        input_scale = torch.stack([s.reshape(()) for s in parts[2 * count :]]).amax()
        input_scale = input_scale.to(device=device, dtype=torch.float32)
    return ops.prepare_fp8_linear(scheme, weight, weight_scale, input_scale)


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


def _stored_dtype(spec: ModelSpec, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the decoder keeps canonical tensor `name` in before preparation."""
    if name.endswith((*FLOAT32_TENSORS, "_scale")):
        return torch.float32
    if name.endswith(".weight") and spec.is_fp8_linear(name.removesuffix(".weight")):
        return E4M3
    return dtype


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
        keep = _stored_dtype(spec, name, dtype)
        if keep == E4M3 and tensor.dtype != E4M3:
            raise ModelLoadError(
                f"{source}: tensor {name!r} has dtype {tensor.dtype}, expected float8_e4m3fn "
                f"(an FP8 {spec.fp8.scheme if spec.fp8 else ''} linear)"
            )
        if name.endswith("_scale") and not tensor.is_floating_point():
            raise ModelLoadError(
                f"{source}: tensor {name!r} has dtype {tensor.dtype}, expected float32"
            )
        if device is not None:
            tensor = tensor.to(device=device, dtype=keep, copy=True)
        got[name] = tensor
    missing = [n for n in expected_weight_names(spec) if n not in got]
    if missing:
        raise ModelLoadError(
            f"{source}: {len(missing)} expected tensor(s) missing, first {missing[0]!r}"
        )
    return got
