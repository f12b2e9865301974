"""Float64 backend: the slow, obvious oracle the engine's kernels are tested against.

Every op converts its inputs to float64 and returns float64 (the KV cache keeps its own dtype),
so a whole forward pass on this backend stays in float64. Tests only; not for serving.
"""

from __future__ import annotations

import torch

from lockstep.ops.base import AttentionMeta, ComposedAttentionInput, IndexCopyKVWrite, LayerKV
from lockstep.ops.fp8 import Fp8Weight, check_fp8_weight, fp8_linear_reference
from lockstep.ops.moe import (
    ExpertFn,
    MoeLayer,
    Routing,
    expert_parts,
    experts_grouped,
    write_routed_experts,
)

f64 = torch.float64


class Float64Ops(IndexCopyKVWrite, ComposedAttentionInput):
    """`Ops` in float64 torch, written for clarity rather than speed."""

    name = "float64"
    deterministic = True

    def prepare_linear_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.to(f64)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = x.to(f64) @ weight.to(f64).T
        return out if bias is None else out + bias.to(f64)

    def prepare_fp8_linear(
        self,
        scheme: str,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        input_scale: torch.Tensor | None,
    ) -> Fp8Weight:
        check_fp8_weight(scheme, weight, weight_scale, input_scale)
        return Fp8Weight(scheme, weight, weight_scale, input_scale, weight.shape[1])

    def fp8_linear(
        self, x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`fp8_linear_reference`: the activation (float64 here) is quantized from its fp32
        rounding, as every backend quantizes fp32 activations."""
        w = weight
        return fp8_linear_reference(x, w.weight, w.weight_scale, w.scheme, w.input_scale, bias)

    def partial_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.linear(x, weight)  # float64: the reference never rounds to float32

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.to(f64)
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(f64)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x.to(f64) + residual.to(f64)
        return self.rms_norm(summed, weight, eps), summed

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.to(f64).chunk(2, dim=-1)
        return gate / (1 + torch.exp(-gate)) * up

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        return torch.tanh(x.to(f64) / cap) * cap

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.to(f64).chunk(2, dim=-1)
        inner = (2.0 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3)
        return 0.5 * gate * (1 + torch.tanh(inner)) * up

    def rope(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        c = cos.to(f64)[positions.long()].unsqueeze(1)
        s = sin.to(f64)[positions.long()].unsqueeze(1)
        x1, x2 = x.to(f64).chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    def attention(
        self,
        q: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMeta,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = kv.k, kv.v
        q = q.to(f64)
        out = torch.empty_like(q)
        group = q.shape[1] // k_cache.shape[1]
        cu_q, q_start, cu_kv = meta.cu_q.tolist(), meta.q_start.tolist(), meta.cu_kv.tolist()
        for b in range(meta.num_seqs):
            for i in range(cu_q[b + 1] - cu_q[b]):
                pos = q_start[b] + i
                first = 0 if window is None else max(0, pos - window + 1)
                slots = meta.slot_table[cu_kv[b] + first : cu_kv[b] + pos + 1].long()
                # An FP8 cache's values are exact in float64, and so are their products with
                # the layer's fp32 scales (4 + 24 significant bits).
                k = (k_cache[slots].to(f64) * kv.k_scale).repeat_interleave(group, 1)
                v = (v_cache[slots].to(f64) * kv.v_scale).repeat_interleave(group, 1)
                row = cu_q[b] + i
                scores = torch.einsum("hd,lhd->hl", q[row], k) * scale
                weights = torch.softmax(scores, dim=-1)
                out[row] = torch.einsum("hl,lhd->hd", weights, v)
        return out

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        x = logits.to(f64)
        m = x.max(-1, keepdim=True).values
        return x - m - torch.log(torch.exp(x - m).sum(-1, keepdim=True))

    def moe(
        self, x: torch.Tensor, layer: MoeLayer, routed_experts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The contract in float64: a stable sort of the logits (ties keep the lower id),
        the full softmax, the chosen probabilities (renormalized), a sum over the k."""
        x = x.to(f64)
        experts, weights = self.moe_route(x, layer)
        write_routed_experts(routed_experts, experts)
        expert = self._fp8_expert(layer) if layer.fp8 else None
        slots = experts_grouped(x, experts, layer, self.linear, self.silu_mul, expert)
        return (slots * weights[:, :, None]).sum(dim=1)

    def moe_route(self, x: torch.Tensor, layer: MoeLayer) -> Routing:
        """A stable sort of the float64 logits (ties keep the lower id), the full softmax,
        the chosen probabilities (renormalized)."""
        logits = self.linear(x, layer.router)
        experts = torch.sort(logits, dim=-1, descending=True, stable=True).indices
        experts = experts[:, : layer.top_k]
        weights = torch.softmax(logits, dim=-1).gather(1, experts)
        if layer.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(experts, weights)

    def _fp8_expert(self, layer: MoeLayer) -> ExpertFn:
        """An FP8 expert by `fp8_linear_reference` at the layer's scheme, each checkpoint part
        (gate, up, down) with its own scales and the projection's static input scale."""
        assert layer.gate_up_scale is not None and layer.down_scale is not None
        gate_up_scale, down_scale = layer.gate_up_scale, layer.down_scale
        scheme, up_in, down_in = layer.fp8_scheme, layer.gate_up_input_scale, layer.down_input_scale

        def run(rows: torch.Tensor, e: int) -> torch.Tensor:
            parts = expert_parts(layer.gate_up[e], gate_up_scale[e], 2)
            gate_up = torch.cat(
                [fp8_linear_reference(rows, w, s, scheme, up_in) for w, s in parts], 1
            )
            ((w, s),) = expert_parts(layer.down[e], down_scale[e], 1)
            return fp8_linear_reference(self.silu_mul(gate_up), w, s, scheme, down_in)

        return run
