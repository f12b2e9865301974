"""The routed-experts MLP (`Ops.moe`): its weights, its contract, and the pieces backends share.

The contract (docs/design.md, "Mixture of experts"), for activations x [T, H]:

  1. Router logits l = linear(x, router) [T, E] in fp32, through the backend's linear (in a
     deterministic backend a row's bits do not depend on the other rows).
  2. A token's experts are its top_k logits in rank order, the largest first; among equal
     logits the lower expert id ranks first.
  3. Their weights are softmax probabilities: w_r = exp(l_r - l_0) / s, where s sums
     exp(l_j - l_0) over the k chosen experts (renormalize, Hugging Face's norm_topk_prob) or
     over all E. Each backend fixes the order of that sum (the CPU kernel: ascending rank, or
     its lane-partial tree over E; `route_sorted`: see there).
  4. Slot (token, rank r) holds expert e_r's output y_r = down_e(silu(gate_e x) * up_e x),
     computed by the backend's own linear and silu_mul on the expert's [N, K] weights. The
     deterministic linears are M-invariant, so y_r does not depend on how many tokens expert
     e_r received this step or which ones.
  5. out = w_0 y_0 + w_1 y_1 + ... + w_{k-1} y_{k-1} in fp32, added in ascending rank
     (`combine_in_rank_order`), then rounded once to x's dtype.

No capacity limit: every token gets all of its k experts, whatever its batch-mates chose.
Every step above is per token, so a token's output is a function of its own row of x.

Weights (`MoeLayer`): the router is a prepared linear weight [E, H]; the experts are stacked,
gate_up [E, 2I, K'] (rows gate | up) and down [E, H, I'], where slice [e] is exactly the
prepared linear weight `Ops.linear` takes (the backend's `prepare_linear_weight` of the
concatenated rows, so K' is the backend's padded K). One tensor per projection keeps in-place
weight updates a single copy and is the layout a grouped GEMM over experts reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

Linear = Callable[[Tensor, Tensor], Tensor]
SiluMul = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class MoeLayer:
    """One sparse layer's router and experts, as `Ops.moe` takes them (module docstring)."""

    router: Tensor  # prepared linear weight [E, H]
    gate_up: Tensor  # [E, 2I, K']: gate_up[e] is expert e's prepared gate | up weight
    down: Tensor  # [E, H, I']: down[e] is expert e's prepared down weight
    top_k: int
    renormalize: bool

    @property
    def num_experts(self) -> int:
        return int(self.gate_up.shape[0])


def prepare_expert_weights(prepare: Callable[[Tensor], Tensor], stacked: Tensor) -> Tensor:
    """[E, N, K] -> [E, N, K']: every expert's weight prepared by the backend's
    `prepare_linear_weight`, stacked. It is applied once to the [E*N, K] rows, which is the
    same as per expert because every backend prepares a weight row by row (pads K, converts)."""
    e, n, _ = stacked.shape
    return prepare(stacked.reshape(e * n, -1).contiguous()).view(e, n, -1)


class Routing(NamedTuple):
    """Each token's experts in rank order and their weights."""

    experts: Tensor  # int64 [T, k]
    weights: Tensor  # float32 [T, k]


def route_sorted(logits: Tensor, top_k: int, renormalize: bool) -> Routing:
    """Routing (contract steps 2-3) from torch operations that are exact per element or
    documented stable: a stable descending sort (equal logits keep ascending ids), exp per
    element, and sums written out as fixed sequences of elementwise adds: over the k in
    ascending rank, or over all E by a pairwise tree (E zero-padded to a power of two; level
    by level, column c adds column c + width/2). No host synchronization (CUDA-graph safe).
    Not for the CPU, whose vectorized exp may round its tail elements differently."""
    logits = logits.float()
    values, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
    top = values[:, :top_k]
    e = torch.exp(top - top[:, :1])
    if renormalize:
        total = e[:, 0]
        for r in range(1, top_k):
            total = total + e[:, r]
    else:
        terms = torch.exp(logits - top[:, :1])
        width = 1 << (terms.shape[1] - 1).bit_length()
        terms = torch.nn.functional.pad(terms, (0, width - terms.shape[1]))
        while width > 1:
            width //= 2
            terms = terms[:, :width] + terms[:, width:]
        total = terms[:, 0]
    return Routing(ids[:, :top_k].contiguous(), e / total[:, None])


def experts_grouped(
    x: Tensor, experts: Tensor, layer: MoeLayer, linear: Linear, silu_mul: SiluMul
) -> Tensor:
    """Every (token, rank) slot's expert output [T, k, H] (contract step 4), each expert run
    once on the rows routed to it. Reads the per-expert counts on the host."""
    t, k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, ascending within
    counts = torch.bincount(flat, minlength=layer.num_experts).tolist()
    out = torch.empty(t * k, layer.down.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start : start + n]
        start += n
        rows = x.index_select(0, torch.div(slots, k, rounding_mode="floor"))
        y = linear(silu_mul(linear(rows, layer.gate_up[e])), layer.down[e])
        out.index_copy_(0, slots, y.to(out.dtype))
    return out.view(t, k, -1)


def experts_dense(
    x: Tensor, experts: Tensor, layer: MoeLayer, linear: Linear, silu_mul: SiluMul
) -> Tensor:
    """The same slots as `experts_grouped`, computed by running every expert on every row and
    keeping the rows routed to it: E/k times the arithmetic, but no host synchronization, so
    a CUDA graph can hold it. A slot's bits equal `experts_grouped`'s wherever `linear` is
    M-invariant (other rows in the call change nothing)."""
    t, k = experts.shape
    out = torch.zeros(t, k, layer.down.shape[1], dtype=x.dtype, device=x.device)
    for e in range(layer.num_experts):
        y = linear(silu_mul(linear(x, layer.gate_up[e])), layer.down[e]).to(out.dtype)
        out = torch.where((experts == e)[:, :, None], y[:, None, :], out)
    return out


def combine_in_rank_order(slots: Tensor, weights: Tensor) -> Tensor:
    """out [T, H] fp32 = w_0 y_0 + w_1 y_1 + ..., one product and one add per element and
    rank, in ascending rank (contract step 5). slots [T, k, H], weights [T, k]."""
    slots, weights = slots.float(), weights.float()
    out = slots[:, 0] * weights[:, 0:1]
    for r in range(1, slots.shape[1]):
        out = out + slots[:, r] * weights[:, r : r + 1]
    return out
