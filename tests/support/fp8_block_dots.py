"""The FP8 GEMM's reference with each K block's dot as the hardware computes it.

`lockstep.ops.fp8` defines y[m, n] = sum over K blocks b of (sx * sw) * dot_b + bias, and its
float64 reference computes each dot_b exactly. Hopper's tensor cores do not: they sum FP8
products with reduced precision (errors of a few 1e-3 of the products' magnitude). cuBLAS's FP8
GEMM (`torch._scaled_mm`, unit scales, fp32 out) and the Triton kernel's wgmma gave the same
bits for every block dot on an H200 (docs/results.md, "FP8 GEMM"). So on CUDA each block's dot here
is cuBLAS's, elsewhere (the Triton interpreter, whose block dots are exact) the exact one; the
quantization (the spec's functions), scales, the sum over blocks and the bias are float64.
Against this reference the kernel's only error is its own fp32 arithmetic, which `tolerance`
bounds tightly.
"""

from __future__ import annotations

import torch

from lockstep.ops import fp8


def _block_dot(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a [M, k], w [N, k] e4m3 -> [M, N] float64: cuBLAS's fp32 dot on CUDA, else exact."""
    if not a.is_cuda:
        return a.double() @ w.double().T

    # cuBLAS's FP8 GEMM wants every dimension a multiple of 16: zero rows and columns are
    # appended (their products are exact zeros) and the result cut back.
    def padded(t: torch.Tensor) -> torch.Tensor:
        rows, cols = (-(-d // 16) * 16 for d in t.shape)
        out = torch.zeros(rows, cols, device=t.device).to(fp8.E4M3)
        out[: t.shape[0], : t.shape[1]] = t
        return out

    one = torch.ones(1, device=a.device)
    dot = torch._scaled_mm(padded(a), padded(w).T, scale_a=one, scale_b=one,
                           out_dtype=torch.float32)  # fmt: skip
    return dot[: a.shape[0], : w.shape[0]].double()


def block_dots_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    scheme: str,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype), weight e4m3 [N, K] and its scales, on one device ->
    (y float64 [M, N], magnitude float64 [M, N]: the sum of |each block's term| and |bias|,
    the size that fp32 rounding errors scale with)."""
    m, k = x.shape
    n = weight.shape[0]
    if scheme == "tensor":
        q, sx = fp8.quantize_static(x, input_scale), input_scale.reshape(1).expand(m, 1)
    else:
        q, sx = fp8.quantize_rows(x, fp8.activation_group(scheme, k))
    y = torch.zeros(m, n, dtype=torch.float64, device=x.device)
    size = torch.zeros_like(y)
    for b, start in enumerate(range(0, k, fp8.BLOCK)):
        cols = slice(start, min(start + fp8.BLOCK, k))
        dot = _block_dot(q[:, cols].contiguous(), weight[:, cols].contiguous())
        if scheme == "block":
            s_x = sx[:, b]
            s_w = weight_scale[:, b].repeat_interleave(fp8.BLOCK)[:n]
        else:
            s_x, s_w = sx[:, 0], weight_scale
        term = dot * (s_x.double()[:, None] * s_w.double()[None, :])
        y += term
        size += term.abs()
    if bias is not None:
        y += bias.double()
        size += bias.double().abs()
    return y, size


def tolerance(
    size: torch.Tensor, ref: torch.Tensor, k: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """Bound on |kernel - block_dots_reference| per element for an output of `out_dtype`: per K
    block four fp32 roundings of at most 2**-24 of `size` (the dot's to fp32 where the
    reference's is exact, sx * sw, times the dot, the add), one for the bias add, then the cast
    to the output dtype: one ulp (its eps, relative), since the interpreter's bfloat16 cast
    truncates where the GPU's rounds to nearest."""
    blocks = -(-k // fp8.BLOCK)
    fp32 = (4 * blocks + 1) * 2.0**-24 * size
    return fp32 + torch.finfo(out_dtype).eps * (ref.abs() + fp32)
