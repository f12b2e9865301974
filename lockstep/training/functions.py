"""The autograd Functions behind `DifferentiableOps` (lockstep/training/differentiable_ops.py):
forward by the engine's own op (an `Ops` backend, lockstep.ops), backward by a correct
gradient computed with plain torch.

Forward: each Function calls exactly the backend method the engine's decoder calls, on the
inputs the decoder's blocks pass, so every output has the engine's bits. The deterministic
backends are batch invariant (a row's bits depend only on its own row and, for attention, its
own sequence's earlier keys), so a packed training batch gives each sequence the bits of the
engine's cold prefill of it.

Backward: plain torch, never the engine's kernels. `linear` has its closed-form gradient by
matmuls in the wider of its input's and weight's dtypes (float32 on the CPU, bfloat16 with
float32 accumulation for a bfloat16 model on CUDA), `log_softmax` its closed form in float32;
the row ops recompute a plain-torch twin of their formula in float32 (float64 stays) from the
saved inputs and differentiate it (`TwinBackward`): the twin is the same function the
kernel computes up to rounding, so its gradient at the kernel's inputs is the kernel's
gradient. On CUDA, RMSNorm (with its residual add) and SiLU-mul take their closed forms in
one fused Triton kernel each instead (lockstep/ops/triton/row_grads.py). Attention
(`PreparedAttention`) recomputes its q/k/v preparation the same way and takes the attention's
own gradient by torch's fused attention backward (lockstep/training/sdpa_grad.py) or, with a
sliding window, blockwise (lockstep/training/attention_grad.py), never holding [n, n]
scores. The backward is NOT batch invariant: torch's matmul picks its kernels
by shape, so a row's gradient bits may depend on its batch-mates (its value is correct to
rounding). Gradients of values the forward rounds (float32 K/V written to a bfloat16 cache)
pass straight through the rounding (`straight_through`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from lockstep.ops.base import Ops

Tensors = tuple[torch.Tensor | None, ...]


def wide(t: torch.Tensor) -> torch.Tensor:
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
        grad_b = wide(grad).sum(0) if ctx.has_bias else None
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
        g = wide(grad)
        grad_in = g - out.exp() * g.sum(-1, keepdim=True)
        return None, grad_in.to(ctx.logits_dtype)


def log_softmax(ops: Ops, logits: torch.Tensor) -> torch.Tensor:
    """The engine's log-softmax (what the sampler reports and `LLM.score` returns)."""
    return _LogSoftmax.apply(ops, logits)


def _save_optional(ctx: Any, inputs: tuple[torch.Tensor | None, ...]) -> None:
    """Save a Function's inputs for backward, None among them (save_for_backward takes
    tensors only)."""
    ctx.none = [t is None for t in inputs]
    ctx.save_for_backward(*[t for t in inputs if t is not None])


def _saved_optional(ctx: Any) -> list[torch.Tensor | None]:
    """The inputs `_save_optional` saved, Nones in their places."""
    saved = iter(ctx.saved_tensors)
    return [None if none else next(saved) for none in ctx.none]


class TwinBackward(torch.autograd.Function):
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
        _save_optional(ctx, inputs)
        return kernel(*inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        inputs = _saved_optional(ctx)
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


# Devices whose RMSNorm and SiLU-mul backwards run the fused Triton kernels
# (lockstep/ops/triton/row_grads.py) instead of the float32 torch twins: CUDA, where the twins'
# float32 copies of every row cost most (tests add "cpu" to run the kernels under Triton's
# interpreter).
FUSED_ROW_GRAD_DEVICES: tuple[str, ...] = ("cuda",)


class _FusedRmsNorm(torch.autograd.Function):
    """`ops.rms_norm` forward; backward by the fused kernel at the saved rows."""

    @staticmethod
    def forward(ctx: Any, ops: Ops, x: torch.Tensor, weight: torch.Tensor, eps: float) -> Any:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return ops.rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        from lockstep.ops.triton.row_grads import rms_norm_backward

        x, weight = ctx.saved_tensors
        dx, dw = rms_norm_backward(x, weight, ctx.eps, grad)
        return None, dx, dw.to(weight.dtype), None


class _FusedAddRmsNorm(torch.autograd.Function):
    """`ops.add_rms_norm` forward; backward by the fused kernel at the sum the kernel
    returned and normalized: x and the residual both receive the sum's gradient."""

    @staticmethod
    def forward(
        ctx: Any, ops: Ops, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
        eps: float,
    ) -> Any:  # fmt: skip
        normed, summed = ops.add_rms_norm(x, residual, weight, eps)
        ctx.save_for_backward(summed, weight)
        ctx.eps, ctx.dtypes = eps, (x.dtype, residual.dtype)
        ctx.set_materialize_grads(False)  # the last layer's sum has no use, hence no gradient
        return normed, summed

    @staticmethod
    def backward(
        ctx: Any, grad_normed: torch.Tensor | None, grad_summed: torch.Tensor | None
    ) -> tuple[Any, ...]:
        from lockstep.ops.triton.row_grads import rms_norm_backward

        summed, weight = ctx.saved_tensors
        if grad_normed is None:
            grad_normed = torch.zeros_like(summed)
        d_sum, dw = rms_norm_backward(summed, weight, ctx.eps, grad_normed, grad_summed)
        x_dtype, residual_dtype = ctx.dtypes
        return None, d_sum.to(x_dtype), d_sum.to(residual_dtype), dw.to(weight.dtype), None


class _FusedSiluMul(torch.autograd.Function):
    """`ops.silu_mul` forward; backward by the fused kernel at the saved gate|up rows."""

    @staticmethod
    def forward(ctx: Any, ops: Ops, gate_up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        return ops.silu_mul(gate_up)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        from lockstep.ops.triton.row_grads import silu_mul_backward

        (gate_up,) = ctx.saved_tensors
        return None, silu_mul_backward(gate_up, grad)


def rms_twin(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = wide(x)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * wide(weight)


def rms_norm(ops: Ops, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The engine's RMSNorm of x [M, H] with a float32 weight [H]."""
    if x.device.type in FUSED_ROW_GRAD_DEVICES and x.dim() == 2:
        return _FusedRmsNorm.apply(ops, x, weight, eps)

    def kernel(x: torch.Tensor, w: torch.Tensor) -> Tensors:
        return (ops.rms_norm(x, w, eps),)

    def twin(x: torch.Tensor, w: torch.Tensor) -> Tensors:
        return (rms_twin(x, w, eps).to(x.dtype),)

    return TwinBackward.apply(kernel, twin, x, weight)[0]


def add_rms_norm(
    ops: Ops, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's fused residual add and RMSNorm: (rms_norm(x + residual), x + residual)."""
    if x.device.type in FUSED_ROW_GRAD_DEVICES and x.dim() == 2:
        normed, summed = _FusedAddRmsNorm.apply(ops, x, residual, weight, eps)
        return normed, summed

    def kernel(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> Tensors:
        return ops.add_rms_norm(x, r, w, eps)

    def twin(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> Tensors:
        summed = wide(x) + wide(r)
        return rms_twin(summed, w, eps).to(x.dtype), summed.to(x.dtype)

    normed, summed = TwinBackward.apply(kernel, twin, x, residual, weight)
    return normed, summed


def silu_mul(ops: Ops, gate_up: torch.Tensor) -> torch.Tensor:
    """The engine's SwiGLU activation: gate_up [M, 2I] (gate first) -> silu(gate) * up."""
    if gate_up.device.type in FUSED_ROW_GRAD_DEVICES and gate_up.dim() == 2:
        return _FusedSiluMul.apply(ops, gate_up)

    def kernel(gate_up: torch.Tensor) -> Tensors:
        return (ops.silu_mul(gate_up),)

    def twin(gate_up: torch.Tensor) -> Tensors:
        gate, up = wide(gate_up).chunk(2, dim=-1)
        return (F.silu(gate) * up,)

    return TwinBackward.apply(kernel, twin, gate_up)[0]


def rope_twin(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Neox RoPE (rotate_half) of x [T, H, D] at `positions`, from float32 tables [P, D/2]."""
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def straight_through(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to `dtype` and back, with the rounding's derivative taken as 1."""
    return x + (x.to(dtype).to(x.dtype) - x).detach()


class ClosedFormBackward(torch.autograd.Function):
    """`kernel()` forward (it reads what the engine's ops wrote, not these inputs); backward
    `grads(grad, *inputs)`: each input's gradient in order (None where it has none), computed
    in closed form (the fused attention-input backward: ops/triton/attention_input_grad.py)."""

    @staticmethod
    def forward(
        ctx: Any,
        kernel: Callable[[], torch.Tensor],
        grads: Callable[..., Tensors],
        *inputs: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.grads = grads
        _save_optional(ctx, inputs)
        return kernel()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs = _saved_optional(ctx)
        return (None, None, *ctx.grads(grad, *inputs))


class PreparedAttention(torch.autograd.Function):
    """An attention kernel's forward (`kernel()`: it reads what the engine's ops wrote to the
    cache, not these inputs); backward: `prepare(*inputs)` recomputes in torch the q, k, v
    the kernel read (norms, RoPE, the cache's rounding) and is differentiated by autograd, the
    attention itself by `attention_grads(q, k, v, grad)` (blocked: no [n, n] scores)."""

    @staticmethod
    def forward(
        ctx: Any,
        kernel: Callable[[], torch.Tensor],
        prepare: Callable[..., Tensors],
        attention_grads: Callable[..., Tensors],
        *inputs: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.prepare, ctx.attention_grads = prepare, attention_grads
        _save_optional(ctx, inputs)
        return kernel()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs = _saved_optional(ctx)
        leaves = [None if t is None else t.detach().requires_grad_() for t in inputs]
        with torch.enable_grad():
            q, k, v = ctx.prepare(*leaves)
        dq, dk, dv = ctx.attention_grads(q.detach(), k.detach(), v.detach(), grad)
        wanted = [leaf for leaf in leaves if leaf is not None]
        found = iter(torch.autograd.grad([q, k, v], wanted, [dq, dk, dv], allow_unused=True))
        return (None, None, None, *(None if leaf is None else next(found) for leaf in leaves))
