"""The dense gated MLP: down(act(gate x) * up x), act SiLU (SwiGLU) or tanh-approximated GELU
(GeGLU, Gemma's gelu_pytorch_tanh).

Canonical tensors (after "model.layers.{i}.", H hidden, I intermediate):

    mlp.{gate,up}_proj.weight   [I, H]
    mlp.down_proj.weight        [H, I]

Prepared: gate | up fused by rows into one linear (each output element's reduction is
unchanged), down row-parallel (or FP8). Every op is row-local.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

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
from lockstep.models.blocks.prepare import prepare_common
from lockstep.ops.base import DenseOps, GeluOps
from lockstep.ops.fp8 import Fp8Weight
from lockstep.parallel.layers import RowParallelWeight

if TYPE_CHECKING:
    from lockstep.models.spec import ModelSpec
    from lockstep.ops.base import Ops


@dataclass
class DenseMlpWeights:
    gate_up: Linear  # rows gate | up
    down: Linear | RowParallelWeight


@dataclass(frozen=True)
class DenseMlp:
    """SwiGLU (`activation` "silu") or GeGLU ("gelu_tanh") of width
    `ModelSpec.intermediate_size`."""

    activation: str = "silu"

    prefix: ClassVar[str] = "mlp"

    @property
    def requires(self) -> tuple[type, ...]:
        return (DenseOps, GeluOps) if self.activation == "gelu_tanh" else (DenseOps,)

    def weight_names(self, spec: ModelSpec) -> list[str]:
        return [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]

    def weight_shape(self, spec: ModelSpec, name: str) -> tuple[int, ...]:
        h, i = spec.hidden_size, spec.intermediate_size
        return (h, i) if name == "mlp.down_proj.weight" else (i, h)

    def layout(self, spec: ModelSpec, layer: int, role: str) -> list[LayoutEntry]:
        p, t = f"model.layers.{layer}.mlp.", f"layers.{layer}.{role}."
        return [
            linear_entry(spec, t + "gate_up", [p + "gate_proj", p + "up_proj"], "intermediate"),
            row_linear_entry(spec, t + "down", p + "down_proj", "row_mlp"),
        ]

    def prepare(
        self, entry: LayoutEntry, parts: list[torch.Tensor], context: PrepareContext
    ) -> Any:
        return prepare_common(entry, parts, context)

    def build(self, parts: dict[str, Any], context: BuildContext) -> DenseMlpWeights:
        return DenseMlpWeights(parts["gate_up"], parts["down"])

    def forward(self, ops: Ops, x: torch.Tensor, w: DenseMlpWeights, step: Step) -> torch.Tensor:
        gate_up = linear(ops, x, w.gate_up)
        act = (
            ops.gelu_tanh_mul(gate_up) if self.activation == "gelu_tanh" else ops.silu_mul(gate_up)
        )
        if isinstance(w.down, Fp8Weight):
            return linear(ops, act, w.down)
        return step.parallel.row_linear(act, w.down, "mlp")
