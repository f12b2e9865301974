"""The one decoder for every family: a pre-norm transformer whose layers are (norm, mixer,
norm, MLP), the mixer and MLP being blocks (lockstep/models/blocks) named by the spec's
`layer_plans`: attention and its variants or Gated DeltaNet; a SwiGLU MLP or routed experts.
All arithmetic goes through an `Ops` backend (lockstep.ops), so the same model code runs the
deterministic CPU kernels, the Triton kernels, the stock-torch reference mode and the float64 oracle.

Weights are loaded strictly: every tensor the loader yields must be expected and every expected
tensor must arrive, else `ModelLoadError`. Each block prepares its own tensors (its `layout`
and `prepare`: q/k/v fused into one projection and gate/up into another, MLA's absorbed
projections, stacked experts, FP8 linears), the kinds every block shares in
blocks/prepare.py; the decoder prepares only its norms, the embedding and the LM head.

Position invariance: every op here is row-local (its row's bits depend only on that row) except
attention, whose rows depend only on the keys 0..p of their own sequence. New K/V are written to
the cache before attention, so prefix keys and new keys are read from one layout.

Hybrid models (Qwen3.5): linear-attention layers run `gated_deltanet` (their rows depend on
their own sequence's earlier tokens through its `LinearState`, which the mixer's step hook,
blocks/base.py's `StepHook`, advances after each step); full-attention layers gate
their output by sigmoid(gate), the gate rows fused after q | k | v, and rotate part of each
head. Their RMSNorm weights are stored as w - 1; the loader adds the 1 once, in float32 (as
transformers does at every call). Only the full-attention layers have K/V in the cache.

Gemma 3: sliding-window layers take their own RoPE tables (`rope_tables(sliding=True)`) and
pass their window to the attention op; each layer also normalizes its mixer's and its MLP's
output before the residual add (`Layer.mixer_norm`, `Layer.mlp_norm`), and the embeddings are
multiplied by sqrt(hidden_size) rounded to the model dtype, as transformers does; logits are
soft-capped where the config asks (`Ops.softcap`, per element).

Tensor parallelism: a decoder holds one rank's shard (`TensorParallel`, lockstep.parallel): its
heads of qkv, its intermediate columns of gate-up, its reduction chunks of o and down, its
vocabulary rows of the embedding and the LM head. At TP 1 it holds everything, and o and down
are still reduced chunk by chunk (deterministic mode), so that TP 1 gives the bits of TP 8.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from lockstep.cache import routed_experts as routed_store
from lockstep.errors import ModelLoadError
from lockstep.models.blocks import LayerPlan, expected_weight_names, expected_weight_shape
from lockstep.models.blocks.base import (
    BuildContext,
    KVStorage,
    LayoutEntry,
    Linear,
    PrepareContext,
    Step,
    StepHook,
)
from lockstep.models.blocks.prepare import prepare_common
from lockstep.models.families import family_named
from lockstep.models.families.base import Parts
from lockstep.models.forward_batch import ForwardBatch
from lockstep.models.linear_attention import LinearLayout, LinearState
from lockstep.models.moe import split_fused_experts
from lockstep.models.rope import rope_tables
from lockstep.models.spec import ModelSpec
from lockstep.ops.base import (
    AttentionMeta,
    DenseOps,
    Fp8Ops,
    LatentAttentionOps,
    Ops,
    SoftcapOps,
    build_attention_meta,
)
from lockstep.ops.fp8 import E4M3, Fp8Weight
from lockstep.ops.moe import Fp8Experts
from lockstep.parallel.layers import RowParallelWeight, TensorParallel, default_reduction
from lockstep.parallel.sharding import ShardPlan

if TYPE_CHECKING:
    from lockstep.models.resolver import LoadedModel

__all__ = ["Decoder", "KVStorage", "Layer", "ScratchKV"]

# Prepares one layout entry from its source tensors (a block's `prepare`, or the common one).
Preparation = Callable[[LayoutEntry, list[torch.Tensor], PrepareContext], Any]


@dataclass
class Layer:
    """One decoder layer's prepared weights: its norms (float32) and the weights objects of
    its plan's mixer and MLP (each block's `build`). `mixer_norm` and `mlp_norm` normalize
    the mixer's and the MLP's outputs before the residual add (sandwich norms, Gemma 3)."""

    plan: LayerPlan
    input_norm: torch.Tensor
    mixer: Any
    post_norm: torch.Tensor
    mlp: Any
    mixer_norm: torch.Tensor | None = None
    mlp_norm: torch.Tensor | None = None


def activation_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the activations between ops: float32 on the CPU (its kernels compute in
    float32 whatever the weights), the model dtype on CUDA. The training module
    (lockstep/training/model.py) takes it from here, so its ops see what the decoder's see."""
    return torch.float32 if device.type == "cpu" else dtype


class Decoder:
    """Holds the weights on one device and runs forward steps through an `Ops` backend."""

    def __init__(
        self,
        spec: ModelSpec,
        ops: Ops,
        dtype: torch.dtype,
        device: torch.device,
        parts: dict[str, Any],
        max_position: int,
        parallel: TensorParallel,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """`parts`: every prepared weight by `weight_layout` target (consumed)."""
        self.spec = spec
        self.parallel = parallel
        self.plan = parallel.plan
        self.ops = ops
        self.dtype = dtype
        self.device = device
        self.max_position = max_position
        self.kv_dtype = kv_dtype or dtype  # the KV cache's (float8_e4m3fn: lockstep/ops/fp8.py)
        self.act_dtype = activation_dtype(device, dtype)
        cos, sin = rope_tables(spec, max_position)
        self.rope_cos = cos.to(device)
        self.rope_sin = sin.to(device)
        local = None  # the sliding layers' tables, where they have their own RoPE base
        if spec.sliding is not None and spec.sliding.rope_theta is not None:
            local = tuple(t.to(device) for t in rope_tables(spec, max_position, sliding=True))
        # The state layout of the linear-attention layers (the engine's state pools use it):
        # this rank's heads.
        self.linear_layout = None
        if spec.hybrid:
            self.linear_layout = LinearLayout.of(spec, device, tp=self.plan.tp)
        # The step hooks of mixers that keep state beyond the KV pool, one per mixer type.
        self.step_hooks: dict[type, StepHook] = {}
        for plan in spec.layer_plans:
            hook = plan.mixer.step_hook(spec, device)
            if hook is not None:
                self.step_hooks.setdefault(type(plan.mixer), hook)
        # Gemma: embeddings times sqrt(hidden), the factor rounded to the model dtype as
        # transformers rounds it.
        self.embed_scale = None
        if spec.embed_scale:
            self.embed_scale = float(torch.tensor(spec.hidden_size**0.5).to(dtype))
        self.embed = parts.pop("embed")
        self.final_norm = parts.pop("final_norm")
        self.lm_head = parts.pop("lm_head")
        self.layers: list[Layer] = []
        caches: Counter[str] = Counter()  # layers so far per kind of mixer cache
        for i, plan in enumerate(spec.layer_plans):
            cache_index = caches[plan.mixer.cache]
            caches[plan.mixer.cache] += 1
            local_rope = spec.window(i) is not None and local is not None
            cos, sin = local if local_rope else (self.rope_cos, self.rope_sin)
            context = BuildContext(spec, self.plan, cos, sin, cache_index, i)
            mixer = plan.mixer.build(_fields(parts, f"layers.{i}.mixer."), context)
            mlp = plan.mlp.build(_fields(parts, f"layers.{i}.mlp."), context)
            norms = {f: parts.pop(f"layers.{i}.{f}") for f, _ in spec.norm_names()}
            self.layers.append(Layer(plan, mixer=mixer, mlp=mlp, **norms))
        assert not parts, f"prepared weights no layer took: {sorted(parts)[:3]}"

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
        `ModelLoadError`, and so does a backend that lacks an op capability one of the model's
        blocks requires. `kv_dtype`: the KV cache's dtype (default `dtype`)."""
        device = torch.device(device)
        spec = loaded.spec
        _refuse_missing_capability(spec, ops, loaded.source)
        if parallel is None:
            parallel = TensorParallel.single(ops, ShardPlan(spec, 1, 0), default_reduction(ops))
        got = _collect(loaded.iter_weights(dtype, device), spec, loaded.source, dtype)
        context = PrepareContext(spec, parallel, dtype, device)
        parts = {
            entry.target: prepare(entry, [got[n] for n in entry.sources], context)
            for entry, prepare in _consume(weight_layout(spec), got)
        }
        return cls(
            spec, ops, dtype, device, parts, max_position or spec.max_position, parallel, kv_dtype
        )

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        """Replace every weight, in place, from canonical (name, tensor) pairs (spec.py): the
        tensors keep their storage, so captured CUDA graphs replay the new weights.

        All or nothing: every tensor is read to the host and checked (names, shapes) before
        any weight changes, so a bad checkpoint raises `ModelLoadError` with the old weights
        intact. `lm_head.weight` of a model with tied embeddings is ignored (a trainer's
        `state_dict()` lists it; the embedding is the head). transformers' fused expert
        tensors (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, what its MoE models'
        `state_dict()` holds) are taken as the per-expert tensors they contain, and a family's
        fused projections (Phi-3's `qkv_proj` and `gate_up_proj`) as the rows its
        `Family.parts` names, as the loader reads them from a checkpoint."""
        spec = self.spec
        if spec.tie_word_embeddings:
            weights = ((n, t) for n, t in weights if n != "lm_head.weight")
        if spec.moe is not None:
            weights = split_fused_experts(weights)
        weights = _fused_parts(weights, family_named(spec.family).parts, spec)
        cpu = torch.device("cpu")
        got = _collect(((n, t.detach()) for n, t in weights), spec, source, self.dtype, cpu)
        context = PrepareContext(spec, self.parallel, self.dtype, self.device)
        with torch.no_grad():
            for entry, prepare in _consume(weight_layout(spec), got):
                new = prepare(entry, [got[n] for n in entry.sources], context)
                old = self._tensor_at(entry.target)
                if isinstance(old, (Fp8Weight, Fp8Experts)):
                    assert isinstance(new, type(old))
                    for live, fresh in zip(old.tensors(), new.tensors(), strict=True):
                        live.copy_(fresh)
                else:
                    old.copy_(new)  # type: ignore[arg-type]

    def _tensor_at(self, target: str) -> Linear | RowParallelWeight | Fp8Experts:
        """The live tensor a `weight_layout` target names ("layers.3.mixer.qkv", "embed")."""
        if target.startswith("layers."):
            _, index, *path = target.split(".")
            tensor = self.layers[int(index)]
            for name in path:
                tensor = getattr(tensor, name)
        else:
            tensor = getattr(self, target)
        assert tensor is not None, target
        return tensor

    def forward(self, batch: ForwardBatch, kv: KVStorage) -> torch.Tensor:
        """Run one step: write every row's K/V into `kv` at `batch.out_slots` and return the
        float32 logits [R, vocab] of `batch.logit_rows`."""
        return self.head_logits(self.hidden_states(batch, kv))

    def hidden_states(self, batch: ForwardBatch, kv: KVStorage) -> torch.Tensor:
        """`forward` up to the LM head: the final-normed rows [R, hidden] of
        `batch.logit_rows`, in the activation dtype."""
        return self.final_hidden_states(batch, kv).index_select(0, batch.logit_rows)

    def final_hidden_states(self, batch: ForwardBatch, kv: KVStorage) -> torch.Tensor:
        """Every row's final-normed hidden state [T, hidden] (row-local after the layers, so
        a row's bits are those `hidden_states` selects; the piecewise CUDA graphs capture up
        to here, lockstep/engine/piecewise_graphs.py)."""
        spec, ops, parallel = self.spec, self.ops, self.parallel
        h = parallel.embed(batch.token_ids, self.embed).to(self.act_dtype)
        if self.embed_scale is not None:
            h = h * self.embed_scale  # one rounding per element
        residual: torch.Tensor | None = None
        began = {kind: hook.begin(ops, batch) for kind, hook in self.step_hooks.items()}
        step = Step(batch, kv, parallel, began)
        for layer in self.layers:
            h, residual = self.run_layer(layer, h, residual, step)
        assert residual is not None
        for kind, hook in self.step_hooks.items():
            hook.end(began[kind], batch)
        x, _ = ops.add_rms_norm(h, residual, self.final_norm, spec.rms_norm_eps)
        return x

    def head_logits(self, x: torch.Tensor, head: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 logits [R, vocab] of final-normed rows x [R, hidden]: the LM head,
        then soft-capping where the model has it. Every op is row-local, so a row's logits do
        not depend on the other rows. `head`: the LM head weight (default the decoder's; the
        training module passes its own view of it to recompute a chunk of rows)."""
        logits = self.parallel.logits(x, self.lm_head if head is None else head)
        if self.spec.final_logit_softcap is not None:
            logits = self.ops.softcap(logits, self.spec.final_logit_softcap)
        return logits

    def run_layer(
        self, layer: Layer, h: torch.Tensor, residual: torch.Tensor | None, step: Step
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer of `forward`: (norm, mixer, norm, MLP) on the previous layer's output `h`
        and the residual stream (None before the first layer); returns both after it. The
        training module (lockstep/training/model.py) wraps it to recompute layers in the
        backward."""
        ops, eps = self.ops, self.spec.rms_norm_eps
        if residual is None:
            residual = h
            x = ops.rms_norm(h, layer.input_norm, eps)
        else:
            x, residual = ops.add_rms_norm(h, residual, layer.input_norm, eps)
        h = layer.plan.mixer.forward(ops, x, layer.mixer, step)
        if layer.mixer_norm is not None:
            h = ops.rms_norm(h, layer.mixer_norm, eps)
        x, residual = ops.add_rms_norm(h, residual, layer.post_norm, eps)
        h = layer.plan.mlp.forward(ops, x, layer.mlp, step)
        if layer.mlp_norm is not None:
            h = ops.rms_norm(h, layer.mlp_norm, eps)
        return h, residual

    def read_kv(self, kv: KVStorage, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [layers, n, Hkv, D] (this rank's KV heads) at `slots` of `kv`."""
        index = slots.to(device=self.device, dtype=torch.int64)
        layers = range(len(self.spec.kv_layers))
        k = torch.stack([kv.k_cache(i).index_select(0, index) for i in layers])
        v = torch.stack([kv.v_cache(i).index_select(0, index) for i in layers])
        return k, v

    def new_linear_state(self) -> LinearState | None:
        """A fresh linear-attention state at position 0 (None for a model without)."""
        if self.linear_layout is None:
            return None
        return LinearState.resume(self.linear_layout, None)

    def logits_for_sequence(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [T, vocab] float32 of one cold full prefill of `token_ids`, in a scratch KV
        cache of exactly len(token_ids) slots. For tests and reference comparisons."""
        return self.cold_prefill(token_ids)[0]

    def cold_prefill(
        self, token_ids: list[int], routed_experts: bool = False
    ) -> tuple[torch.Tensor, ScratchKV]:
        """One cold full prefill of `token_ids` in a private KV cache (slot j holds position
        j): every position's logits [T, vocab] float32, and the cache it wrote (with
        `routed_experts`, its routing store too: `ScratchKV`)."""
        n = len(token_ids)
        kv = ScratchKV(self.spec, n, self.kv_dtype, self.device, self.plan.num_local_kv_heads,
                       routed_experts)  # fmt: skip
        kv.linear_state = self.new_linear_state()
        states = None if kv.linear_state is None else [kv.linear_state]
        positions = list(range(n))
        meta: AttentionMeta = build_attention_meta([n], [0], [positions])
        batch = ForwardBatch.from_lists(token_ids, positions, positions, meta, positions, states)
        return self.forward(batch.to(self.device), kv), kv


class ScratchKV:
    """A private KV cache for `cold_prefill`, k and v [KV layers, n, Hkv, D] (MLA: one latent
    row per token, k and v the same tensor [KV layers, n, 1, W]; the engine uses
    the shared KV pool), and the linear-attention state the prefill ended in (hybrid); Hkv:
    `num_kv_heads`, this rank's KV heads (default: the model's). `routed_experts`: keep the
    routing store too (lockstep/cache/routed_experts.py; a MoE model's), row j position j."""

    def __init__(
        self,
        spec: ModelSpec,
        n: int,
        dtype: torch.dtype,
        device: torch.device,
        num_kv_heads: int | None = None,
        routed_experts: bool = False,
    ) -> None:
        heads = num_kv_heads or spec.cache_kv_heads
        shape = (len(spec.kv_layers), n, heads, spec.cache_head_dim)
        self.linear_state: LinearState | None = None
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        # MLA keeps one latent row per token: its values are its keys' first columns.
        self.v = torch.zeros(shape, dtype=dtype, device=device) if spec.cache_values else self.k
        self.routed_experts: torch.Tensor | None = None
        if routed_experts:
            assert spec.moe is not None, "a routing store needs a mixture-of-experts model"
            rows = (n, *routed_store.store_row_shape(spec))
            id_dtype = routed_store.store_dtype(spec.moe.num_experts)
            self.routed_experts = torch.zeros(rows, dtype=id_dtype, device=device)

    def k_cache(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.v[layer]


# Tensors kept in float32 whatever the model dtype (name endings).
FLOAT32_TENSORS = ("norm.weight", ".bias", ".A_log", ".dt_bias", ".conv1d.weight",
                   ".e_score_correction_bias")  # fmt: skip


def weight_layout(spec: ModelSpec) -> list[tuple[LayoutEntry, Preparation]]:
    """How canonical tensors become the decoder's: `LayoutEntry`s (target, kind, source names,
    tensor-parallel shard rule), in load order, each with the function that prepares it: each
    layer's norms and the embedding, LM head and final norm here (blocks/prepare.py's common
    kinds), its mixer's and MLP's entries from their blocks, which prepare them."""
    layout: list[tuple[LayoutEntry, Preparation]] = []
    norm = spec.norm_kind
    norms = dict(spec.norm_names())
    for i, plan in enumerate(spec.layer_plans):
        p, t = f"model.layers.{i}.", f"layers.{i}."

        def norm_entry(field: str) -> tuple[LayoutEntry, Preparation]:
            return LayoutEntry(t + field, norm, [p + norms[field]]), prepare_common  # noqa: B023

        layout.append(norm_entry("input_norm"))
        layout += [(e, plan.mixer.prepare) for e in plan.mixer.layout(spec, i, "mixer")]
        layout += [norm_entry(f) for f in ("mixer_norm", "post_norm") if f in norms]
        layout += [(e, plan.mlp.prepare) for e in plan.mlp.layout(spec, i, "mlp")]
        if "mlp_norm" in norms:
            layout.append(norm_entry("mlp_norm"))
    head = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
    layout += [
        (LayoutEntry("embed", "embed", ["model.embed_tokens.weight"], "vocab"), prepare_common),
        (LayoutEntry("lm_head", "linear", [head], "vocab"), prepare_common),
        (LayoutEntry("final_norm", norm, ["model.norm.weight"]), prepare_common),
    ]
    return layout


def _fields(parts: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Take the prepared weights whose target starts with `prefix`, by the rest of the name."""
    return {
        t.removeprefix(prefix): parts.pop(t) for t in [t for t in parts if t.startswith(prefix)]
    }


def _refuse_missing_capability(spec: ModelSpec, ops: Ops, source: str) -> None:
    """Refuse, in one line, a backend that lacks an op capability (lockstep/ops/base.py) one of
    the model's blocks, or its FP8 linears, call."""
    needs: list[tuple[type, str]] = [(DenseOps, "every model")]
    if spec.fp8 is not None:
        needs.append((Fp8Ops, "its FP8 linears"))
    if spec.final_logit_softcap is not None:
        needs.append((SoftcapOps, "its soft-capped logits"))
    for plan in spec.layer_plans:
        for block in plan:
            needs += [(cap, f"its {type(block).__name__} layers") for cap in block.requires]
    for cap, user in needs:
        if not isinstance(ops, cap):
            raise ModelLoadError(
                f"{source}: the {ops.name} backend cannot run this model: {user} need "
                f"{cap.__name__}, which it lacks; the cpu_deterministic and gpu_deterministic "
                "backends have every capability"
            )
    if spec.mla is not None:  # a backend's kernel may take only some widths
        refusal = cast(LatentAttentionOps, ops).latent_width_refusal(
            spec.mla.kv_lora_rank, spec.mla.qk_rope_head_dim
        )
        if refusal is not None:
            raise ModelLoadError(f"{source}: the {ops.name} backend cannot run this model: "
                                 f"{refusal}; the CPU backends take any widths")  # fmt: skip


def _consume(
    layout: list[tuple[LayoutEntry, Preparation]], got: dict[str, torch.Tensor]
) -> Iterator[tuple[LayoutEntry, Preparation]]:
    """Yield the layout's entries, dropping each source tensor from `got` after its last use
    (so a load holds one copy of the model, not two)."""
    uses = Counter(n for entry, _ in layout for n in entry.sources)
    for entry, prepare in layout:
        yield entry, prepare
        for name in entry.sources:
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


def _fused_parts(
    weights: Iterable[tuple[str, torch.Tensor]],
    parts: Callable[[str, ModelSpec], Parts],
    spec: ModelSpec,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` with each fused tensor replaced by the canonical tensors it holds (views of
    its rows, `Family.parts`); every other (name, tensor) passes unchanged."""
    for name, tensor in weights:
        for part, rows in parts(name, spec):
            yield part, tensor if rows is None else tensor[rows]


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
