"""The routed-experts MLP of a mixture-of-experts layer (`ModelSpec.moe`, lockstep/ops/moe.py):
a router and `num_experts` SwiGLU experts, run by `Ops.moe`.

Canonical tensors (after "model.layers.{i}.", H hidden, E experts, I the expert width):

    mlp.gate.weight                          [E, H]   (the router)
    mlp.experts.{e}.{gate,up}_proj.weight    [I, H]
    mlp.experts.{e}.down_proj.weight         [H, I]

In a block-FP8 model (`ModelSpec.fp8`, scheme "block") every expert projection is e4m3 with
its `weight_scale` [ceil(N/128), ceil(K/128)] beside it (spec.py), as Qwen3-30B-A3B-FP8
stores them; the router stays unquantized (such checkpoints list `mlp.gate` in
`modules_to_not_convert`).

Prepared: the router as a linear, the experts stacked into gate_up [E, 2I, K'] and down
[E, H, I'] (lockstep/ops/moe.py, "Weights"), FP8 experts with their stacked block scales
(`Fp8Experts`, "FP8 experts" there). A token's output is a function of its own row (the
contract is in lockstep/ops/moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from lockstep.errors import ModelLoadError
from lockstep.models.blocks.base import BuildContext, LayoutEntry, Step
from lockstep.ops.base import MoeOps
from lockstep.ops.moe import Fp8Experts, MoeLayer

if TYPE_CHECKING:
    from lockstep.models.spec import ModelSpec
    from lockstep.ops.base import Ops


@dataclass
class MoeMlpWeights:
    """The prepared router and stacked experts, and the `MoeLayer` over the same tensors."""

    router: torch.Tensor
    experts_gate_up: torch.Tensor | Fp8Experts
    experts_down: torch.Tensor | Fp8Experts
    layer: MoeLayer


@dataclass(frozen=True)
class MoeMlp:
    """Softmax top-k routing over `ModelSpec.moe`'s experts."""

    prefix: ClassVar[str] = "mlp"
    requires: ClassVar[tuple[type, ...]] = (MoeOps,)

    def weight_names(self, spec: ModelSpec) -> list[str]:
        assert spec.moe is not None
        names = ["mlp.gate.weight"]
        for e in range(spec.moe.num_experts):
            names += [f"mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down")]
        return names

    def weight_shape(self, spec: ModelSpec, name: str) -> tuple[int, ...]:
        assert spec.moe is not None
        h, i = spec.hidden_size, spec.moe.intermediate_size
        if name == "mlp.gate.weight":
            return (spec.moe.num_experts, h)
        return (h, i) if name.endswith("down_proj.weight") else (i, h)

    def layout(self, spec: ModelSpec, layer: int, role: str) -> list[LayoutEntry]:
        assert spec.moe is not None
        p, t = f"model.layers.{layer}.mlp.", f"layers.{layer}.{role}."
        experts = [f"{p}experts.{e}." for e in range(spec.moe.num_experts)]
        gate_up = [e + f"{proj}_proj" for e in experts for proj in ("gate", "up")]
        down = [e + "down_proj" for e in experts]
        return [
            LayoutEntry(t + "router", "linear", [p + "gate.weight"]),
            _experts_entry(spec, t + "experts_gate_up", gate_up),
            _experts_entry(spec, t + "experts_down", down),
        ]

    def build(self, parts: dict[str, Any], context: BuildContext) -> MoeMlpWeights:
        moe = context.spec.moe
        assert moe is not None
        router, gate_up, down = parts["router"], parts["experts_gate_up"], parts["experts_down"]
        if isinstance(gate_up, Fp8Experts) and isinstance(down, Fp8Experts):
            layer = MoeLayer(router, gate_up.weight, down.weight, moe.top_k, moe.renormalize,
                             gate_up.scale, down.scale)  # fmt: skip
        else:
            layer = MoeLayer(router, gate_up, down, moe.top_k, moe.renormalize)
        return MoeMlpWeights(router, gate_up, down, layer)

    def forward(self, ops: Ops, x: torch.Tensor, w: MoeMlpWeights, step: Step) -> torch.Tensor:
        return ops.moe(x, w.layer)


def _experts_entry(spec: ModelSpec, target: str, modules: list[str]) -> LayoutEntry:
    """One stacked expert projection over `modules` (expert-major): "experts" (weights) when
    none is FP8, "fp8_experts" (weights, then their block scales) when all are. Experts of one
    layer share one grouped GEMM, so a mix of FP8 and unquantized experts is refused."""
    fp8 = [spec.is_fp8_linear(m) for m in modules]
    if not any(fp8):
        return LayoutEntry(target, "experts", [m + ".weight" for m in modules])
    if not all(fp8):
        raise ModelLoadError(
            f"{modules[fp8.index(False)]} is not FP8 but {modules[fp8.index(True)]} is: the "
            "experts of a layer run as one grouped GEMM and must share one format"
        )
    sources = [m + ".weight" for m in modules] + [m + ".weight_scale" for m in modules]
    return LayoutEntry(target, "fp8_experts", sources)  # block scheme only (spec.py)
