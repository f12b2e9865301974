"""The stock-torch row ops shared by both stock backends of `--mode reference` (CPU and GPU):
RMSNorm, residual-add + RMSNorm, SiLU-mul, RoPE, log-softmax, the KV write, MoE routing and
MLA's latent attention. They make no invariance promise; the device-specific parts (linear,
paged attention, the experts) live in `cpu_stock.py` and `gpu_stock.py`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lockstep.ops.base import (
    AttentionMeta,
    ComposedAttentionInput,
    ComposedLatentInput,
    IndexCopyKVWrite,
)
from lockstep.ops.moe import MoeLayer, Routing, stock_route_deepseek


class TorchRowOps(IndexCopyKVWrite, ComposedAttentionInput, ComposedLatentInput):
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

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        return torch.tanh(x / cap) * cap

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def rope(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        c = cos[positions.long()].unsqueeze(1)
        s = sin[positions.long()].unsqueeze(1)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits.float(), dim=-1)

    def moe_route(self, x: torch.Tensor, layer: MoeLayer) -> Routing:
        """`stock_routing` of the router's logits (F.linear, as `moe` computes them)."""
        return stock_routing(F.linear(x, layer.router.to(x.dtype)).float(), layer)

    def route_deepseek(self, logits: torch.Tensor, layer: MoeLayer) -> Routing:
        assert layer.deepseek is not None
        return stock_route_deepseek(logits, layer.top_k, layer.renormalize, layer.deepseek)

    def latent_width_refusal(self, latent: int, rope: int) -> str | None:
        return None  # any widths

    def grouped_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """One batched matmul over the groups (reference mode: any kernel torch picks)."""
        return torch.einsum("tgk,gnk->tgn", x, weight.to(x.dtype))

    def latent_attention(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMeta,
        scale: float,
        value_dim: int,
    ) -> torch.Tensor:
        """The stock formulation (keys: whole cache rows; values: their first `value_dim`
        columns; an FP8 cache widens exactly, its scale is 1.0). A pure decode step
        (meta.max_q == 1, one row per sequence) gathers every sequence's rows, padded to the
        longest, into one masked matmul-softmax-matmul with no host synchronization, so
        decode graphs can hold it; otherwise torch SDPA per sequence with a causal mask
        offset by its cached prefix."""
        if meta.max_q == 1 and q.shape[0] == meta.num_seqs:
            return _latent_decode(q, cache, meta, scale, value_dim)
        out = q.new_empty(q.shape[0], q.shape[1], value_dim)
        cu_q, q_start, cu_kv = meta.cu_q.tolist(), meta.q_start.tolist(), meta.cu_kv.tolist()
        for b in range(meta.num_seqs):
            n, start = cu_q[b + 1] - cu_q[b], q_start[b]
            slots = meta.slot_table[cu_kv[b] : cu_kv[b] + start + n].long()
            rows = cache[slots, 0].to(q.dtype)  # [L, W]
            k = rows[None].expand(q.shape[1], -1, -1)
            v = rows[None, :, :value_dim].expand(q.shape[1], -1, -1)
            qb = q[cu_q[b] : cu_q[b + 1]].transpose(0, 1)
            keys = torch.arange(start + n, device=q.device)
            mask = keys[None, :] <= torch.arange(start, start + n, device=q.device)[:, None]
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale)
            out[cu_q[b] : cu_q[b + 1]] = o.transpose(0, 1)
        return out

    def gdn_gates(
        self, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
        return g, b.float().sigmoid()

    def l2_normalize(self, x: torch.Tensor, eps: float, scale: float) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps) * scale

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x.float())

    def gate_activation(self, x: torch.Tensor, gate: torch.Tensor, kind: str) -> torch.Tensor:
        act = torch.sigmoid(gate.float()) if kind == "sigmoid" else F.silu(gate.float())
        return (x.float() * act).to(x.dtype)

    def gated_delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        open_k: torch.Tensor,
        open_gamma: torch.Tensor,
        open_u: torch.Tensor,
        start: int,
    ) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
        """The stock formulation: the recurrent form for a one-row step, else the chunked
        form in chunks counted from this step's first row; `state` is the state at `start`
        (no open rows). Only a step that ends on a chunk boundary reports its state."""
        out, final = stock_gated_delta_rule(q, k, v, g, beta, state, open_k.shape[0])
        state.copy_(final)
        end = start + q.shape[0]
        return out, [(end, final.clone())] if end % open_k.shape[0] == 0 else []


def _latent_decode(
    q: torch.Tensor, cache: torch.Tensor, meta: AttentionMeta, scale: float, value_dim: int
) -> torch.Tensor:
    """One query per sequence (q [B, H, W]): its keys slot_table[cu_kv[b] + j], j < kv_len[b],
    gathered into [B, L, W] (L = meta.max_kv) with a padding mask; softmax in float32."""
    j = torch.arange(meta.max_kv, device=q.device)
    valid = j[None, :] < meta.kv_len.long()[:, None]
    idx = torch.where(valid, meta.cu_kv[:-1].long()[:, None] + j[None, :], 0)
    rows = cache[meta.slot_table[idx].long(), 0].to(q.dtype)  # [B, L, W]
    s = torch.matmul(q, rows.transpose(1, 2)).float() * scale  # [B, H, L]
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).to(q.dtype)
    return torch.matmul(p, rows[:, :, :value_dim])


def stock_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule as transformers and flash-linear-attention compute it: a
    per-token recurrence for one row, else chunks of `chunk` rows from the first row (padded
    at the end) with the intra-chunk system solved by a triangular solve and batched matmuls.
    q, k [n, Hk, Dk]; v [n, Hv, Dv]; g, beta [n, Hv]; state [Hv, Dk, Dv] at the first row.
    Returns (out [n, Hv, Dv], the state after the last row)."""
    n, hv = v.shape[0], v.shape[1]
    group = hv // k.shape[1]
    q, k = (x.repeat_interleave(group, dim=1).transpose(0, 1).float() for x in (q, k))
    v, g, beta = v.transpose(0, 1).float(), g.t().float(), beta.t().float()
    s = state.float()
    if n == 1:
        s = s * g[:, 0].exp()[:, None, None]
        predicted = (s * k[:, 0, :, None]).sum(dim=1)
        delta = (v[:, 0] - predicted) * beta[:, 0, None]
        s = s + k[:, 0, :, None] * delta[:, None, :]
        return (s * q[:, 0, :, None]).sum(dim=1)[None], s
    pad = -n % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    m = (n + pad) // chunk
    q, k, v = (x.reshape(hv, m, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(hv, m, chunk), beta.reshape(hv, m, chunk)
    gamma = g.cumsum(dim=-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False,
                                      unitriangular=True)  # fmt: skip
    w = torch.linalg.solve_triangular(system, k_beta * gamma.exp()[..., None], upper=False,
                                      unitriangular=True)  # fmt: skip
    intra = (q @ k.transpose(-1, -2)) * decay
    out = torch.empty_like(v)
    for c in range(m):
        v_new = u[:, c] - w[:, c] @ s
        out[:, c] = (q[:, c] * gamma[:, c, :, None].exp()) @ s + intra[:, c] @ v_new
        last = gamma[:, c, -1]
        tail = (last[:, None] - gamma[:, c]).exp()[..., None]
        s = s * last.exp()[:, None, None] + (k[:, c] * tail).transpose(-1, -2) @ v_new
    return out.reshape(hv, m * chunk, -1)[:, :n].transpose(0, 1), s


def stock_routing(logits: torch.Tensor, layer: MoeLayer) -> Routing:
    """The stock backends' routing of `layer`: DeepSeek's as transformers writes it where the
    layer has it, else `stock_route`."""
    if layer.deepseek is not None:
        return stock_route_deepseek(logits, layer.top_k, layer.renormalize, layer.deepseek)
    return stock_route(logits, layer.top_k, layer.renormalize)


def stock_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """Routing as transformers writes it: softmax over all experts, `torch.topk` (whose order
    among equal values is unspecified), then division by the sum of the k."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(experts, weights)
