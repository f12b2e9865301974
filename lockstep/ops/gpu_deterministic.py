"""The deterministic GPU backend: Triton kernels whose rows do not depend on the schedule.

Every method is a thin call into `lockstep.ops.triton`; the contract each kernel keeps is in
its module docstring. Importing this module never fails for lack of triton or CUDA (CPU-only
machines import the package tree); constructing the backend without triton does, with a clear
message. With TRITON_INTERPRET=1 set before triton is imported, the kernels also run on CPU
tensors (float32), which is how tests/kernels/test_ops_triton.py runs without a GPU.
"""

from __future__ import annotations

import torch

from lockstep.ops import fp8
from lockstep.ops.base import (
    AttentionInput,
    AttentionMeta,
    ComposedAttentionInput,
    ComposedLatentInput,
    IndexCopyKVWrite,
    LayerKV,
    PooledRows,
)
from lockstep.ops.moe import MoeLayer, Routing

try:
    from lockstep.ops.triton import (
        activation,
        chunked_delta,
        gated_delta,
        latent_input,
        log_softmax,
        matmul,
        norm,
    )
    from lockstep.ops.triton import moe as grouped_moe
    from lockstep.ops.triton.attention import DEFAULT_CONFIG, AttentionConfig, paged_attention
    from lockstep.ops.triton.attention_input import attention_input as _attention_input
    from lockstep.ops.triton.fp8_moe import moe_fp8
    from lockstep.ops.triton.latent_attention import (
        DEFAULT_LATENT_CONFIG,
        LatentConfig,
        latent_attention,
        width_refusal,
    )

    _IMPORT_ERROR: ImportError | None = None
except ImportError as exc:  # triton missing: report when the backend is asked for
    _IMPORT_ERROR = exc


class GpuDeterministicOps(IndexCopyKVWrite, ComposedAttentionInput, ComposedLatentInput):
    """Ops backend over the Triton kernels (default on CUDA)."""

    name = "gpu_deterministic"
    deterministic = True

    def __init__(
        self,
        attention_config: AttentionConfig | None = None,
        latent_config: LatentConfig | None = None,
        fused_latent_input: bool = False,
    ) -> None:
        """`fused_latent_input`: MLA's attention input as the two Triton kernels of
        lockstep/ops/triton/latent_input.py (the composed path's bits under the interpreter;
        not yet run compiled on a GPU, so off by default: `EngineConfig.mla_fused_input`);
        False: `ComposedLatentInput`'s torch ops."""
        if _IMPORT_ERROR is not None:
            raise RuntimeError(
                f"the gpu_deterministic backend needs triton ({_IMPORT_ERROR}); install the "
                "'gpu' extra or use mode=reference"
            )
        self.attention_config = attention_config or DEFAULT_CONFIG
        self.latent_config = latent_config or DEFAULT_LATENT_CONFIG
        self.fused_latent_input = fused_latent_input

    def prepare_linear_weight(self, weight: torch.Tensor) -> torch.Tensor:
        # [N, K] with K contiguous is the layout the matmul kernels read. The split-K arrival
        # counters of the weight's device are allocated now, outside any CUDA-graph capture.
        matmul.reserve_counters(weight.device)
        return weight.contiguous()

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return matmul.matmul(x, weight, bias)

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
        """The Triton FP8 GEMM (`lockstep.ops.fp8.fp8_linear`, its contract there)."""
        w = weight
        return fp8.fp8_linear(
            x, w.weight, w.weight_scale, w.scheme, input_scale=w.input_scale, bias=bias
        )

    def partial_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return matmul.matmul(x, weight, out_dtype=torch.float32)

    def grouped_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """One launch for every head (`matmul.grouped_matmul`: each group's rows are the
        bits `linear` gives it)."""
        return matmul.grouped_matmul(x, weight)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return norm.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return norm.add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return activation.silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return activation.gelu_tanh_mul(gate_up)

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        """cap * (1 - 2 / (exp(2x / cap) + 1)) by torch element-wise kernels in float32: each
        element's operations are the same whatever the launch shape."""
        x = x.float()
        return (1.0 - 2.0 / (torch.exp(x * (2.0 / cap)) + 1.0)) * cap

    def attention_input(
        self, qkv: torch.Tensor, layer: AttentionInput, positions: torch.Tensor,
        slots: torch.Tensor, kv: LayerKV,
    ) -> torch.Tensor:  # fmt: skip
        """One fused kernel: q/k head norms, RoPE and the K/V cache writes. Partial rotary
        embeddings (Qwen3.5) take the composed path: the Triton head norms, `rope` on the
        rotated dims, an exact copy into the caches."""
        if 2 * layer.cos.shape[1] != kv.k.shape[-1]:
            return ComposedAttentionInput.attention_input(self, qkv, layer, positions, slots, kv)
        return _attention_input(qkv, layer, positions, slots, kv)

    def rope(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """Neox RoPE in float32 by torch element-wise kernels (one multiply, one add or
        subtract per product: exact per element, whatever the launch shape)."""
        c = cos[positions.long()].unsqueeze(1)
        s = sin[positions.long()].unsqueeze(1)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    def attention(
        self,
        q: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMeta,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """The paged attention kernel (`lockstep/ops/triton/attention.py`). An FP8 cache's
        scales (`lockstep.ops.fp8`, "FP8 KV cache"): k_scale joins the score scale, and the
        float32 output is multiplied by v_scale before its one cast, on every path alike."""
        if kv.v_scale == 1.0:
            return paged_attention(q, kv.k, kv.v, meta, scale * kv.k_scale,
                                   self.attention_config, window=window)  # fmt: skip
        out = paged_attention(q, kv.k, kv.v, meta, scale * kv.k_scale, self.attention_config,
                              out_dtype=torch.float32, window=window)  # fmt: skip
        return (out * torch.full_like(out, kv.v_scale)).to(q.dtype)

    def write_latent_row(
        self, cache: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
        positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
    ) -> None:  # fmt: skip
        """With `fused_latent_input`, one kernel: RoPE of the key tail and the cache row
        written (`lockstep/ops/triton/latent_input.py`), the bits of `ComposedLatentInput`'s."""
        if not self.fused_latent_input:
            return super().write_latent_row(cache, latent, k_rope, positions, cos, sin, slots)
        latent_input.write_latent_row(cache, latent, k_rope, positions, cos, sin, slots)

    def latent_query(
        self, q_lat: torch.Tensor, q_rope: torch.Tensor, positions: torch.Tensor,
        cos: torch.Tensor, sin: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """With `fused_latent_input`, one kernel: RoPE of the query tails and the query
        assembled (`lockstep/ops/triton/latent_input.py`), the bits of `ComposedLatentInput`'s."""
        if not self.fused_latent_input:
            return super().latent_query(q_lat, q_rope, positions, cos, sin)
        return latent_input.latent_query(q_lat, q_rope, positions, cos, sin)

    def latent_attention(
        self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMeta, scale: float,
        value_dim: int,
    ) -> torch.Tensor:  # fmt: skip
        """MLA's absorbed attention (`lockstep/ops/triton/latent_attention.py`): the paged
        attention kernel family's blocks, splits and merge over one shared cache row per
        token."""
        return latent_attention(q, cache, meta, scale, value_dim, self.latent_config)

    def latent_width_refusal(self, latent: int, rope: int) -> str | None:
        """The Triton kernel's width rule (`latent_attention.width_refusal`)."""
        return width_refusal(latent, rope)

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        return log_softmax.log_softmax(logits)

    def target_log_softmax(
        self, logits: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`TargetLogSoftmaxOps`: the same partials and log-sum-exp fold as `log_softmax`."""
        return log_softmax.target_log_softmax(logits, targets)

    # ---- Gated DeltaNet (hybrid models): lockstep/ops/triton/gated_delta.py ----------------

    def gdn_gates(
        self, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return gated_delta.gdn_gates(a, b, a_log, dt_bias)

    def l2_normalize(self, x: torch.Tensor, eps: float, scale: float) -> torch.Tensor:
        return gated_delta.l2_normalize(x, eps, scale)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return gated_delta.gate_activation(torch.ones_like(x), x, "silu")

    def gate_activation(self, x: torch.Tensor, gate: torch.Tensor, kind: str) -> torch.Tensor:
        return gated_delta.gate_activation(x, gate, kind)

    def gated_delta_rule(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
        beta: torch.Tensor, state: torch.Tensor, open_k: torch.Tensor, open_gamma: torch.Tensor,
        open_u: torch.Tensor, start: int,
    ) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:  # fmt: skip
        return gated_delta.gated_delta_rule(
            q, k, v, g, beta, state, open_k, open_gamma, open_u, start
        )

    def causal_conv_silu_pooled(
        self, mixed: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor,
        seqs: PooledRows,
    ) -> torch.Tensor:  # fmt: skip
        return gated_delta.causal_conv_silu_pooled(mixed, windows, weight, seqs)

    def update_conv_windows(
        self, mixed: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor,
        seqs: PooledRows,
    ) -> torch.Tensor:  # fmt: skip
        return gated_delta.update_conv_windows(mixed, windows, weight, seqs)

    def gated_delta_rule_pooled(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
        beta: torch.Tensor, state: torch.Tensor, open_k: torch.Tensor, open_gamma: torch.Tensor,
        open_u: torch.Tensor, seqs: PooledRows,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        return gated_delta.gated_delta_rule_pooled(
            q, k, v, g, beta, state, open_k, open_gamma, open_u, seqs
        )

    def chunked_delta_rule(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
        beta: torch.Tensor, state: torch.Tensor, open_k: torch.Tensor, open_v: torch.Tensor,
        open_g: torch.Tensor, open_beta: torch.Tensor, start: int,
    ) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:  # fmt: skip
        return chunked_delta.chunked_delta_rule(
            q, k, v, g, beta, state, open_k, open_v, open_g, open_beta, start
        )

    def chunked_delta_rule_pooled(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
        beta: torch.Tensor, state: torch.Tensor, open_k: torch.Tensor, open_v: torch.Tensor,
        open_g: torch.Tensor, open_beta: torch.Tensor, seqs: PooledRows,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        return chunked_delta.chunked_delta_rule_pooled(
            q, k, v, g, beta, state, open_k, open_v, open_g, open_beta, seqs
        )

    def moe(
        self, x: torch.Tensor, layer: MoeLayer, routed_experts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """fp32 router logits from the Triton matmul, the routing kernel, slots grouped by
        expert on the device, the grouped gate_up (+ SiLU) and down GEMMs and the rank-order
        combine (`lockstep/ops/triton/moe.py`): no host synchronization, only the chosen
        experts' weights read. DeepSeek layers (`layer.deepseek`) route by `route_deepseek`.
        FP8 experts (any scheme): the same pipeline with grouped FP8 GEMMs
        (`lockstep/ops/triton/fp8_moe.py`)."""
        if layer.fp8:
            return moe_fp8(x, layer, routed_experts=routed_experts)
        return grouped_moe.moe(x, layer, routed_experts=routed_experts)

    def moe_route(self, x: torch.Tensor, layer: MoeLayer) -> Routing:
        """The routing kernels `moe` runs: fp32 logits from the Triton matmul, then
        `route_layer`."""
        return grouped_moe.route_layer(grouped_moe.router_logits(x, layer), layer)

    def route_deepseek(self, logits: torch.Tensor, layer: MoeLayer) -> Routing:
        """DeepSeek routing, one Triton program per token (`moe.route_deepseek` in
        `lockstep/ops/triton/moe.py`); `moe` routes DeepSeek layers through it."""
        return grouped_moe.route_deepseek(logits.float().contiguous(), layer)
