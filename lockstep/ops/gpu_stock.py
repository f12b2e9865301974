"""The stock GPU backend (`--mode reference`): cuBLAS, torch SDPA and torch norms.

It is the stock-PyTorch negative control, not a speed target (the engine's deterministic
kernels are faster on the models measured in docs/results.md): cuBLAS picks kernels
by M and SDPA tiles by sequence length, so rows here may change with the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lockstep.ops import fp8
from lockstep.ops.base import AttentionMeta, LayerKV
from lockstep.ops.moe import (
    MoeLayer,
    dequantized_experts,
    experts_dense,
    write_routed_experts,
)
from lockstep.ops.torch_stock import TorchRowOps, stock_routing


class GpuStockOps(TorchRowOps):
    """Ops backend over plain torch CUDA ops (not position invariant)."""

    name = "gpu_stock"
    deterministic = False

    def prepare_linear_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.contiguous()

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        # Biases are prepared in float32; the stock layer adds them in the activations' dtype.
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))

    def prepare_fp8_linear(
        self,
        scheme: str,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        input_scale: torch.Tensor | None,
    ) -> fp8.Fp8Weight:
        return fp8.e4m3_weight(scheme, weight, weight_scale, input_scale)

    def fp8_linear(
        self, x: torch.Tensor, weight: fp8.Fp8Weight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Stock kernels: the activation quantized by the torch ops of `lockstep.ops.fp8`,
        then `torch._scaled_mm` with row-wise scales ("tensor", "channel"; bf16 out), or for
        "block" the dequantized activation and weight through F.linear in x's dtype."""
        w = weight
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        if w.scheme == "block":
            xhat = fp8.dequantized_activation(x2, w.scheme, None).to(x.dtype)
            what = fp8.dequantize_weight(w.scheme, w.weight, w.weight_scale).to(x.dtype)
            out = F.linear(xhat, what, None if bias is None else bias.to(x.dtype))
        else:
            if w.scheme == "tensor":
                assert w.input_scale is not None
                q = fp8.quantize_static(x2, w.input_scale)
                sx = w.input_scale.reshape(1, 1).expand(x2.shape[0], 1).contiguous()
            else:
                q, sx = fp8.quantize_rows(x2, k)
            out = torch._scaled_mm(
                q,
                w.weight.t(),
                scale_a=sx,
                scale_b=w.weight_scale.reshape(1, -1),
                bias=None if bias is None else bias.to(torch.bfloat16),
                out_dtype=torch.bfloat16,
            ).to(x.dtype)
        return out.reshape(*lead, w.out_features)

    def partial_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight).float()

    def moe(
        self, x: torch.Tensor, layer: MoeLayer, routed_experts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Stock routing, the experts through torch's grouped GEMM over expert-sorted rows
        where it runs (`torch._grouped_mm`: bf16 on sm90+), else every expert's cuBLAS
        linears over all rows (`experts_dense`); a torch sum over the k. No host sync
        either way, so decode graphs can hold it."""
        logits = F.linear(x, layer.router).float()
        experts, weights = stock_routing(logits, layer)
        write_routed_experts(routed_experts, experts)
        silu_mul = self.silu_mul
        if layer.fp8:
            # FP8 experts: every expert dequantized to x's dtype at each call, and the
            # activations quantized and dequantized (`lockstep.ops.fp8`) before each GEMM: the
            # negative control, not a speed yardstick for FP8 experts.
            scheme, down_in = layer.fp8_scheme, layer.down_input_scale
            x = fp8.dequantized_activation(x, scheme, layer.gate_up_input_scale).to(x.dtype)
            layer = dequantized_experts(layer, x.dtype)

            def silu_mul(g: torch.Tensor) -> torch.Tensor:
                return fp8.dequantized_activation(self.silu_mul(g), scheme, down_in).to(g.dtype)

        if grouped_mm_runs(x, layer):
            slots = experts_grouped_mm(x, experts, layer, silu_mul)
        else:
            slots = experts_dense(x, experts, layer, self.linear, silu_mul)
        return (slots.float() * weights[:, :, None]).sum(dim=1).to(x.dtype)

    def attention(
        self,
        q: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMeta,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """Decode rows (one query) go through one padded SDPA call; each prefill or extend
        chunk through its own call with a causal mask offset by its cached prefix (and the
        sliding window's lower bound). A pure decode step (meta.max_q == 1) never syncs with
        the host, so CUDA graphs can hold it."""
        out = torch.empty_like(q)
        if meta.max_q == 1 and q.shape[0] == meta.num_seqs:
            rows = torch.arange(meta.num_seqs, device=q.device)
            self._decode(out, q, kv, meta, scale, rows, meta.cu_kv[:-1],
                         meta.kv_len, meta.max_kv, window)  # fmt: skip
            return out
        cu_q = meta.cu_q.tolist()
        q_start = meta.q_start.tolist()
        kv_len = meta.kv_len.tolist()
        cu_kv = meta.cu_kv.tolist()
        decode = [b for b in range(meta.num_seqs) if cu_q[b + 1] - cu_q[b] == 1]
        if decode:
            dev = q.device
            self._decode(
                out, q, kv, meta, scale,
                torch.tensor([cu_q[b] for b in decode], device=dev),
                torch.tensor([cu_kv[b] for b in decode], device=dev),
                torch.tensor([kv_len[b] for b in decode], device=dev),
                max(kv_len[b] for b in decode), window,
            )  # fmt: skip
        dec = set(decode)
        for b in range(meta.num_seqs):
            lo, hi = cu_q[b], cu_q[b + 1]
            if b in dec or hi == lo:
                continue
            slots = meta.slot_table[cu_kv[b] : cu_kv[b + 1]].long()
            # An FP8 cache widens at its scales (`lockstep.ops.fp8.dequantize_kv`).
            k = fp8.widened(kv.k[slots], kv.k_scale, q.dtype).transpose(0, 1)[None]
            v = fp8.widened(kv.v[slots], kv.v_scale, q.dtype).transpose(0, 1)[None]
            qb = q[lo:hi].transpose(0, 1)[None]
            if q_start[b] == 0 and window is None:
                o = F.scaled_dot_product_attention(
                    qb, k, v, is_causal=True, scale=scale, enable_gqa=True
                )
            else:
                qpos = torch.arange(q_start[b], q_start[b] + hi - lo, device=q.device)
                kpos = torch.arange(kv_len[b], device=q.device)
                mask = kpos[None, :] <= qpos[:, None]
                if window is not None:
                    mask &= kpos[None, :] > qpos[:, None] - window
                o = F.scaled_dot_product_attention(
                    qb, k, v, attn_mask=mask, scale=scale, enable_gqa=True
                )
            out[lo:hi] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _decode(
        out: torch.Tensor,
        q: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMeta,
        scale: float,
        rows: torch.Tensor,
        starts: torch.Tensor,
        lens: torch.Tensor,
        width: int,
        window: int | None = None,
    ) -> None:
        """One query per sequence: rows [Bd] of q, whose keys are slot_table[starts + j] for
        j < lens (and j >= lens - window); keys gathered into [Bd, Hkv, width, D] with a
        padding mask."""
        j = torch.arange(width, device=q.device)
        valid = j[None, :] < lens.long()[:, None]
        if window is not None:
            valid &= j[None, :] >= lens.long()[:, None] - window
        idx = torch.where(valid, starts.long()[:, None] + j[None, :], 0)
        slots = meta.slot_table.long()[idx]  # [Bd, L]
        k = fp8.widened(kv.k[slots], kv.k_scale, q.dtype).permute(0, 2, 1, 3)  # [Bd, Hkv, L, D]
        v = fp8.widened(kv.v[slots], kv.v_scale, q.dtype).permute(0, 2, 1, 3)
        qb = q[rows][:, :, None, :]  # [Bd, Hq, 1, D]
        o = F.scaled_dot_product_attention(
            qb, k, v, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True
        )
        out[rows] = o[:, :, 0, :]


def grouped_mm_runs(x: torch.Tensor, layer: MoeLayer) -> bool:
    """Whether `torch._grouped_mm` takes this layer: CUDA sm90+, bf16, every dimension a
    multiple of 8 (16-byte rows)."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
        return False
    if torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    return all(d % 8 == 0 for d in (*layer.gate_up.shape[1:], *layer.down.shape[1:]))


def experts_grouped_mm(
    x: torch.Tensor, experts: torch.Tensor, layer: MoeLayer, silu_mul
) -> torch.Tensor:
    """Every slot's expert output [T, k, H] from two `torch._grouped_mm` calls over the
    slots grouped by expert (the deterministic backend's grouping kernels, which CUDA graphs
    can hold; the GEMMs are torch's)."""
    from lockstep.ops.triton.moe import group_slots

    t, k = experts.shape
    order, offsets = group_slots(experts, layer.num_experts)
    ends = offsets[1:].to(torch.int32)
    rows = x.index_select(0, torch.div(order, k, rounding_mode="floor"))
    gate_up = torch._grouped_mm(rows, layer.gate_up.transpose(1, 2), offs=ends)
    y = torch._grouped_mm(silu_mul(gate_up), layer.down.transpose(1, 2), offs=ends)
    slots = torch.empty_like(y).index_copy_(0, order, y)
    return slots.view(t, k, -1)
