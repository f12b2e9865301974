"""Plain-torch CPU backend (`--mode reference`): the stock-PyTorch negative control for
determinism. Its linear (oneDNN/MKL GEMM) changes a row's bits with the number of rows,
and its reductions may split across threads; nothing here is position invariant."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lockstep.ops.base import AttentionMeta, LayerKV
from lockstep.ops.fp8 import DequantizedFp8Linear, widened
from lockstep.ops.moe import MoeLayer, fp8_swiglu_expert, swiglu_expert, write_routed_experts
from lockstep.ops.torch_stock import TorchRowOps, stock_routing


class CpuStockOps(DequantizedFp8Linear, TorchRowOps):
    """`Ops` from stock torch kernels; fp32 activations, weights converted to fp32 at load
    (FP8 weights dequantized, activations quantized as `lockstep.ops.fp8` defines, then
    F.linear)."""

    name = "cpu_stock"
    deterministic = False

    def prepare_linear_weight(self, weight: torch.Tensor) -> torch.Tensor:
        # torch's CPU GEMM is fastest (and mixed-dtype F.linear is refused) with fp32 weights.
        return weight.to(torch.float32).contiguous()

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        return F.linear(x, weight, bias)

    def partial_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.linear(x, weight)  # float32 already

    def attention(
        self,
        q: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMeta,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = kv.k, kv.v
        out = torch.empty_like(q)
        group = q.shape[1] // k_cache.shape[1]
        cu_q, q_start, cu_kv = meta.cu_q.tolist(), meta.q_start.tolist(), meta.cu_kv.tolist()
        for b in range(meta.num_seqs):
            n, start = cu_q[b + 1] - cu_q[b], q_start[b]
            kv_len = start + n
            slots = meta.slot_table[cu_kv[b] : cu_kv[b] + kv_len].long()
            # [H, L, D]; GQA by repeating each kv head for its group of query heads.
            # An FP8 cache widens at its scales (`lockstep.ops.fp8.dequantize_kv`).
            k = widened(k_cache[slots], kv.k_scale, q.dtype).transpose(0, 1)
            v = widened(v_cache[slots], kv.v_scale, q.dtype).transpose(0, 1)
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            qb = q[cu_q[b] : cu_q[b + 1]].transpose(0, 1)
            rows = torch.arange(start, kv_len).unsqueeze(1)
            keys = torch.arange(kv_len).unsqueeze(0)
            mask = keys <= rows  # [n, L], True = attend
            if window is not None:
                mask &= keys > rows - window
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale)
            out[cu_q[b] : cu_q[b + 1]] = o.transpose(0, 1)
        return out

    def moe(
        self, x: torch.Tensor, layer: MoeLayer, routed_experts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """transformers' eager loop: each expert that got tokens runs F.linear on them (FP8
        experts: on the dequantized activation, `fp8_expert_linear`), and its weighted rows
        are index_add_-ed into the output in expert order."""
        experts, weights = stock_routing(self.linear(x, layer.router), layer)
        write_routed_experts(routed_experts, experts)

        def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate) * up

        if layer.fp8:
            expert = fp8_swiglu_expert(layer, self.fp8_expert_linear, silu_mul)
        else:
            expert = swiglu_expert(layer, self.linear, silu_mul)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in experts.unique().tolist():
            token, rank = torch.where(experts == e)
            y = expert(x[token], e)
            out.index_add_(0, token, y * weights[token, rank, None])
        return out
