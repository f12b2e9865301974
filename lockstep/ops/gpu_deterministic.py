"""The deterministic GPU backend: Triton kernels whose rows do not depend on the schedule.

Every method is a thin call into `lockstep.ops.triton`; the contract each kernel keeps is in
its module docstring. Importing this module never fails for lack of triton or CUDA (CPU-only
machines import the package tree); constructing the backend without triton does, with a clear
message. With TRITON_INTERPRET=1 set before triton is imported, the kernels also run on CPU
tensors (float32), which is how tests/test_ops_triton.py runs without a GPU.
"""

from __future__ import annotations

import torch

from lockstep.ops.base import AttentionInput, AttentionMeta, LayerKV
from lockstep.ops.moe import MoeLayer, combine_in_rank_order, experts_dense, route_sorted

try:
    from lockstep.ops.triton import activation, log_softmax, matmul, norm
    from lockstep.ops.triton.attention import DEFAULT_CONFIG, AttentionConfig, paged_attention
    from lockstep.ops.triton.attention_input import attention_input as _attention_input

    _IMPORT_ERROR: ImportError | None = None
except ImportError as exc:  # triton missing: report when the backend is asked for
    _IMPORT_ERROR = exc


class GpuDeterministicOps:
    """Ops backend over the Triton kernels (default on CUDA)."""

    name = "gpu_deterministic"
    deterministic = True

    def __init__(self, attention_config: AttentionConfig | None = None) -> None:
        if _IMPORT_ERROR is not None:
            raise RuntimeError(
                f"the gpu_deterministic backend needs triton ({_IMPORT_ERROR}); install the "
                "'gpu' extra or use mode=fast"
            )
        self.attention_config = attention_config or DEFAULT_CONFIG

    def prepare_linear_weight(self, weight: torch.Tensor) -> torch.Tensor:
        # [N, K] with K contiguous is the layout the matmul kernels read. The split-K arrival
        # counters of the weight's device are allocated now, outside any CUDA-graph capture.
        matmul.reserve_counters(weight.device)
        return weight.contiguous()

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return matmul.matmul(x, weight, bias)

    def partial_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return matmul.matmul(x, weight, out_dtype=torch.float32)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return norm.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return norm.add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return activation.silu_mul(gate_up)

    def attention_input(
        self, qkv: torch.Tensor, layer: AttentionInput, positions: torch.Tensor,
        slots: torch.Tensor, kv: LayerKV,
    ) -> torch.Tensor:  # fmt: skip
        """One fused kernel: q/k head norms, RoPE and the K/V cache writes."""
        return _attention_input(qkv, layer, positions, slots, kv)

    def attention(
        self, q: torch.Tensor, kv: LayerKV, meta: AttentionMeta, scale: float
    ) -> torch.Tensor:
        k_cache, v_cache = kv
        return paged_attention(q, k_cache, v_cache, meta, scale, self.attention_config)

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        return log_softmax.log_softmax(logits)

    def moe(self, x: torch.Tensor, layer: MoeLayer) -> torch.Tensor:
        """fp32 router logits from the Triton matmul, `route_sorted`, then every expert's
        Triton linears over all rows (`experts_dense`: correct and graph-safe, E/k times the
        needed arithmetic; a grouped GEMM over expert-sorted rows is the next step,
        docs/gpu.md), combined in rank order in fp32."""
        logits = matmul.matmul(x, layer.router, out_dtype=torch.float32)
        experts, weights = route_sorted(logits, layer.top_k, layer.renormalize)
        slots = experts_dense(x, experts, layer, self.linear, self.silu_mul)
        return combine_in_rank_order(slots, weights).to(x.dtype)
