"""The one decoder for the Llama, Qwen2, Qwen3, Qwen3-MoE and Qwen3.5 families.

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

Hybrid models (Qwen3.5): linear-attention layers run `gated_deltanet` (their rows depend on
their own sequence's earlier tokens through its `LinearState`); full-attention layers gate
their output by sigmoid(gate), the gate rows fused after q | k | v, and rotate part of each
head. Their RMSNorm weights are stored as w - 1; the loader adds the 1 once, in float32 (as
transformers does at every call). Only the full-attention layers have K/V in the cache.
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
from lockstep.ops.moe import MoeLayer, prepare_expert_weights

if TYPE_CHECKING:
    from lockstep.models.resolver import LoadedModel


class KVStorage(Protocol):
    def k_cache(self, layer: int) -> torch.Tensor: ...

    def v_cache(self, layer: int) -> torch.Tensor: ...


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor | None  # prepared linear weight, rows q | k | v (| gate: hybrid models)
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor | None  # dense layers: prepared linear weight, rows gate | up
    down: torch.Tensor | None
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
    ) -> None:
        self.spec = spec
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
            AttentionInput(spec.num_heads, w.q_norm, w.k_norm, spec.rms_norm_eps,
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
    ) -> Decoder:
        """Load `loaded`'s weights strictly, convert them to `dtype` on `device` and fuse the
        projections. Missing or unexpected tensors raise `ModelLoadError`."""
        device = torch.device(device)
        spec = loaded.spec
        if spec.hybrid and not hasattr(ops, "gated_delta_rule"):
            raise ModelLoadError(
                f"{loaded.source}: hybrid (linear-attention) models are not supported by the "
                f"{ops.name} backend: supported on cpu_deterministic and cpu_fast"
            )
        got = _collect(loaded.iter_weights(dtype, device), spec, loaded.source, dtype)
        parts = {
            target: _prepare(spec, kind, [got[n] for n in names], ops, dtype, device)
            for target, kind, names in _consume(weight_layout(spec), got)
        }
        layers = [
            LayerWeights(**{f: parts.pop(f"layers.{i}.{f}", None) for f in _LAYER_FIELDS})
            for i in range(spec.num_layers)
        ]
        return cls(
            spec, ops, dtype, device, parts["embed"], layers, parts["final_norm"],
            parts["lm_head"], max_position or spec.max_position,
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
                new = _prepare(spec, kind, parts, self.ops, self.dtype, self.device)
                self._tensor_at(target).copy_(new)

    def _tensor_at(self, target: str) -> torch.Tensor:
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
        spec, ops = self.spec, self.ops
        h = self.embed[batch.token_ids].to(self.act_dtype)
        residual: torch.Tensor | None = None
        # Rows per sequence on the host, once per step (the linear layers loop over them).
        rows = None if batch.linear_states is None else batch.meta.cu_q.diff().tolist()
        for i, w in enumerate(self.layers):
            if residual is None:
                residual = h
                x = ops.rms_norm(h, w.input_norm, spec.rms_norm_eps)
            else:
                x, residual = ops.add_rms_norm(h, residual, w.input_norm, spec.rms_norm_eps)
            linear = self.linear_weights[i]
            if linear is not None:
                assert self.linear_layout is not None
                h = gated_deltanet(ops, x, linear, self.linear_index[i], batch,
                                   self.linear_layout, spec.rms_norm_eps, rows)  # fmt: skip
            else:
                h = self._attention(x, w, i, batch, kv)
            x, residual = ops.add_rms_norm(h, residual, w.post_norm, spec.rms_norm_eps)
            moe = self.moe_layers[i]
            if moe is not None:
                h = ops.moe(x, moe)
            else:
                assert w.gate_up is not None and w.down is not None
                h = ops.linear(ops.silu_mul(ops.linear(x, w.gate_up)), w.down)
        assert residual is not None
        if batch.linear_states is not None and rows is not None:
            for state, n in zip(batch.linear_states, rows, strict=True):
                state.position += n
        x, _ = ops.add_rms_norm(h, residual, self.final_norm, spec.rms_norm_eps)
        x = x.index_select(0, batch.logit_rows)
        return ops.linear(x, self.lm_head).float()

    def _attention(
        self, x: torch.Tensor, w: LayerWeights, i: int, batch: ForwardBatch, kv: KVStorage
    ) -> torch.Tensor:
        """Layer i's attention: K/V written to the cache, then causal attention, the output
        gate (hybrid models) and o_proj."""
        spec, ops, t = self.spec, self.ops, batch.num_tokens
        assert w.qkv is not None and w.o is not None
        qkv = ops.linear(x, w.qkv, w.qkv_bias)
        gate = None
        if spec.hybrid:
            gate = qkv[:, -spec.q_size :].contiguous()
            qkv = qkv[:, : -spec.q_size].contiguous()
        layer_kv = LayerKV(kv.k_cache(self.kv_index[i]), kv.v_cache(self.kv_index[i]))
        q = ops.attention_input(
            qkv, self.attention_inputs[i], batch.positions, batch.out_slots, layer_kv
        )
        o = ops.attention(q, layer_kv, batch.meta, self.scale).reshape(t, spec.q_size)
        if gate is not None:
            o = ops.gate_activation(o, gate, "sigmoid")
        return ops.linear(o, w.o)

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
        kv = ScratchKV(self.spec, n, self.dtype, self.device)
        kv.linear_state = self.new_linear_state()
        states = None if kv.linear_state is None else [kv.linear_state]
        positions = list(range(n))
        meta: AttentionMeta = build_attention_meta([n], [0], [positions])
        batch = ForwardBatch.from_lists(token_ids, positions, positions, meta, positions, states)
        return self.forward(batch.to(self.device), kv), kv


class ScratchKV:
    """A private KV cache for `cold_prefill`, k and v [KV layers, n, Hkv, D] (the engine uses
    the shared KV pool), and the linear-attention state the prefill ended in (hybrid)."""

    def __init__(self, spec: ModelSpec, n: int, dtype: torch.dtype, device: torch.device):
        shape = (len(spec.kv_layers), n, spec.num_kv_heads, spec.head_dim)
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
    per-head query and gate rows separated: q | k | v | gate, then "linear") and "experts" (the sources are
    expert-major, the same number per expert: each expert's rows concatenated, then stacked
    and prepared by `prepare_expert_weights`)."""
    layout: list[tuple[str, str, list[str]]] = []
    norm = "norm1p" if spec.hybrid else "norm"
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
            qkv_kind = "qkv_gate" if spec.hybrid else "linear"
            layout.append((t + "qkv", qkv_kind, [a + f"{x}_proj.weight" for x in "qkv"]))
            if spec.qkv_bias:
                layout.append((t + "qkv_bias", "bias", [a + f"{x}_proj.bias" for x in "qkv"]))
            if spec.qk_norm:
                layout.append((t + "q_norm", norm, [a + "q_norm.weight"]))
                layout.append((t + "k_norm", norm, [a + "k_norm.weight"]))
            layout.append((t + "o", "linear", [a + "o_proj.weight"]))
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
            gate_up = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
            layout.append((t + "gate_up", "linear", gate_up))
            layout.append((t + "down", "linear", [p + "mlp.down_proj.weight"]))
    layout.append(("embed", "embed", ["model.embed_tokens.weight"]))
    head = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
    layout.append(("lm_head", "linear", [head]))
    layout.append(("final_norm", norm, ["model.norm.weight"]))
    return layout


def _prepare(
    spec: ModelSpec,
    kind: str,
    parts: list[torch.Tensor],
    ops: Ops,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
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
    if kind == "experts":
        assert spec.moe is not None
        # Expert-major sources, so the concatenated rows are expert e's rows at block e.
        stacked = fused.view(spec.moe.num_experts, -1, fused.shape[1])
        return prepare_expert_weights(ops.prepare_linear_weight, stacked)
    return fused if kind == "embed" else ops.prepare_linear_weight(fused.contiguous())


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
            keep = torch.float32 if name.endswith(FLOAT32_TENSORS) else dtype
            tensor = tensor.to(device=device, dtype=keep, copy=True)
        got[name] = tensor
    missing = [n for n in expected_weight_names(spec) if n not in got]
    if missing:
        raise ModelLoadError(
            f"{source}: {len(missing)} expected tensor(s) missing, first {missing[0]!r}"
        )
    return got
