"""The parts a decoder layer is made of (docs/map.md): one module per kind of mixer (attention,
latent attention, gated DeltaNet) or MLP, each owning its canonical weights, their preparation
and its forward (blocks/base.py says what a block provides). A model is a tuple of
`LayerPlan`s (blocks/plan.py, which also lists the model's canonical tensors): layer i is

    x = norm(h); h = mixer(x); x = norm(h + residual); h = mlp(x)

with the residual stream carried by the decoder (lockstep/models/decoder.py); Gemma 3 also
normalizes the mixer's and the MLP's outputs before they join the residual."""

from __future__ import annotations

from lockstep.models.blocks.attention import Attention
from lockstep.models.blocks.base import Block, Mixer
from lockstep.models.blocks.gated_deltanet import GatedDeltaNet
from lockstep.models.blocks.mla import LatentAttention
from lockstep.models.blocks.mlp import DenseMlp
from lockstep.models.blocks.moe import MoeMlp
from lockstep.models.blocks.plan import (
    LayerPlan,
    expected_weight_names,
    expected_weight_shape,
    plan_layers,
)

__all__ = ["Attention", "Block", "DenseMlp", "GatedDeltaNet", "LatentAttention", "LayerPlan",
           "Mixer", "MoeMlp", "expected_weight_names", "expected_weight_shape",
           "plan_layers"]  # fmt: skip
