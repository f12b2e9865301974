"""The default CPU backend: C++ kernels that are position invariant by construction.

Each output element is computed by one fixed sequence of fp32 operations (see the header of
`csrc/lockstep_cpu.cpp` for the reduction orders), so a row's bits do not depend on how many
rows share the call, where the row sits, the thread count, or (attention) how its sequence was
split into query chunks. Activations are fp32; weights fp32 or bf16; KV cache fp32 or bf16.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from lockstep.ops import chunked_delta
from lockstep.ops.base import (
    AttentionMeta,
    ComposedAttentionInput,
    ComposedLatentInput,
    GroupedLinearByGroups,
    IndexCopyKVWrite,
    LayerKV,
)
from lockstep.ops.cpu_build import load_extension
from lockstep.ops.fp8 import E4M3, DequantizedFp8Linear, dequantize_kv
from lockstep.ops.moe import (
    MoeLayer,
    Routing,
    combine_in_rank_order,
    experts_grouped,
    fp8_swiglu_expert,
    route_deepseek,
    write_routed_experts,
)

# Reduction lanes: weights are padded along K to a multiple of this at preparation.
LANES = 16
# Keys per online-softmax block, at absolute positions 0, B, 2B, ... Part of the numerics:
# changing it changes the bits (the engine version must change with it).
KEY_BLOCK = 32
SIMD_VARIANTS = {"auto": 0, "avx2": 1, "scalar": 2, "avx512": 3}


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


class CpuDeterministicOps(
    DequantizedFp8Linear,
    IndexCopyKVWrite,
    ComposedAttentionInput,
    ComposedLatentInput,
    GroupedLinearByGroups,
):
    """`Ops` backed by `csrc/lockstep_cpu.cpp`. FP8 linears: the dequantized weight and
    activation through the same `linear` (`DequantizedFp8Linear`); an FP8 KV cache is read
    through `fp32_key_values` at the layer's scales.

    `simd` picks the kernel path ("auto", "avx512", "avx2", "scalar"); all give the same bits,
    which the tests check. `key_block` exists so tests can show that changing the attention
    reduction order does change bits; the engine always uses the default.
    """

    name = "cpu_deterministic"
    deterministic = True
    supported_head_dims = (32, 64, 128)  # attention kernels are instantiated for these

    def __init__(self, simd: str = "auto", key_block: int = KEY_BLOCK) -> None:
        self._ext = load_extension()
        if simd not in SIMD_VARIANTS:
            raise ValueError(f"simd={simd!r} is invalid: expected one of {sorted(SIMD_VARIANTS)}")
        if simd != "auto" and simd not in self._ext.simd_variants():
            raise ValueError(
                f"simd={simd!r} is not compiled for this CPU: available {self._ext.simd_variants()}"
            )
        if key_block not in (16, 32):
            raise ValueError(f"key_block={key_block} is invalid: expected 16 or 32")
        self._simd = SIMD_VARIANTS[simd]
        self._key_block = key_block

    def prepare_linear_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """Keep fp32 / bf16 as is (other dtypes become fp32); zero-pad K to a multiple of 16."""
        if weight.dtype not in (torch.float32, torch.bfloat16):
            weight = weight.to(torch.float32)
        pad = -weight.shape[1] % LANES
        if pad:
            weight = F.pad(weight, (0, pad))
        return weight.contiguous()

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = _f32(x)
        k = x.shape[-1]
        if weight.shape[1] % LANES or weight.dtype not in (torch.float32, torch.bfloat16):
            weight = self.prepare_linear_weight(weight)
        if k > weight.shape[1]:
            raise ValueError(f"linear: x has K={k} but the weight has {weight.shape[1]} columns")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        if k < weight.shape[1]:
            # Zero padding is part of the defined arithmetic (prepare_linear_weight pads too).
            x2 = F.pad(x2, (0, weight.shape[1] - k))
        b = None if bias is None else _f32(bias)
        out = self._ext.linear(x2.contiguous(), weight.contiguous(), b, self._simd)
        return out.reshape(*lead, weight.shape[0])

    def partial_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.linear(x, weight)  # float32 already

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape
        (out,) = self._ext.rms_norm(
            _f32(x).reshape(-1, shape[-1]), None, _f32(weight), eps, self._simd
        )
        return out.reshape(shape)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        h = shape[-1]
        out, summed = self._ext.rms_norm(
            _f32(x).reshape(-1, h), _f32(residual).reshape(-1, h), _f32(weight), eps, self._simd
        )
        return out.reshape(shape), summed.reshape(shape)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._ext.gated_act_mul(_f32(gate_up), 0, self._simd)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._ext.gated_act_mul(_f32(gate_up), 1, self._simd)

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        return self._ext.softcap(_f32(x), cap, self._simd)

    def rope(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        out = self._ext.rope(_f32(x), positions.to(torch.int64).contiguous(), _f32(cos), _f32(sin))
        return out.to(x.dtype)

    def attention(
        self,
        q: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMeta,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = kv.k, kv.v
        if k_cache.dtype == E4M3:
            k_cache, v_cache, meta = fp32_key_values(kv, meta)
        if k_cache.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"KV cache dtype {k_cache.dtype} is invalid: expected fp32, bf16 or float8_e4m3fn"
            )
        out = self._ext.attention(
            _f32(q),
            k_cache.contiguous(),
            v_cache.contiguous(),
            meta.cu_q.to(torch.int32).contiguous(),
            meta.q_start.to(torch.int32).contiguous(),
            meta.cu_kv.to(torch.int32).contiguous(),
            meta.slot_table.to(torch.int32).contiguous(),
            scale,
            self._key_block,
            window or 0,
            self._simd,
        )
        return out.to(q.dtype)

    def latent_width_refusal(self, latent: int, rope: int) -> str | None:
        return None  # any widths

    def latent_attention(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMeta,
        scale: float,
        value_dim: int,
    ) -> torch.Tensor:
        """The C++ `latent_attention` (its formula in the kernel's header): 32-key blocks at
        absolute positions, the same score and softmax sequence as `attention`. An FP8 cache
        is widened exactly first, as for `attention`."""
        if cache.dtype == E4M3:
            cache, _, meta = fp32_key_values(LayerKV(cache, cache), meta)
        if cache.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"KV cache dtype {cache.dtype} is invalid: expected fp32, bf16 or float8_e4m3fn"
            )
        out = self._ext.latent_attention(
            _f32(q),
            cache.reshape(cache.shape[0], -1).contiguous(),
            meta.cu_q.to(torch.int32).contiguous(),
            meta.q_start.to(torch.int32).contiguous(),
            meta.cu_kv.to(torch.int32).contiguous(),
            meta.slot_table.to(torch.int32).contiguous(),
            scale,
            value_dim,
            self._simd,
        )
        return out.to(q.dtype)

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        return self._ext.log_softmax(_f32(logits), self._simd)

    # ---- Gated DeltaNet (hybrid models): formulas in the C++ kernels' comments -------------

    def gdn_gates(
        self, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        g, beta = self._ext.gdn_gates(_f32(a), _f32(b), _f32(a_log), _f32(dt_bias), self._simd)
        return g, beta

    def l2_normalize(self, x: torch.Tensor, eps: float, scale: float) -> torch.Tensor:
        return self._ext.l2_normalize(_f32(x), eps, scale, self._simd)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        x = _f32(x)
        return self._ext.gate_activation(torch.ones_like(x), x, 1, self._simd)

    def gate_activation(self, x: torch.Tensor, gate: torch.Tensor, kind: str) -> torch.Tensor:
        mode = {"sigmoid": 0, "silu": 1}[kind]
        return self._ext.gate_activation(_f32(x), _f32(gate), mode, self._simd).to(x.dtype)

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
        out, boundaries = self._ext.gdn_rule(
            _f32(q), _f32(k), _f32(v), _f32(g), _f32(beta), state, open_k, open_gamma, open_u,
            start, self._simd,
        )  # fmt: skip
        chunk = open_k.shape[0]
        first = (start // chunk + 1) * chunk
        return out, [(first + i * chunk, s) for i, s in enumerate(boundaries)]

    def chunked_delta_rule(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
        beta: torch.Tensor, state: torch.Tensor, open_k: torch.Tensor, open_v: torch.Tensor,
        open_g: torch.Tensor, open_beta: torch.Tensor, start: int,
    ) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:  # fmt: skip
        """The torch chunked form (lockstep/ops/chunked_delta.py): row-local by construction,
        so the CPU keeps the contract with `gdn_kernel="chunked"` as the GPU kernels do."""
        return chunked_delta.chunked_delta_rule(
            _f32(q), _f32(k), _f32(v), _f32(g), _f32(beta), state, open_k, open_v, open_g,
            open_beta, start,
        )  # fmt: skip

    def moe(
        self, x: torch.Tensor, layer: MoeLayer, routed_experts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Router logits by `linear`, routing by the C++ `moe_route` (its formula is in the
        kernel's header), each expert's rows through `linear` (FP8 experts: `fp8_expert_linear`
        at the layer's scheme, the dense FP8 linear's arithmetic) and `silu_mul` once per step, then the rank-order
        fp32 combine."""
        x = _f32(x)
        experts, weights = self.moe_route(x, layer)
        write_routed_experts(routed_experts, experts)
        expert = (
            fp8_swiglu_expert(layer, self.fp8_expert_linear, self.silu_mul) if layer.fp8 else None
        )
        slots = experts_grouped(x, experts, layer, self.linear, self.silu_mul, expert)
        return combine_in_rank_order(slots, weights)

    def moe_route(self, x: torch.Tensor, layer: MoeLayer) -> Routing:
        """Router logits by `linear`, then the C++ `moe_route` or `route_deepseek`."""
        logits = self.linear(_f32(x), layer.router)
        if layer.deepseek is not None:
            return self.route_deepseek(logits, layer)
        experts, weights = self._ext.moe_route(logits, layer.top_k, layer.renormalize, self._simd)
        return Routing(experts, weights)

    def route_deepseek(self, logits: torch.Tensor, layer: MoeLayer) -> Routing:
        """DeepSeek routing (`lockstep.ops.moe`, steps 2'-3'): the scores from the extension's
        own per-element kernels (sigmoid: `gate_activation` of ones; softmax: `moe_route` over
        every expert, scattered back to expert order), then `route_deepseek`'s exact steps."""
        r = layer.deepseek
        assert r is not None
        logits = _f32(logits)
        if r.scoring == "sigmoid":
            scores = self._ext.gate_activation(torch.ones_like(logits), logits, 0, self._simd)
        else:
            ids, probs = self._ext.moe_route(logits, logits.shape[1], False, self._simd)
            scores = torch.empty_like(probs).scatter_(1, ids, probs)
        return route_deepseek(scores, layer.top_k, layer.renormalize, r)


def fp32_key_values(
    kv: LayerKV, meta: AttentionMeta
) -> tuple[torch.Tensor, torch.Tensor, AttentionMeta]:
    """An FP8 cache's keys and values of this step's sequences, widened to fp32 at the
    layer's scales (`lockstep.ops.fp8.dequantize_kv`: one product per element, exact at scale
    1.0) into compact caches, and the metadata over them: sequence b's key j moves to row
    cu_kv[b] + j. The attention arithmetic is the fp32 cache's, so a row's bits depend only
    on the stored e4m3 values and the layer's scales."""
    slots = meta.slot_table.to(torch.int64)
    compact = dataclasses.replace(
        meta, slot_table=torch.arange(slots.numel(), dtype=torch.int32, device=slots.device)
    )
    k = dequantize_kv(kv.k[slots], kv.k_scale)
    v = dequantize_kv(kv.v[slots], kv.v_scale)
    return k, v, compact
