"""The routed-experts MLP of a mixture-of-experts layer (`ModelSpec.moe`, lockstep/ops/moe.py):
a router and `num_experts` SwiGLU experts, run by `Ops.moe`, and in Qwen3-Next and
Qwen3.5-MoE a gated shared expert beside them, in the DeepSeek families an ungated one.

Canonical tensors (after "model.layers.{i}.", H hidden, E experts, I the expert width, S the
shared expert's width):

    mlp.gate.weight                          [E, H]   (the router)
    mlp.experts.{e}.{gate,up}_proj.weight    [I, H]
    mlp.experts.{e}.down_proj.weight         [H, I]
    mlp.shared_expert.{gate,up}_proj.weight  [S, H]   (shared expert only)
    mlp.shared_expert.down_proj.weight       [H, S]
    mlp.shared_expert_gate.weight            [1, H]
    mlp.shared_experts.{gate,up}_proj.weight [S, H]   (DeepSeek's ungated shared experts, S
    mlp.shared_experts.down_proj.weight      [H, S]    = n_shared_experts x their width)
    mlp.gate.e_score_correction_bias         [E]      (DeepSeek-V3 routing: float32)

With a shared expert, a token's output is routed + sigmoid(x . g) * shared(x), as
transformers' Qwen2MoeSparseMoeBlock computes it: the routed experts' sum (`Ops.moe`, rounded
to x's dtype), the shared SwiGLU (gate | up fused by rows, as the dense MLP) scaled by the
sigmoid of its gate row (`Ops.gate_activation`, whose arithmetic is per element), then one
elementwise add. DeepSeek's shared experts are one SwiGLU of S added ungated: routed +
shared(x). DeepSeek routing (sigmoid scores, the correction bias, expert groups, a routed
scaling factor: lockstep/ops/moe.py) runs inside `Ops.moe` from `MoeLayer.deepseek`. Every
step is row-local, so the contract below holds unchanged.

In an FP8 model (`ModelSpec.fp8`) every expert projection is e4m3 with its scales beside it
in the model's scheme (spec.py): block-wise as Qwen3-30B-A3B-FP8 and DeepSeek-V3 store them
(DeepSeek's shared experts too, as FP8 linears), per channel with dynamic per-token
activations (compressed-tensors), or per tensor with static input scales (ModelOpt). The
router and the correction bias stay unquantized (Qwen's checkpoints list `mlp.gate` in
`modules_to_not_convert`; an FP8 router is refused at load).

Prepared: the router as a linear, the shared expert's gate | up and gate row as linears, its
down row-parallel (as the dense MLP's), the experts stacked into gate_up [E, 2I, K'] and down
[E, H, I'] (lockstep/ops/moe.py, "Weights"), FP8 experts with their stacked scales
(`Fp8Experts`, "FP8 experts" there). A token's output is a function of its own row (the
contract is in lockstep/ops/moe.py).

Tensor and expert parallelism (lockstep/parallel/experts.py): at a degree above 1, or at TP 1
under the chunked reduction, a rank keeps its experts' gate_up rows of its columns and their
down as a `RowParallelWeight` of stacked pieces, and the layer runs `sharded_moe` instead of
`Ops.moe`; the shared expert is cut by columns as the dense MLP is. Block-FP8 experts are cut
alike, their block scales with them (`sharded_fp8_experts`; on the CPU only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from lockstep.errors import ModelLoadError
from lockstep.models.blocks.base import (
    BuildContext,
    LayoutEntry,
    Linear,
    PrepareContext,
    Step,
    linear,
    linear_entry,
    row_linear_entry,
)
from lockstep.models.blocks.prepare import concatenated, fp8_pieces, prepare_common
from lockstep.ops.base import DeepseekRoutingOps, DenseOps, GatedOutputOps, MoeOps
from lockstep.ops.moe import (
    DeepseekRouting,
    Fp8Experts,
    MoeLayer,
    prepare_expert_weights,
    prepare_fp8_experts,
)
from lockstep.parallel.experts import (
    expert_down_columns,
    expert_gate_up_rows,
    sharded_experts,
    sharded_fp8_experts,
    sharded_moe,
)
from lockstep.parallel.layers import RowParallelWeight

if TYPE_CHECKING:
    from lockstep.models.spec import ModelSpec
    from lockstep.ops.base import Ops


@dataclass
class MoeMlpWeights:
    """The prepared router and stacked experts, the `MoeLayer` over the same tensors, and the
    shared expert's linears (None without one)."""

    router: torch.Tensor
    experts_gate_up: torch.Tensor | Fp8Experts
    # Sharded experts (lockstep/parallel/experts.py): this rank's pieces, and `layer.down`
    # is an empty [local experts, H, 0] (the layer then carries the router and gate_up).
    experts_down: torch.Tensor | Fp8Experts | RowParallelWeight
    layer: MoeLayer
    shared_gate_up: Linear | None = None  # rows gate | up
    shared_down: Linear | RowParallelWeight | None = None
    shared_gate: torch.Tensor | None = None  # [8, H]: row 0 the shared expert's sigmoid gate
    correction_bias: torch.Tensor | None = None  # DeepSeek-V3: [E] fp32, `layer.deepseek`'s
    routing_index: int = 0  # the layer's index among the sparse layers (the routing store's)


SHARED_KINDS = ("", "gated", "ungated")


@dataclass(frozen=True)
class MoeMlp:
    """Top-k routing over `ModelSpec.moe`'s experts (softmax, or DeepSeek's when
    `deepseek_routing`), with a `shared` expert of width `MoeSpec.shared_expert_size`:
    "gated" (Qwen3-Next, Qwen3.5-MoE), "ungated" (DeepSeek) or none ("")."""

    shared: str = ""
    deepseek_routing: bool = False

    prefix: ClassVar[str] = "mlp"

    def __post_init__(self) -> None:
        if self.shared not in SHARED_KINDS:
            raise ValueError(f"shared={self.shared!r}: expected one of {SHARED_KINDS}")

    @property
    def requires(self) -> tuple[type, ...]:
        shared = {"": (), "gated": (DenseOps, GatedOutputOps), "ungated": (DenseOps,)}
        routing = (DeepseekRoutingOps,) if self.deepseek_routing else ()
        return (MoeOps, *shared[self.shared], *routing)

    @property
    def _shared_module(self) -> str:
        return "mlp.shared_experts." if self.shared == "ungated" else "mlp.shared_expert."

    def weight_names(self, spec: ModelSpec) -> list[str]:
        assert spec.moe is not None
        names = ["mlp.gate.weight"]
        if spec.moe.correction_bias:
            names.append("mlp.gate.e_score_correction_bias")
        for e in range(spec.moe.num_experts):
            names += [f"mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down")]
        if self.shared:
            names += [f"{self._shared_module}{p}_proj.weight" for p in ("gate", "up", "down")]
        if self.shared == "gated":
            names.append("mlp.shared_expert_gate.weight")
        return names

    def weight_shape(self, spec: ModelSpec, name: str) -> tuple[int, ...]:
        assert spec.moe is not None
        h, i = spec.hidden_size, spec.moe.intermediate_size
        if name == "mlp.gate.weight":
            return (spec.moe.num_experts, h)
        if name == "mlp.gate.e_score_correction_bias":
            return (spec.moe.num_experts,)
        if name == "mlp.shared_expert_gate.weight":
            return (1, h)
        if name.startswith(self._shared_module):
            i = spec.moe.shared_expert_size
        return (h, i) if name.endswith("down_proj.weight") else (i, h)

    def layout(self, spec: ModelSpec, layer: int, role: str) -> list[LayoutEntry]:
        assert spec.moe is not None
        p, t = f"model.layers.{layer}.mlp.", f"layers.{layer}.{role}."
        experts = [f"{p}experts.{e}." for e in range(spec.moe.num_experts)]
        gate_up = [e + f"{proj}_proj" for e in experts for proj in ("gate", "up")]
        down = [e + "down_proj" for e in experts]
        entries = [
            LayoutEntry(t + "router", "linear", [p + "gate.weight"]),
            _experts_entry(spec, t + "experts_gate_up", gate_up),
            _experts_entry(spec, t + "experts_down", down),
        ]
        if spec.moe.correction_bias:
            entries.append(
                LayoutEntry(t + "correction_bias", "bias", [p + "gate.e_score_correction_bias"])
            )
        if self.shared:
            s = f"model.layers.{layer}.{self._shared_module}"
            entries += [
                linear_entry(spec, t + "shared_gate_up", [s + "gate_proj", s + "up_proj"],
                             "shared"),
                row_linear_entry(spec, t + "shared_down", s + "down_proj", "row_shared"),
            ]  # fmt: skip
        if self.shared == "gated":
            entries.append(
                LayoutEntry(t + "shared_gate", "linear", [p + "shared_expert_gate.weight"])
            )
        return entries

    def prepare(
        self, entry: LayoutEntry, parts: list[torch.Tensor], context: PrepareContext
    ) -> Any:
        """Common kinds (blocks/prepare.py), and: "experts" (expert-major sources, the same
        number per expert: each expert's rows concatenated, then stacked and prepared by
        `prepare_expert_weights`) and "fp8_experts" (FP8 experts: the expert-major weights,
        then their scales, then ("tensor") their input scales, `prepare_fp8_experts`)."""
        moe, device = context.spec.moe, context.device
        if entry.kind not in ("experts", "fp8_experts"):
            return prepare_common(entry, parts, context)
        assert moe is not None
        ops = context.ops
        if entry.kind == "fp8_experts":
            assert context.spec.fp8 is not None
            scheme = context.spec.fp8.scheme
            n = len(parts) // (3 if scheme == "tensor" else 2)
            weights = [w.to(device) for w in parts[:n]]
            scales = [s.to(device=device, dtype=torch.float32) for s in parts[n:]]
            if fp8_pieces(context) and sharded_experts(context.parallel):
                # Block-FP8 only: the other schemes run at tp 1 (lockstep/engine/engine.py).
                return sharded_fp8_experts(context.parallel, entry.target, weights, scales[:n])
            return prepare_fp8_experts(ops.prepare_fp8_linear, weights, scales[:n],
                                       moe.num_experts, scheme, scales[n:] or None)  # fmt: skip
        parallel, experts = context.parallel, moe.num_experts
        if sharded_experts(parallel):
            if entry.target.endswith("experts_down"):
                down = expert_down_columns(parallel.plan, parts)
                return parallel.row_weight(down.to(device=device, dtype=context.dtype), "expert")
            parts = expert_gate_up_rows(parallel.plan, parts)
            lo, hi = parallel.plan.experts
            experts = hi - lo
        fused = concatenated(parts, context)
        # Expert-major sources, so the concatenated rows are expert e's rows at block e.
        stacked = fused.view(experts, -1, fused.shape[1])
        return prepare_expert_weights(ops.prepare_linear_weight, stacked)

    def build(self, parts: dict[str, Any], context: BuildContext) -> MoeMlpWeights:
        moe = context.spec.moe
        assert moe is not None
        router, gate_up, down = parts["router"], parts["experts_gate_up"], parts["experts_down"]
        deepseek = None
        if moe.deepseek_routing:
            deepseek = DeepseekRouting(moe.scoring, parts.get("correction_bias"), moe.groups,
                                       moe.topk_groups, moe.group_score, moe.routed_scaling)  # fmt: skip
        if isinstance(gate_up, Fp8Experts) and isinstance(down, Fp8Experts):
            layer = MoeLayer(router, gate_up.weight, down.weight, moe.top_k, moe.renormalize,
                             gate_up.scale, down.scale, deepseek, gate_up.scheme,
                             gate_up.input_scale, down.input_scale)  # fmt: skip
        elif isinstance(down, RowParallelWeight):  # sharded: `down` holds the pieces
            # Block-FP8 experts: the layer holds their prepared weights (sharded_moe runs
            # them through the FP8 expert linear).
            rows = gate_up.weight if isinstance(gate_up, Fp8Experts) else gate_up
            empty = rows.new_empty((rows.shape[0], context.spec.hidden_size, 0))
            layer = MoeLayer(router, rows, empty, moe.top_k, moe.renormalize, deepseek=deepseek)
        else:
            layer = MoeLayer(router, gate_up, down, moe.top_k, moe.renormalize, deepseek=deepseek)
        shared_gate = parts.get("shared_gate")
        if shared_gate is not None:
            # Zero rows up to 8: a one-column output's rows would not be 16-byte aligned,
            # which the GPU matmul's tensor descriptors require; column 0 is the gate.
            shared_gate = torch.cat([shared_gate, shared_gate.new_zeros(7, shared_gate.shape[1])])
        return MoeMlpWeights(router, gate_up, down, layer, parts.get("shared_gate_up"),
                             parts.get("shared_down"), shared_gate, parts.get("correction_bias"),
                             moe.sparse_layers.index(context.layer))  # fmt: skip

    def forward(self, ops: Ops, x: torch.Tensor, w: MoeMlpWeights, step: Step) -> torch.Tensor:
        store = step.kv.routed_experts
        ids = None
        if store is not None:
            # The op writes the ids it routed by; they go to the rows' KV slots (padding rows
            # of a CUDA graph copy row 0, so they write row 0's very ids into its slot).
            ids = torch.empty((x.shape[0], w.layer.top_k), dtype=store.dtype, device=x.device)
        if isinstance(w.experts_down, RowParallelWeight):
            routed = sharded_moe(step.parallel, x, w.layer, w.experts_down, ids)
        else:
            routed = ops.moe(x, w.layer) if ids is None else ops.moe(x, w.layer, ids)
        if store is not None and ids is not None:
            store[:, w.routing_index].index_copy_(0, step.batch.out_slots, ids)
        if w.shared_gate_up is None:
            return routed
        assert w.shared_down is not None
        act = ops.silu_mul(linear(ops, x, w.shared_gate_up))
        if isinstance(w.shared_down, RowParallelWeight):
            shared = step.parallel.row_linear(act, w.shared_down, "shared")
        else:
            shared = linear(ops, act, w.shared_down)
        if w.shared_gate is None:  # DeepSeek: ungated, one elementwise add
            return routed + shared.to(routed.dtype)
        # One gate value per token, broadcast over its row so the gate op (which takes x and
        # gate of one shape) computes each element's sigmoid by the same per-element formula.
        gate = linear(ops, x, w.shared_gate)[:, :1].expand_as(shared).contiguous()
        return routed + ops.gate_activation(shared, gate, "sigmoid")


def _experts_entry(spec: ModelSpec, target: str, modules: list[str]) -> LayoutEntry:
    """One stacked expert projection over `modules` (expert-major): "experts" (weights) when
    none is FP8, "fp8_experts" (weights, then their scales, then "tensor" input scales) when
    all are. Experts of one
    layer share one grouped GEMM, so a mix of FP8 and unquantized experts is refused."""
    fp8 = [spec.is_fp8_linear(m) for m in modules]
    if not any(fp8):
        return LayoutEntry(target, "experts", [m + ".weight" for m in modules])
    if not all(fp8):
        raise ModelLoadError(
            f"{modules[fp8.index(False)]} is not FP8 but {modules[fp8.index(True)]} is: the "
            "experts of a layer run as one grouped GEMM and must share one format"
        )
    assert spec.fp8 is not None
    suffixes = [".weight", ".weight_scale"] + (
        [".input_scale"] if spec.fp8.scheme == "tensor" else []
    )
    return LayoutEntry(target, "fp8_experts", [m + s for s in suffixes for m in modules])
