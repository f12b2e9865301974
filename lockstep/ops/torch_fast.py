"""The stock-torch row ops shared by both fast backends (CPU and GPU): RMSNorm, residual-add
+ RMSNorm, SiLU-mul, RoPE, log-softmax, the KV write and MoE routing. They make no invariance
promise; the device-specific parts (linear, attention, the experts) live in `cpu_fast.py` and
`gpu_fast.py`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lockstep.ops.base import ComposedAttentionInput, IndexCopyKVWrite
from lockstep.ops.moe import Routing


class TorchRowOps(IndexCopyKVWrite, ComposedAttentionInput):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (h * weight.float()).to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x + residual
        return self.rms_norm(summed, weight, eps), summed

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        c = cos[positions.long()].unsqueeze(1)
        s = sin[positions.long()].unsqueeze(1)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits.float(), dim=-1)


def stock_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """Routing as transformers writes it: softmax over all experts, `torch.topk` (whose order
    among equal values is unspecified), then division by the sum of the k."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(experts, weights)
