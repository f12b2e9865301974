"""How many prompt rows a step may carry beside streamed decodes: bounded inter-token latency.

A decode step reads every weight once and each running sequence's keys and values; a prompt
row beside them adds its arithmetic. Measured, a step's time is close to

    (W + KV) / BW + P x F / PEAK

(W the weight bytes, KV the keys and values the decodes read, BW the memory bandwidth, P the
prompt rows, F the FLOPs one row costs, PEAK the rate those rows run at), and a decode-only step
(W + KV) / BW. For the mixed step to cost at most `factor` decode-only steps:

    P <= (PEAK / BW) x (factor - 1) x (W + KV) / F

PEAK / BW, the FLOPs a step can do per byte it reads, is a property of the card and of the
kernels: RIDGE_FLOP_PER_BYTE is the effective one measured on an H200 (docs/results.md, "Memory
beside the KV pool"). An H100 reads more slowly at the same rate, so its ridge is higher and
there the bound errs on the side of smaller chunks. Where the bound is wrong it only moves how
prompts are cut into chunks: outputs never change (the contract covers any chunking).

The model leaves out what a mixed step pays beside its rows: it runs eagerly, while decode-only
steps replay CUDA graphs, and at a few dozen requests the host's launch work outlasts the
device's. Cutting prompts finer then turns most steps into eager ones: at 64 streams of 512 in
/ 256 out the longest gap shrank and the typical one more than doubled (docs/results.md, "The
server path"). So the bound is off unless asked for (`--max-mixed-step-cost`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lockstep.models.spec import ModelSpec

# The prompt rows' effective matrix rate in a mixed step over memory bandwidth, FLOPs per byte
# (module docstring).
RIDGE_FLOP_PER_BYTE = 80


@dataclass(frozen=True)
class MixedStepBudget:
    """The most prompt rows a step that carries decodes may add: `rows(decode_keys)`.

    `weight_bytes`: the bytes a step reads of the weights; `flops_per_row`: what one row costs
    in the matrix products (2 x the parameters a token uses); `kv_bytes_per_key`: what a
    decode row reads per key it attends to; `factor`: the most decode-only steps a mixed step
    may cost."""

    weight_bytes: int
    flops_per_row: int
    kv_bytes_per_key: int
    factor: float

    def rows(self, decode_keys: int) -> int:
        """The prompt rows a step whose decodes attend to `decode_keys` keys in all may add
        (at least one, so that prompts always advance)."""
        read = self.weight_bytes + decode_keys * self.kv_bytes_per_key
        allowed = RIDGE_FLOP_PER_BYTE * (self.factor - 1) * read / self.flops_per_row
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
    spec: ModelSpec, weight_bytes: int, kv_bytes_per_key: int, factor: float
) -> MixedStepBudget | None:
    """The bound for a served model, or None when `factor` is 0 (no bound)."""
    if factor == 0:
        return None
    return MixedStepBudget(weight_bytes, 2 * active_parameters(spec), kv_bytes_per_key, factor)
