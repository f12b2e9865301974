"""How many prompt rows a step may carry beside streamed decodes: bounded inter-token latency.

A decode step reads every weight once and each running sequence's keys and values; a prompt
row beside them adds its arithmetic. Measured, a step's time is close to

    (W + KV) / BW + P x F / PEAK

(W the weight bytes, KV the keys and values the decodes read, BW the memory bandwidth, P the
prompt rows, F the FLOPs one row costs, PEAK the rate those rows run at), and a decode-only step
(W + KV) / BW. For the mixed step to cost at most `factor` decode-only steps:

    P <= (PEAK / BW) x (factor - 1) x (W + KV) / F

PEAK / BW, the FLOPs a step can do per byte it reads, is a property of the card and of the
kernels (`ridge_flop_per_byte`): prompt rows in mixed steps ran at about 340-390 TFLOP/s on
both Hopper cards, which read at 4.27 TB/s (H200) and 3.03 TB/s (H100) (docs/results.md,
"Memory beside the KV pool" and "The server path"). Where the bound is wrong it only moves how
prompts are cut into chunks: outputs never change (the contract covers any chunking).

The model leaves out what a mixed step pays beside its rows when it runs eagerly (decode-only
steps replay CUDA graphs): at a few dozen requests the host's launch work outlasts the device's,
and cutting prompts finer turns most steps into such eager ones. Piecewise CUDA graphs
(`--piecewise-cuda-graphs`) remove that price.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lockstep.models.spec import ModelSpec

# The prompt rows' effective matrix rate in a mixed step over memory bandwidth, FLOPs per byte
# (module docstring): the H200's, and by card where measured.
RIDGE_FLOP_PER_BYTE = 80
RIDGE_BY_CARD = {"H100": 128, "H200": 80}


def ridge_flop_per_byte(device_name: str) -> float:
    """The ridge of the card named `device_name` (torch.cuda.get_device_name), the H200's
    where the card was not measured."""
    for card, ridge in RIDGE_BY_CARD.items():
        if card in device_name:
            return ridge
    return RIDGE_FLOP_PER_BYTE


@dataclass(frozen=True)
class MixedStepBudget:
    """The most prompt rows a step that carries decodes may add: `rows(decode_keys)`.

    `weight_bytes`: the bytes a step reads of the weights; `flops_per_row`: what one row costs
    in the matrix products (2 x the parameters a token uses); `kv_bytes_per_key`: what a
    decode row reads per key it attends to; `factor`: the most decode-only steps a mixed step
    may cost; `ridge`: FLOPs per byte read (`ridge_flop_per_byte`)."""

    weight_bytes: int
    flops_per_row: int
    kv_bytes_per_key: int
    factor: float
    ridge: float = RIDGE_FLOP_PER_BYTE

    def rows(self, decode_keys: int) -> int:
        """The prompt rows a step whose decodes attend to `decode_keys` keys in all may add
        (at least one, so that prompts always advance)."""
        read = self.weight_bytes + decode_keys * self.kv_bytes_per_key
        allowed = self.ridge * (self.factor - 1) * read / self.flops_per_row
        return max(1, math.floor(allowed))


def active_parameters(spec: ModelSpec) -> int:
    """The parameters one token's forward multiplies by: all of them but the routed experts it
    is not sent to, and an untied embedding table (a lookup; tied, it is the LM head)."""
    total = spec.num_parameters
    if not spec.tie_word_embeddings:
        total -= spec.vocab_size * spec.hidden_size
    moe = spec.moe
    if moe is not None:
        idle = moe.num_experts - moe.top_k
        total -= len(moe.sparse_layers) * idle * 3 * spec.hidden_size * moe.intermediate_size
    return total


def mixed_step_budget(
    spec: ModelSpec,
    weight_bytes: int,
    kv_bytes_per_key: int,
    factor: float,
    ridge: float = RIDGE_FLOP_PER_BYTE,
) -> MixedStepBudget | None:
    """The bound for a served model, or None when `factor` is 0 (no bound)."""
    if factor == 0:
        return None
    flops = 2 * active_parameters(spec)
    return MixedStepBudget(weight_bytes, flops, kv_bytes_per_key, factor, ridge)
