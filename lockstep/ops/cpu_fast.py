"""Plain-torch CPU backend (`--mode fast`): the yardstick for speed and the negative control
for determinism. Its linear (oneDNN/MKL GEMM) changes a row's bits with the number of rows,
and its reductions may split across threads; nothing here is position invariant."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lockstep.ops.base import AttentionMeta, IndexCopyKVWrite


class CpuFastOps(IndexCopyKVWrite):
    """`Ops` from stock torch kernels; fp32 activations, weights converted to fp32 at load."""

    name = "cpu_fast"
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

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()

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

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMeta,
        scale: float,
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        group = q.shape[1] // k_cache.shape[1]
        cu_q, q_start, cu_kv = meta.cu_q.tolist(), meta.q_start.tolist(), meta.cu_kv.tolist()
        for b in range(meta.num_seqs):
            n, start = cu_q[b + 1] - cu_q[b], q_start[b]
            kv_len = start + n
            slots = meta.slot_table[cu_kv[b] : cu_kv[b] + kv_len].long()
            # [H, L, D]; GQA by repeating each kv head for its group of query heads.
            k = k_cache[slots].to(q.dtype).transpose(0, 1).repeat_interleave(group, 0)
            v = v_cache[slots].to(q.dtype).transpose(0, 1).repeat_interleave(group, 0)
            qb = q[cu_q[b] : cu_q[b + 1]].transpose(0, 1)
            rows = torch.arange(start, kv_len).unsqueeze(1)
            mask = torch.arange(kv_len).unsqueeze(0) <= rows  # [n, L], True = attend
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale)
            out[cu_q[b] : cu_q[b + 1]] = o.transpose(0, 1)
        return out

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits.float(), dim=-1)
