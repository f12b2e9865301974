"""`DifferentiableOps`: the engine's `Ops` backend seen through autograd, so that the engine's
own decoder and blocks (lockstep/models/decoder.py, lockstep/models/blocks) run a training
forward with the engine's bits and a correct gradient.

Forward: every method calls the wrapped backend's method of the same name on the same inputs
(the backend's `prepare_linear_weight` is applied inside each call, so a weight the blocks
prepare stays a differentiable view of the parameters). Backward: plain torch, never the
engine's kernels (lockstep/training/functions.py): each op's torch twin of the same formula,
differentiated by autograd at the saved inputs.

    op                          backward
    linear, partial_linear      closed-form matmuls (functions.linear)
    log_softmax                 closed form in float32
    norms, activations, gates,  a float32 twin (`TwinBackward`): RMSNorm, SiLU, GeGLU, sigmoid
    softcap, RoPE, L2 norm      and SiLU gates, soft-capping, RoPE, Gated DeltaNet's gates;
                                on CUDA RMSNorm and SiLU-mul by fused Triton kernels
                                (ops/triton/row_grads.py)
    gated_delta_rule            the chunked torch form (`stock_gated_delta_rule`) from a zero
                                state: a training sequence always starts at position 0
    attention, latent_attention `attention_input` / `write_latent` keep the differentiable rows
                                they wrote to the cache; the attention's backward recomputes
                                q, k, v from them in torch (norms, RoPE, the cache's rounding
                                passed straight through) and takes the attention's gradient
                                by torch's fused attention backward in the kernel's q dtype
                                (training/sdpa_grad.py), or blockwise with a sliding window
                                and for MLA's narrower values (training/attention_grad.py)
    moe                         a twin on the routing the kernel chose (the choice itself is
                                piecewise constant): softmax or DeepSeek's scores of the chosen
                                experts, each chosen expert's SwiGLU, in float32

The backward is not batch invariant (torch picks matmul kernels by shape): a gradient's bits
may depend on its batch-mates, its value is correct to rounding. Not a
`PooledLinearAttentionOps`: Gated DeltaNet layers run one sequence after another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lockstep.ops.base import AttentionInput, AttentionMeta, ComposedLatentInput, LayerKV, Ops
from lockstep.ops.fp8 import Fp8Weight
from lockstep.ops.moe import MoeLayer, Routing, prepare_expert_weights
from lockstep.ops.torch_stock import stock_gated_delta_rule
from lockstep.training import functions as fn
from lockstep.training.attention_grad import BLOCK, blocked_attention_grads
from lockstep.training.functions import PreparedAttention, Tensors, TwinBackward, wide
from lockstep.training.sdpa_grad import fused_attention_grads


@dataclass(frozen=True)
class _Written:
    """What `attention_input` or `write_latent` put in a cache, differentiably: the rows it
    came from and how (the layer's inputs and the positions)."""

    rows: torch.Tensor
    layer: AttentionInput | None
    positions: torch.Tensor
    slots: torch.Tensor | None = None  # `attention_input`'s cache slots of the rows


class DifferentiableOps(ComposedLatentInput):
    """`Ops` whose outputs are `base`'s, bit for bit, and carry gradients (module docstring).
    One instance serves one forward at a time: a cache write is paired with the attention
    that reads it (by the cache's storage) within a layer. MLA's `write_latent_row` and
    `latent_query` are composed (`ComposedLatentInput`) from this class's `rope` and
    `write_latent`, so gradients flow through the RoPE twin; a fused base gives the same
    bits (their contract)."""

    def __init__(self, base: Ops, block: int = BLOCK, seq_lens: list[int] | None = None) -> None:
        """`seq_lens`: the forward's sequence lengths, where the caller knows them on the host
        (the training module's packed step of cold sequences); else each attention reads
        them from its metadata on the device (a synchronization per layer)."""
        self.base = base
        self.name = f"differentiable {base.name}"
        self.deterministic = base.deterministic
        self.block = block
        self.seq_lens = seq_lens
        self._written: dict[int, _Written] = {}

    # ---------------------------------------------------------------- dense
    def prepare_linear_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight itself: `linear` prepares it for the backend on each call."""
        return weight

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return fn.linear(self.base, x, weight, bias)

    def partial_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return fn.partial_linear(self.base, x, weight)

    def fp8_linear(
        self, x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        raise NotImplementedError("FP8 linears are not trainable (refused at load)")

    def prepare_fp8_linear(
        self,
        scheme: str,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        input_scale: torch.Tensor | None,
    ) -> Fp8Weight:
        raise NotImplementedError("FP8 linears are not trainable (refused at load)")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return fn.rms_norm(self.base, x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return fn.add_rms_norm(self.base, x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return fn.silu_mul(self.base, gate_up)

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        return fn.log_softmax(self.base, logits)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        def twin(gate_up: torch.Tensor) -> Tensors:
            gate, up = wide(gate_up).chunk(2, dim=-1)
            return (F.gelu(gate, approximate="tanh") * up,)

        return self._twin(lambda t: (self.base.gelu_tanh_mul(t),), twin, gate_up)

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        def twin(x: torch.Tensor) -> Tensors:
            return (torch.tanh(wide(x) / cap) * cap,)

        return self._twin(lambda t: (self.base.softcap(t, cap),), twin, x)

    def gate_activation(self, x: torch.Tensor, gate: torch.Tensor, kind: str) -> torch.Tensor:
        def twin(x: torch.Tensor, gate: torch.Tensor) -> Tensors:
            g = wide(gate)
            act = torch.sigmoid(g) if kind == "sigmoid" else F.silu(g)
            return (wide(x) * act,)

        return self._twin(lambda a, b: (self.base.gate_activation(a, b, kind),), twin, x, gate)

    # ---------------------------------------------------------------- attention
    def rope(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        def twin(x: torch.Tensor) -> Tensors:
            return (fn.rope_twin(wide(x), positions.long(), cos, sin),)

        return self._twin(lambda t: (self.base.rope(t, positions, cos, sin),), twin, x)

    def attention_input(
        self,
        qkv: torch.Tensor,
        layer: AttentionInput,
        positions: torch.Tensor,
        slots: torch.Tensor,
        kv: LayerKV,
    ) -> torch.Tensor:
        """The backend's own K/V write and q (no gradient of its own: `attention` takes it
        from the rows kept here)."""
        with torch.no_grad():
            q = self.base.attention_input(qkv.detach(), _detached(layer), positions, slots, kv)
        self._written[kv.k.data_ptr()] = _Written(qkv, layer, positions, slots)
        return q

    def attention(
        self,
        q: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMeta,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        written = self._written.pop(kv.k.data_ptr())
        layer = written.layer
        assert layer is not None
        t, hq = q.shape[0], layer.num_heads
        hkv, d = kv.k.shape[1], kv.k.shape[2]
        kv_dtype, positions = kv.k.dtype, written.positions.long()
        seq_lens = self._cold_lengths(meta)
        if (
            window is None
            and q.device.type in fn.FUSED_ROW_GRAD_DEVICES
            and (layer.q_norm is None) == (layer.k_norm is None)
        ):
            return self._attention_fused_input_grad(q, kv, meta, scale, written, seq_lens)

        def prepare(qkv: torch.Tensor, qn: torch.Tensor | None, kn: torch.Tensor | None) -> Tensors:
            """q [T, Hq, D], k, v [T, Hkv, D] as the attention read them, in plain torch."""
            q, k, v = wide(qkv).split([hq * d, hkv * d, hkv * d], dim=1)
            q, k, v = q.reshape(t, hq, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d)
            if qn is not None and kn is not None:
                q, k = fn.rms_twin(q, qn, layer.eps), fn.rms_twin(k, kn, layer.eps)
            q = _rotate_twin(q, positions, layer)
            k = fn.straight_through(_rotate_twin(k, positions, layer), kv_dtype)
            return q, k, fn.straight_through(v, kv_dtype)

        def grads(qw: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> Tensors:
            if window is None:  # torch's fused attention backward, in the kernel's q dtype
                return fused_attention_grads(qw, k, v, g, seq_lens, scale, q.dtype)
            return blocked_attention_grads(qw, k, v, g, seq_lens, scale, self.block, window)

        return PreparedAttention.apply(
            lambda: self.base.attention(q, kv, meta, scale, window), prepare, grads,
            written.rows, layer.q_norm, layer.k_norm,
        )  # fmt: skip

    def _attention_fused_input_grad(
        self, q: torch.Tensor, kv: LayerKV, meta: AttentionMeta, scale: float,
        written: _Written, seq_lens: list[int],
    ) -> torch.Tensor:  # fmt: skip
        """`attention` whose backward takes the attention's gradient at what the kernel read
        (its q, the K/V rows the cache holds: nothing recomputed) and the input preparation's
        gradient (head norms, RoPE, the cache's rounding) by one fused kernel per q and k
        (ops/triton/attention_input_grad.py), in place of the float32 twin."""
        from lockstep.ops.triton.attention_input_grad import attention_input_backward

        layer = written.layer
        assert layer is not None and written.slots is not None
        t, hq, d = q.shape[0], layer.num_heads, kv.k.shape[2]
        slots = written.slots.long()
        keys, values = kv.k.index_select(0, slots), kv.v.index_select(0, slots)

        def grads(grad: torch.Tensor, qkv: torch.Tensor, qn: torch.Tensor | None,
                  kn: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> Tensors:  # fmt: skip
            dq, dk, dv = fused_attention_grads(q.reshape(t, hq, d), k, v, grad.reshape(t, hq, d),
                                               seq_lens, scale, q.dtype)  # fmt: skip
            d_qkv, d_qn, d_kn = attention_input_backward(
                qkv, dq, dk, dv, qn, kn, layer.eps, written.positions, layer.cos, layer.sin
            )
            return d_qkv, d_qn, d_kn, None, None, None

        return fn.ClosedFormBackward.apply(
            lambda: self.base.attention(q, kv, meta, scale, None), grads,
            written.rows, layer.q_norm, layer.k_norm, q.detach(), keys, values,
        )  # fmt: skip

    def write_latent(self, cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """The backend's own write of MLA's cache rows; `latent_attention` differentiates
        through the rows kept here."""
        with torch.no_grad():
            self.base.write_latent(cache, rows.detach(), slots)
        self._written[cache.data_ptr()] = _Written(rows, None, slots)

    def latent_width_refusal(self, latent: int, rope: int) -> str | None:
        return self.base.latent_width_refusal(latent, rope)

    def grouped_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """One differentiable `linear` per group: the base's `grouped_linear` bits (its
        contract: each group's rows are its `linear`'s)."""
        return torch.stack(
            [self.linear(x[:, g].contiguous(), weight[g]) for g in range(x.shape[1])], 1
        )

    def latent_attention(
        self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMeta, scale: float,
        value_dim: int,
    ) -> torch.Tensor:  # fmt: skip
        written = self._written.pop(cache.data_ptr())
        seq_lens, cache_dtype = self._cold_lengths(meta), cache.dtype

        def prepare(q: torch.Tensor, rows: torch.Tensor) -> Tensors:
            """The query and the cache rows as keys [T, 1, W] and values (their first
            `value_dim` columns)."""
            keys = fn.straight_through(wide(rows), cache_dtype).unsqueeze(1)
            return wide(q), keys, keys[..., :value_dim]

        def grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> Tensors:
            return blocked_attention_grads(q, k, v, g, seq_lens, scale, self.block)

        return PreparedAttention.apply(
            lambda: self.base.latent_attention(q.detach(), cache, meta, scale, value_dim),
            prepare, grads, q, written.rows,
        )  # fmt: skip

    # ---------------------------------------------------------------- Gated DeltaNet
    def gdn_gates(
        self, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        def twin(
            a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt: torch.Tensor
        ) -> Tensors:
            g = -wide(a_log).exp() * F.softplus(wide(a) + wide(dt))
            return g, torch.sigmoid(wide(b))

        g, beta = TwinBackward.apply(self.base.gdn_gates, twin, a, b, a_log, dt_bias)
        return g, beta

    def l2_normalize(self, x: torch.Tensor, eps: float, scale: float) -> torch.Tensor:
        def twin(x: torch.Tensor) -> Tensors:
            x = wide(x)
            return (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps) * scale,)

        return self._twin(lambda t: (self.base.l2_normalize(t, eps, scale),), twin, x)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return self._twin(lambda t: (self.base.silu(t),), lambda t: (F.silu(wide(t)),), x)

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
        """The backend's rule continuing `state` in place; the boundary states it reports
        carry no gradient. Training sequences start cold (start 0, a zero state), which the
        twin assumes."""
        if start != 0:
            raise ValueError(f"start={start}: a training sequence starts at position 0")
        chunk = open_k.shape[0]
        boundaries: list[list[tuple[int, torch.Tensor]]] = []

        def kernel(*inputs: torch.Tensor) -> Tensors:
            out, crossed = self.base.gated_delta_rule(
                *inputs, state, open_k, open_gamma, open_u, start
            )
            boundaries.append(crossed)
            return (out,)

        def twin(*inputs: torch.Tensor) -> Tensors:
            q, k, v, g, beta = (wide(t) for t in inputs)
            zero = torch.zeros(state.shape, dtype=q.dtype, device=q.device)
            return (stock_gated_delta_rule(q, k, v, g, beta, zero, chunk)[0],)

        (out,) = TwinBackward.apply(kernel, twin, q, k, v, g, beta)
        return out, boundaries[0]

    # ---------------------------------------------------------------- MoE
    def moe(
        self, x: torch.Tensor, layer: MoeLayer, routed_experts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The backend's routed experts on the layer's weights prepared for it; backward
        through a twin on the experts the backend chose (module docstring). `routed_experts`:
        the [T, top_k] buffer the backend writes the ids it routed by into (`Ops.moe`)."""
        if layer.fp8:
            raise NotImplementedError("FP8 experts are not trainable (refused at load)")
        base, prepare = self.base, self.base.prepare_linear_weight
        top_k, renormalize, deepseek = layer.top_k, layer.renormalize, layer.deepseek

        def prepared(router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> MoeLayer:
            return MoeLayer(prepare(router.contiguous()), prepare_expert_weights(prepare, gate_up),
                            prepare_expert_weights(prepare, down), top_k, renormalize,
                            deepseek=deepseek)  # fmt: skip

        def kernel(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor) -> Tensors:  # fmt: skip
            layer = prepared(router, gate_up, down)
            if routed_experts is None:
                return (base.moe(x, layer),)
            return (base.moe(x, layer, routed_experts),)

        def twin(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor) -> Tensors:  # fmt: skip
            with torch.no_grad():
                chosen = self._routing(x.detach(), prepared(router.detach(), gate_up, down))
            xw = wide(x)
            scores = xw @ wide(router).T
            if deepseek is not None:
                probs = scores.sigmoid() if deepseek.scoring == "sigmoid" else scores.softmax(-1)
                weights = probs.gather(1, chosen)
                if renormalize:
                    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
                weights = weights * deepseek.routed_scaling
            elif renormalize:
                weights = scores.gather(1, chosen).softmax(-1)
            else:
                weights = scores.softmax(-1).gather(1, chosen)
            width = gate_up.shape[1] // 2
            out = torch.zeros_like(xw)
            for e in chosen.unique().tolist():
                rows, ranks = (chosen == e).nonzero(as_tuple=True)
                h = xw[rows]
                gate, up = wide(gate_up[e]).split(width)
                y = (F.silu(h @ gate.T) * (h @ up.T)) @ wide(down[e]).T
                out = out.index_add(0, rows, weights[rows, ranks, None] * y)
            return (out,)

        return self._twin(kernel, twin, x, layer.router, layer.gate_up, layer.down)

    def _routing(self, x: torch.Tensor, layer: MoeLayer) -> torch.Tensor:
        """Each token's experts [T, k] in rank order as the backend chooses them: the router
        logits by its float32 linear, then DeepSeek's routing by the backend's own, or the
        top_k by a stable descending sort (ties toward the lower id, the contract's rule)."""
        logits = self.base.partial_linear(x.contiguous(), layer.router).float()
        if layer.deepseek is not None:
            routing: Routing = self.base.route_deepseek(logits, layer)  # type: ignore[attr-defined]
            return routing.experts
        return torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, : layer.top_k]

    def _cold_lengths(self, meta: AttentionMeta) -> list[int]:
        """Each sequence's row count: `seq_lens` where given, else from `meta`."""
        return _cold_lengths(meta) if self.seq_lens is None else self.seq_lens

    @staticmethod
    def _twin(kernel: Any, twin: Any, *inputs: torch.Tensor | None) -> torch.Tensor:
        return TwinBackward.apply(kernel, twin, *inputs)[0]


def _detached(layer: AttentionInput) -> AttentionInput:
    """`layer` with its norms detached (the kernel's call needs no graph)."""
    qn, kn = (None if t is None else t.detach() for t in (layer.q_norm, layer.k_norm))
    return AttentionInput(layer.num_heads, qn, kn, layer.eps, layer.cos, layer.sin)


def _cold_lengths(meta: AttentionMeta) -> list[int]:
    """Each sequence's row count, for a step of cold sequences (each from position 0, its
    keys its own rows: how the training module lays out a packed batch)."""
    if bool(meta.q_start.any()):
        raise ValueError("a training step holds cold sequences only (every q_start 0)")
    return meta.cu_q.diff().tolist()


def _rotate_twin(x: torch.Tensor, positions: torch.Tensor, layer: AttentionInput) -> torch.Tensor:
    """RoPE on each head's first 2 * cos.shape[1] dims (partial rotary: the rest pass
    through), as `ComposedAttentionInput._rotate` and the GPU's fused kernel apply it."""
    rot = 2 * layer.cos.shape[1]
    turned = fn.rope_twin(x[..., :rot], positions, layer.cos, layer.sin)
    return turned if rot == x.shape[-1] else torch.cat([turned, x[..., rot:]], dim=-1)
