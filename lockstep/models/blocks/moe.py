"""The routed-experts MLP of a mixture-of-experts layer (`ModelSpec.moe`, lockstep/ops/moe.py):
a router and `num_experts` SwiGLU experts, run by `Ops.moe`.

Canonical tensors (after "model.layers.{i}.", H hidden, E experts, I the expert width):

    mlp.gate.weight                          [E, H]   (the router)
    mlp.experts.{e}.{gate,up}_proj.weight    [I, H]
    mlp.experts.{e}.down_proj.weight         [H, I]

Prepared: the router as a linear, the experts stacked into gate_up [E, 2I, K'] and down
[E, H, I'] (lockstep/ops/moe.py, "Weights"). A token's output is a function of its own row
(the contract is in lockstep/ops/moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from lockstep.models.blocks.base import BuildContext, LayoutEntry, Step
from lockstep.ops.base import MoeOps
from lockstep.ops.moe import MoeLayer

if TYPE_CHECKING:
    from lockstep.models.spec import ModelSpec
    from lockstep.ops.base import Ops


@dataclass
class MoeMlpWeights:
    """The prepared router and stacked experts, and the `MoeLayer` over the same tensors."""

    router: torch.Tensor
    experts_gate_up: torch.Tensor
    experts_down: torch.Tensor
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
        gate_up = [e + f"{proj}_proj.weight" for e in experts for proj in ("gate", "up")]
        return [
            LayoutEntry(t + "router", "linear", [p + "gate.weight"]),
            LayoutEntry(t + "experts_gate_up", "experts", gate_up),
            LayoutEntry(t + "experts_down", "experts", [e + "down_proj.weight" for e in experts]),
        ]

    def build(self, parts: dict[str, Any], context: BuildContext) -> MoeMlpWeights:
        moe = context.spec.moe
        assert moe is not None
        router, gate_up, down = parts["router"], parts["experts_gate_up"], parts["experts_down"]
        layer = MoeLayer(router, gate_up, down, moe.top_k, moe.renormalize)
        return MoeMlpWeights(router, gate_up, down, layer)

    def forward(self, ops: Ops, x: torch.Tensor, w: MoeMlpWeights, step: Step) -> torch.Tensor:
        return ops.moe(x, w.layer)
