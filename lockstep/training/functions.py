"""Autograd Functions whose forward is the engine's own op (an `Ops` backend, lockstep.ops) and
whose backward is a correct gradient computed with plain torch.

Forward: each Function calls exactly the backend method the engine's decoder calls, on inputs
prepared exactly as the decoder prepares them (lockstep/models/decoder.py), so every output
has the engine's bits. The deterministic backends are batch invariant (a row's bits depend
only on its own row and, for attention, its own sequence's earlier keys), so a packed
training batch gives each sequence the bits of the engine's cold prefill of it.

Backward: plain torch, never the engine's kernels. `linear` has its closed-form gradient by
matmuls in the wider of its input's and weight's dtypes (float32 on the CPU, bfloat16 with
float32 accumulation for a bfloat16 model on CUDA), `log_softmax` its closed form in float32;
the row ops recompute a plain-torch twin of their formula in float32 (float64 stays) from the
saved inputs and differentiate it (`_TwinBackward`): the twin is the same function the
kernel computes up to rounding, so its gradient at the kernel's inputs is the kernel's
gradient. Attention recomputes its q/k/v preparation the same way and takes the attention's
own gradient blockwise (lockstep/training/attention_grad.py), never holding [n, n] scores.
The backward is NOT batch invariant: torch's matmul picks its kernels by shape, so a row's
gradient bits may depend on its batch-mates (its value is correct to rounding). Gradients of
values the forward rounds (float32 K/V written to a bfloat16 cache) pass straight through the
rounding. Qwen3-MoE's routed experts: `moe`, a twin on the routing the kernel chose.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from lockstep.ops.base import AttentionInput, AttentionMeta, LayerKV, Ops
from lockstep.ops.moe import MoeLayer, prepare_expert_weights
from lockstep.training.attention_grad import BLOCK, blocked_attention_grads

Tensors = tuple[torch.Tensor | None, ...]


def _wide(t: torch.Tensor) -> torch.Tensor:
    """The dtype backward math runs in: float64 stays, everything else becomes float32."""
    return t if t.dtype == torch.float64 else t.float()


class _Linear(torch.autograd.Function):
    """x [M, K] @ weight.T (+ bias) by `ops.linear` on `ops.prepare_linear_weight(weight)`."""

    @staticmethod
    def forward(
        ctx: Any,
        ops: Ops,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        partial: bool,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        prepared = ops.prepare_linear_weight(weight.contiguous())
        if partial:
            return ops.partial_linear(x.contiguous(), prepared)
        return ops.linear(x, prepared, bias)

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[None, torch.Tensor, torch.Tensor, Any, None]:
        x, weight = ctx.saved_tensors
        # The matmuls run in the wider of x's and the weight's dtypes: float32 on the CPU
        # (float32 activations), bfloat16 inputs with float32 accumulation for a bfloat16
        # model on CUDA (as transformers' backward runs), never a float32 copy of a bf16
        # weight there.
        dtype = torch.promote_types(x.dtype, weight.dtype)
        g = grad.to(dtype)
        grad_x = (g @ weight.to(dtype)).to(x.dtype)
        grad_w = (g.T @ x.to(dtype)).to(weight.dtype)
        grad_b = _wide(grad).sum(0) if ctx.has_bias else None
        return None, grad_x, grad_w, grad_b, None


def linear(
    ops: Ops, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The engine's linear (x [M, K], weight [N, K] in any dtype the backend takes, bias
    float32 [N]); the gradient reaches x, weight and bias."""
    return _Linear.apply(ops, x, weight, bias, False)


def partial_linear(ops: Ops, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The engine's `partial_linear`: x @ weight.T in float32, not rounded to x's dtype (one
    reduction chunk of a row-parallel linear)."""
    return _Linear.apply(ops, x, weight, None, True)


class _LogSoftmax(torch.autograd.Function):
    """float32 log-probabilities of logits [R, V] by `ops.log_softmax`, one row at a time."""

    @staticmethod
    def forward(ctx: Any, ops: Ops, logits: torch.Tensor) -> torch.Tensor:
        out = ops.log_softmax(logits)
        ctx.save_for_backward(out)
        ctx.logits_dtype = logits.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        (out,) = ctx.saved_tensors
        g = _wide(grad)
        grad_in = g - out.exp() * g.sum(-1, keepdim=True)
        return None, grad_in.to(ctx.logits_dtype)


def log_softmax(ops: Ops, logits: torch.Tensor) -> torch.Tensor:
    """The engine's log-softmax (what the sampler reports and `LLM.score` returns)."""
    return _LogSoftmax.apply(ops, logits)


class _TwinBackward(torch.autograd.Function):
    """`kernel(*inputs)` forward; backward by autograd through `twin(*inputs)`, a plain-torch
    computation of the same formula (its outputs in the same order and shapes, in the
    kernel's dtype or a wider one). Inputs may be None; only floating tensors receive
    gradients."""

    @staticmethod
    def forward(
        ctx: Any,
        kernel: Callable[..., Tensors],
        twin: Callable[..., Tensors],
        *inputs: torch.Tensor | None,
    ) -> Tensors:
        ctx.twin = twin
        ctx.none = [t is None for t in inputs]
        ctx.save_for_backward(*[t for t in inputs if t is not None])
        return kernel(*inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        saved = iter(ctx.saved_tensors)
        inputs = [None if none else next(saved) for none in ctx.none]
        leaves = [
            None if t is None or not t.is_floating_point() else t.detach().requires_grad_()
            for t in inputs
        ]
        args = [leaf if leaf is not None else t for leaf, t in zip(leaves, inputs, strict=True)]
        with torch.enable_grad():
            outs = ctx.twin(*args)
        pairs = [
            (o, g) for o, g in zip(outs, grads, strict=True) if g is not None and o is not None
        ]
        wanted = [leaf for leaf in leaves if leaf is not None]
        # A twin may compute in a wider dtype than the kernel returns (the MoE's float32).
        found = torch.autograd.grad(
            [o for o, _ in pairs], wanted, [g.to(o.dtype) for o, g in pairs], allow_unused=True
        )
        by_leaf = iter(found)
        return (None, None, *(None if leaf is None else next(by_leaf) for leaf in leaves))


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = _wide(x)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * _wide(weight)


def rms_norm(ops: Ops, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The engine's RMSNorm of x [M, H] with a float32 weight [H]."""

    def kernel(x: torch.Tensor, w: torch.Tensor) -> Tensors:
        return (ops.rms_norm(x, w, eps),)

    def twin(x: torch.Tensor, w: torch.Tensor) -> Tensors:
        return (_rms(x, w, eps).to(x.dtype),)

    return _TwinBackward.apply(kernel, twin, x, weight)[0]


def add_rms_norm(
    ops: Ops, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's fused residual add and RMSNorm: (rms_norm(x + residual), x + residual)."""

    def kernel(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> Tensors:
        return ops.add_rms_norm(x, r, w, eps)

    def twin(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> Tensors:
        summed = _wide(x) + _wide(r)
        return _rms(summed, w, eps).to(x.dtype), summed.to(x.dtype)

    normed, summed = _TwinBackward.apply(kernel, twin, x, residual, weight)
    return normed, summed


def silu_mul(ops: Ops, gate_up: torch.Tensor) -> torch.Tensor:
    """The engine's SwiGLU activation: gate_up [M, 2I] (gate first) -> silu(gate) * up."""

    def kernel(gate_up: torch.Tensor) -> Tensors:
        return (ops.silu_mul(gate_up),)

    def twin(gate_up: torch.Tensor) -> Tensors:
        gate, up = _wide(gate_up).chunk(2, dim=-1)
        return (F.silu(gate) * up,)

    return _TwinBackward.apply(kernel, twin, gate_up)[0]


def _rope_twin(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Neox RoPE (rotate_half) of x [T, H, D] at `positions`, from float32 tables [P, D/2]."""
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _straight_through(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to `dtype` and back, with the rounding's derivative taken as 1."""
    return x + (x.to(dtype).to(x.dtype) - x).detach()


class _CausalAttention(torch.autograd.Function):
    """`causal_attention`'s kernel forward; backward: the q/k/v preparation (head norms, RoPE,
    the cache's rounding) recomputed in torch from the saved inputs and differentiated by
    autograd, the attention itself by `blocked_attention_grads` (no [n, n] scores)."""

    @staticmethod
    def forward(
        ctx: Any,
        kernel: Callable[..., torch.Tensor],
        prepare: Callable[..., Tensors],
        attention_grads: Callable[..., Tensors],
        qkv: torch.Tensor,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.prepare, ctx.attention_grads = prepare, attention_grads
        ctx.save_for_backward(qkv, q_norm, k_norm)
        return kernel(qkv, q_norm, k_norm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors
        leaves = [None if t is None else t.detach().requires_grad_() for t in saved]
        with torch.enable_grad():
            q, k, v = ctx.prepare(*leaves)
        dq, dk, dv = ctx.attention_grads(q.detach(), k.detach(), v.detach(), grad)
        wanted = [leaf for leaf in leaves if leaf is not None]
        found = iter(torch.autograd.grad([q, k, v], wanted, [dq, dk, dv], allow_unused=True))
        return (None, None, None, *(None if leaf is None else next(found) for leaf in leaves))


def causal_attention(
    ops: Ops,
    qkv: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    layer: AttentionInput,
    positions: torch.Tensor,
    meta: AttentionMeta,
    seq_lens: Sequence[int],
    kv_dtype: torch.dtype,
    scale: float,
    block: int = BLOCK,
) -> torch.Tensor:
    """One attention layer of a packed batch, from the fused projection rows qkv [T, (Hq + 2
    Hkv) D] to the attention output [T, Hq D], exactly as the engine computes it: q/k head
    norms, RoPE and the K/V writes by `ops.attention_input` into a scratch cache of `kv_dtype`
    whose slot j is row j, then `ops.attention` over `meta` (each sequence's keys are its own
    rows). `layer` carries the head count, eps and RoPE tables (its q/k norms are replaced by
    the differentiable `q_norm`, `k_norm`, float32 [D] or None). The backward holds at most
    one [Hq, block, block] tile of scores per query tile (lockstep/training/attention_grad.py)."""
    t = qkv.shape[0]
    hq, d = layer.num_heads, layer.cos.shape[1] * 2
    hkv = (qkv.shape[1] // d - hq) // 2
    slots = torch.arange(t, device=qkv.device)

    def kernel(qkv: torch.Tensor, qn: torch.Tensor | None, kn: torch.Tensor | None) -> torch.Tensor:
        cache = LayerKV(
            torch.zeros(t, hkv, d, dtype=kv_dtype, device=qkv.device),
            torch.zeros(t, hkv, d, dtype=kv_dtype, device=qkv.device),
        )
        step_layer = AttentionInput(hq, qn, kn, layer.eps, layer.cos, layer.sin)
        q = ops.attention_input(qkv, step_layer, positions, slots, cache)
        return ops.attention(q, cache, meta, scale).reshape(t, hq * d)

    def prepare(qkv: torch.Tensor, qn: torch.Tensor | None, kn: torch.Tensor | None) -> Tensors:
        """q [T, Hq, D], k, v [T, Hkv, D] as attention reads them, in plain torch."""
        q, k, v = _wide(qkv).split([hq * d, hkv * d, hkv * d], dim=1)
        q, k, v = q.reshape(t, hq, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d)
        if qn is not None and kn is not None:
            q, k = _rms(q, qn, layer.eps), _rms(k, kn, layer.eps)
        q = _rope_twin(q, positions, layer.cos, layer.sin)
        k = _straight_through(_rope_twin(k, positions, layer.cos, layer.sin), kv_dtype)
        return q, k, _straight_through(v, kv_dtype)

    def attention_grads(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor
    ) -> Tensors:
        # The output's rounding to qkv's dtype passes its gradient straight through.
        return blocked_attention_grads(q, k, v, grad.reshape(t, hq, d), seq_lens, scale, block)

    return _CausalAttention.apply(kernel, prepare, attention_grads, qkv, q_norm, k_norm)


def moe(
    ops: Ops,
    x: torch.Tensor,
    router: torch.Tensor,
    experts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    top_k: int,
    renormalize: bool,
    routed_experts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The engine's routed-experts MLP (`ops.moe`, contract in lockstep/ops/moe.py) of x [T, H]
    with the router [E, H] and each expert's (gate [I, H], up [I, H], down [H, I]) weights,
    stacked into the `MoeLayer` layout the decoder loads (gate | up rows per expert). Output
    in the backend's MoE dtype (float32 on the CPU, x's on CUDA).

    Backward through a torch twin on the routing the kernel chose: the router logits by the
    backend's float32 linear (`partial_linear`, the kernel's logits bit for bit), each token's
    top_k by a stable descending sort (ties toward the lower expert id, as the kernel breaks
    them); then, differentiably in float32, the softmax weights of those experts (over the k
    when `renormalize`, else over all E) and each chosen expert's SwiGLU. The choice itself
    has no gradient (it is piecewise constant in the logits).

    `routed_experts`: an integer tensor [T, top_k] the kernel overwrites with the experts it
    routed each token to (`Ops.moe`'s buffer: what the engine's routing store keeps)."""
    count = len(experts)
    flat = [w for weights in experts for w in weights]

    def kernel(x: torch.Tensor, router: torch.Tensor, *ws: torch.Tensor) -> Tensors:
        prepare = ops.prepare_linear_weight
        gate_up = torch.stack([torch.cat(ws[3 * e : 3 * e + 2]) for e in range(count)])
        down = torch.stack(ws[2::3])
        layer = MoeLayer(prepare(router.contiguous()), prepare_expert_weights(prepare, gate_up),
                         prepare_expert_weights(prepare, down), top_k, renormalize)  # fmt: skip
        if routed_experts is None:
            return (ops.moe(x, layer),)
        return (ops.moe(x, layer, routed_experts),)

    def twin(x: torch.Tensor, router: torch.Tensor, *ws: torch.Tensor) -> Tensors:
        with torch.no_grad():
            prepared = ops.prepare_linear_weight(router.detach().contiguous())
            logits = ops.partial_linear(x.detach().contiguous(), prepared).float()
            chosen = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]
        xw = _wide(x)
        scores = xw @ _wide(router).T
        if renormalize:
            weights = scores.gather(1, chosen).softmax(-1)
        else:
            weights = scores.softmax(-1).gather(1, chosen)
        out = torch.zeros_like(xw)
        for e in chosen.unique().tolist():
            rows, ranks = (chosen == e).nonzero(as_tuple=True)
            h = xw[rows]
            gate, up, down = (_wide(w) for w in ws[3 * e : 3 * e + 3])
            y = (F.silu(h @ gate.T) * (h @ up.T)) @ down.T
            out = out.index_add(0, rows, weights[rows, ranks, None] * y)
        return (out,)

    return _TwinBackward.apply(kernel, twin, x, router, *flat)[0]
