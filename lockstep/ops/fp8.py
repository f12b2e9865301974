"""FP8 (e4m3) linears: the numeric specification every backend implements.

This module is the single source of truth for FP8 arithmetic in Lockstep. The CPU backends
call it; the GPU kernel (`lockstep/ops/triton/fp8_gemm.py`) must match it as stated below.

Formats
-------
e4m3 is `torch.float8_e4m3fn`: finite range +-448, no infinities. Every cast to e4m3 here is
"saturating round-to-nearest-even": clamp to [-448, 448] in fp32, then round to the nearest
e4m3 value, ties to even (torch's `.to(torch.float8_e4m3fn)` after the clamp; PTX
`cvt.rn.satfinite.e4m3x2.f32`, Triton's `.to(tl.float8e4nv)`).

Schemes (`SCHEMES`), for a linear y = x @ W.T + bias with W [N, K]:

  "block"   weight e4m3 [N, K]; weight_scale fp32 [ceil(N/128), ceil(K/128)] (a checkpoint's
            `weight_scale_inv`: W[n, k] ~= Wq[n, k] * weight_scale[n // 128, k // 128]).
            Activations: dynamic, per token and per 128-column group (`quantize_rows` with
            group 128). Qwen's and DeepSeek's FP8 releases (quant_method "fp8",
            weight_block_size [128, 128]).
  "tensor"  weight e4m3 [N, K]; weight_scale fp32 [N] (a checkpoint's scalar, broadcast; a
            fused projection keeps each part's own scalar on its rows); input_scale fp32
            scalar, static (from the checkpoint). ModelOpt quant_algo "FP8".
  "channel" weight e4m3 [N, K]; weight_scale fp32 [N]; activations dynamic per token (one
            scale per row: `quantize_rows` with group = K). compressed-tensors FP8 with
            per-channel weights and dynamic per-token activations ("FP8_DYNAMIC").

Dynamic per-TENSOR activation scales (one scale = the max over the whole batch) are not a
scheme here: a row's result would depend on its batch-mates, which breaks position invariance
by construction. Loaders refuse them with a message naming the per-token alternative.

Activation quantization (row-local; the GPU kernel must match these bits exactly)
-------------------------------------------------------------------------------
For x fp32 (bf16/fp16 inputs are widened exactly first), a row m and a group g of `group`
consecutive columns starting at column g*group (the last group may be shorter):

    amax  = max |x[m, k]| over the group                     (exact)
    scale = max(amax, AMAX_FLOOR) / 448                      (one fp32 division, IEEE RNE)
    q     = e4m3_sat_rne(x[m, k] / scale)                    (one fp32 division, IEEE RNE)

Static input scales ("tensor"): scale = input_scale for every element. Division, not
multiplication by a reciprocal: the two round differently. (In Triton use
`tl.math.div_rn`; the default `/` on fp32 is not correctly rounded.) NaN inputs are not
defined behaviour.

The GEMM (what each backend computes)
-------------------------------------
With sx[m, b] the activation scale of row m for K block b (b = k // 128; "tensor": the static
scale, "channel": the row's one scale) and sw[n, b] the weight scale of row n for block b
("block": weight_scale[n // 128, b]; "tensor"/"channel": weight_scale[n]), the defined value
is, in exact arithmetic,

    y[m, n] = sum over b ascending of  (sx[m, b] * sw[n, b]) * sum_{k in block b} Xq[m, k] * Wq[n, k]
              + bias[n]

Each backend's arithmetic (its rounding), which must not depend on M, the row's index in the
call, or anything but the row's own values:

  * `fp8_linear_reference` (float64, the oracle): exactly the formula above in float64.
  * CPU deterministic: Xhat = fp32(Xq) * sx and What = fp32(Wq) * sw (elementwise fp32
    products, at quantization time and at load), then the deterministic fp32 linear of
    `docs/cpu_ops.md` (fixed lane order over K). `dequantized_activation` and
    `dequantize_weight` below are those two products.
  * GPU deterministic (Triton): per K block b in ascending order, the block's e4m3 dot
    product accumulated in fp32 (tensor cores), times (sx * sw) in fp32, added to one fp32
    accumulator; then + bias (fp32) and one cast to the output dtype. K tiles are the 128-wide
    scale blocks; a partial last block is zero-masked; tile configs chosen by M only.
  * GPU stock (`--mode reference`): `torch._scaled_mm` ("tensor": per-tensor scales; "channel": row-wise), or the
    dequantized matmul for "block": the yardstick, not M-invariant.

FP8 KV cache (`--kv-dtype fp8_e4m3`)
-------------------------------------
Each attention layer has two static fp32 scales, s_k and s_v: the checkpoint's `k_scale` and
`v_scale` (or one `kv_scale` for both; lockstep/models/fp8_formats.py names the formats), 1.0
where the checkpoint has none. A K or V value is written once, when its token's K/V are
written to the pool, as

    kq = e4m3_sat(k / s_k)    (k the fp32 value a bf16/fp32 cache would hold, widened; one
                               correctly rounded fp32 division, as for static activations)

and the attention reads the key s_k * kq and the value s_v * vq. A prefix-cache hit therefore
reads exactly what the cold prefill wrote, and every path (prefill, chunks, decode) reads it
through the same formula. With s = 1.0 the division and the product are exact: e4m3_sat(k)
and fp32(kq). Values beyond 448 * s saturate. How each backend reads (the rounding):

  * CPU and torch backends (`dequantize_kv`): fp32(kq) * s, one fp32 multiplication per
    element, then the attention of an fp32 cache holding those values.
  * GPU deterministic (Triton): s_k folded into the score scale (scores q . kq times
    softmax_scale * s_k), the output of the attention over vq times s_v in fp32, then one
    cast to the activation dtype; the same on every path, since every path is one kernel
    family called with the same scales.

A scale is a property of the layer, never of the batch: a checkpoint's dynamic KV scales
(computed from the data in flight) are refused at load (`fp8_formats.py`).

Backends agree with the reference within the precision of fp32 accumulation (CPU, fp32
activations: logits within 1e-5 of the float64 reference in tests/unit/models/test_fp8_models.py); Xq is
bit-identical in every backend, given the same x. On the GPU each block's e4m3 dot is what
Hopper's tensor cores give, which is not exact: they sum FP8 products with reduced precision,
off the exact dot by up to a few 1e-3 of the products' magnitude. cuBLAS's FP8 GEMM gives the
same block dots bit for bit, so the GPU tests compare with the formula above evaluated on
cuBLAS's block dots (tests/support/fp8_block_dots.py), within the kernel's fp32 roundings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCHEMES: tuple[str, ...] = ("block", "tensor", "channel")
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128  # the scale block, both along N and K ("block"), and the activation group
# Smallest amax used for a dynamic scale, so an all-zero group gets a finite scale (its q is 0).
AMAX_FLOOR = 1e-10


@dataclass(frozen=True)
class Fp8Weight:
    """One FP8 linear's weight as a backend holds it.

    `weight` is e4m3 [N, K] on the GPU backends; the CPU backends keep the dequantized fp32
    weight (`dequantize_weight`, K zero-padded as their `prepare_linear_weight` does) and
    `weight` is that. `weight_scale` is fp32 ("block": [ceil(N/128), ceil(K/128)], else [N]);
    `input_scale` an fp32 0-d tensor for "tensor", else None. `in_features` is K before any
    padding."""

    scheme: str
    weight: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: torch.Tensor | None
    in_features: int

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor it holds (for in-place weight updates and device moves)."""
        rest = [] if self.input_scale is None else [self.input_scale]
        return [self.weight, self.weight_scale, *rest]


def e4m3_weight(
    scheme: str, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None
) -> Fp8Weight:
    """The GPU backends' `prepare_fp8_linear`: checked, kept as e4m3 [N, K] (K contiguous)
    with its fp32 scales, on their device."""
    check_fp8_weight(scheme, weight, weight_scale, input_scale)
    return Fp8Weight(
        scheme, weight.contiguous(), weight_scale.contiguous(), input_scale, weight.shape[1]
    )


def check_fp8_weight(
    scheme: str,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    name: str = "weight",
) -> None:
    """Raise ValueError (one line naming `name`) unless the tensors fit `scheme`."""
    if scheme not in SCHEMES:
        raise ValueError(f"{name}: FP8 scheme {scheme!r} is invalid: expected one of {SCHEMES}")
    if weight.dtype != E4M3 or weight.dim() != 2:
        raise ValueError(
            f"{name}: dtype {weight.dtype} shape {list(weight.shape)}, expected a 2-D "
            "float8_e4m3fn tensor"
        )
    n, k = weight.shape
    want = (-(-n // BLOCK), -(-k // BLOCK)) if scheme == "block" else (n,)
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != want:
        raise ValueError(
            f"{name}: weight scale has dtype {weight_scale.dtype} shape "
            f"{list(weight_scale.shape)}, expected float32 {list(want)} for scheme {scheme!r}"
        )
    if (scheme == "tensor") != (input_scale is not None):
        need = "needs a static input scale" if scheme == "tensor" else "takes no input scale"
        raise ValueError(f"{name}: scheme {scheme!r} {need}")
    if input_scale is not None and (input_scale.dtype != torch.float32 or input_scale.numel() != 1):
        raise ValueError(f"{name}: input scale must be one float32 value")


def e4m3_sat(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3, saturating round-to-nearest-even."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_kv(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """K or V values as the FP8 cache stores them ("FP8 KV cache"): e4m3_sat(fp32(x) / scale),
    one correctly rounded fp32 division per element (a tensor divisor: PyTorch's CUDA
    kernels divide by a Python number as a multiplication by its reciprocal)."""
    x = x.to(torch.float32)
    if scale == 1.0:
        return e4m3_sat(x)  # x / 1.0 is x
    return e4m3_sat(x / torch.full_like(x, scale))


def dequantize_kv(q: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """The value an FP8 cache entry stands for, as the CPU and torch backends read it:
    fp32(q) * scale, one fp32 multiplication per element (exact for scale 1.0)."""
    x = q.to(torch.float32)
    if scale == 1.0:
        return x
    return x * torch.full_like(x, scale)


def widened(rows: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows in `dtype` for the torch attention of the fast and reference backends: an
    FP8 cache's as `dequantize_kv` at its scale, then cast; any other cache's cast."""
    if rows.dtype == E4M3:
        return dequantize_kv(rows, scale).to(dtype)
    return rows.to(dtype)


def activation_group(scheme: str, k: int) -> int:
    """The width of one dynamic activation scale group for `scheme` (K for per-token)."""
    return BLOCK if scheme == "block" else k


def _over_e4m3_max(amax: torch.Tensor) -> torch.Tensor:
    """max(amax, AMAX_FLOOR) / 448, one correctly rounded fp32 division per element on every
    device. The divisor is a tensor: PyTorch's CUDA kernels divide by a Python number as a
    multiplication by its reciprocal, which rounds differently."""
    floor = amax.clamp_min(AMAX_FLOOR)
    return floor / torch.full_like(floor, E4M3_MAX)


def quantize_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic row-local quantization: x [M, K] -> (q e4m3 [M, K], scale fp32 [M, ceil(K/group)]).
    Each scale is max(amax of its group, AMAX_FLOOR) / 448; q = e4m3_sat(x / scale)."""
    x = x.to(torch.float32)
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x, (0, groups * group - k)).view(m, groups, group)
    amax = padded.abs().amax(dim=-1)
    scale = _over_e4m3_max(amax)
    q = e4m3_sat(x / scale.repeat_interleave(group, dim=1)[:, :k])
    return q, scale


def quantize_static(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """Static quantization ("tensor"): q = e4m3_sat(x / input_scale), elementwise."""
    return e4m3_sat(x.to(torch.float32) / input_scale.to(torch.float32))


def quantize_activation(
    x: torch.Tensor, scheme: str, input_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q e4m3 [M, K], per-element scale sx fp32 [M, K]) for `scheme`: the scale
    of each element, expanded (what `dequantized_activation` multiplies by)."""
    m, k = x.shape
    if scheme == "tensor":
        assert input_scale is not None
        s = input_scale.to(device=x.device, dtype=torch.float32).reshape(())
        return quantize_static(x, s), s.expand(m, k)
    group = activation_group(scheme, k)
    q, scale = quantize_rows(x, group)
    return q, scale.repeat_interleave(group, dim=1)[:, :k]


def dequantized_activation(
    x: torch.Tensor, scheme: str, input_scale: torch.Tensor | None
) -> torch.Tensor:
    """The CPU backends' activation: fp32(q) * sx, elementwise fp32, [M, K]."""
    q, sx = quantize_activation(x, scheme, input_scale)
    return q.to(torch.float32) * sx


def weight_scales(scheme: str, weight_scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The weight scale of every element, sw fp32 [N, K]."""
    if scheme == "block":
        return weight_scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return weight_scale.reshape(n, 1).expand(n, k)


def dequantize_weight(
    scheme: str, weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """fp32(Wq) * sw, elementwise fp32: the CPU backends' weight [N, K]."""
    n, k = weight.shape
    return weight.to(torch.float32) * weight_scales(scheme, weight_scale.float(), n, k)


def fp8_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    scheme: str,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The defined value in float64 (the module docstring's formula): x [..., K] of any float
    dtype, weight e4m3 [N, K] -> float64 [..., N]. The activation is quantized from x as
    fp32, exactly as every backend does."""
    check_fp8_weight(scheme, weight, weight_scale, input_scale)
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    q, sx = quantize_activation(x.reshape(-1, k).to(torch.float32), scheme, input_scale)
    sw = weight_scales(scheme, weight_scale, n, k).to(torch.float64)
    xq, wq = q.to(torch.float64), weight.to(torch.float64)
    out = torch.zeros(q.shape[0], n, dtype=torch.float64, device=x.device)
    for start in range(0, k, BLOCK):
        cols = slice(start, min(start + BLOCK, k))
        partial = xq[:, cols] @ wq[:, cols].T
        out += partial * sx[:, start : start + 1].to(torch.float64) * sw[:, start][None, :]
    if bias is not None:
        out += bias.to(torch.float64)
    return out.reshape(*lead, n)


def quantize_weight(
    w: torch.Tensor, scheme: str, *, input_amax: float = 4.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize a float weight [N, K] the way the checkpoint formats do (random-weight presets
    and tests): per 128x128 block, per row, or per row with a static input scale for an
    activation range of +-`input_amax` ("tensor": one scale for the whole tensor, repeated
    per row). Returns (Wq e4m3, weight_scale fp32, input_scale)."""
    w = w.to(torch.float32)
    n, k = w.shape
    if scheme == "block":
        nb, kb = -(-n // BLOCK), -(-k // BLOCK)
        padded = torch.nn.functional.pad(w, (0, kb * BLOCK - k, 0, nb * BLOCK - n))
        amax = padded.view(nb, BLOCK, kb, BLOCK).abs().amax(dim=(1, 3))
        scale = _over_e4m3_max(amax)
        q = e4m3_sat(w / weight_scales("block", scale, n, k))
        return q, scale, None
    if scheme not in ("tensor", "channel"):
        raise ValueError(f"FP8 scheme {scheme!r} is invalid: expected one of {SCHEMES}")
    amax = w.abs().amax(dim=1) if scheme == "channel" else w.abs().amax().expand(n)
    scale = _over_e4m3_max(amax)
    q = e4m3_sat(w / scale[:, None])
    if scheme == "channel":
        return q, scale.contiguous(), None
    return q, scale.contiguous(), torch.tensor(input_amax / E4M3_MAX, dtype=torch.float32)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    scheme: str,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The GPU deterministic FP8 linear (implemented in `lockstep.ops.triton.fp8_gemm`).

    x: bfloat16, float16 or float32 [..., K] on CUDA, any strides (2-D or 3-D);
    weight: e4m3 [N, K] contiguous; weight_scale: fp32 per `scheme` (module docstring);
    input_scale: fp32 0-d tensor ("tensor" only); bias: fp32 [N] or None.
    Returns x.dtype [..., N]. Row m of the result depends only on x[..., m, :]: the same bits
    for every M, every row index, eager or CUDA-graph replay. Raises NotImplementedError
    where the kernel module is absent."""
    try:
        from lockstep.ops.triton.fp8_gemm import fp8_linear as kernel
    except ImportError as exc:
        raise NotImplementedError(
            f"the deterministic GPU FP8 GEMM is not available ({exc}); use --mode reference for FP8 "
            "models on the GPU"
        ) from None
    return kernel(x, weight, weight_scale, scheme, input_scale=input_scale, bias=bias)


class DequantizedFp8Linear:
    """`Ops.prepare_fp8_linear` and `Ops.fp8_linear` for the CPU backends: the weight is
    dequantized once at load (`dequantize_weight`, then the backend's own
    `prepare_linear_weight`), each call's activation is quantized and dequantized row-locally
    (`dequantized_activation`) and multiplied by the backend's own `linear`. Position
    invariant exactly when that `linear` is: the quantization is elementwise plus an exact
    max per row group."""

    def prepare_fp8_linear(
        self,
        scheme: str,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        input_scale: torch.Tensor | None,
    ) -> Fp8Weight:
        check_fp8_weight(scheme, weight, weight_scale, input_scale)
        dequantized = dequantize_weight(scheme, weight, weight_scale)
        dequantized = self.prepare_linear_weight(dequantized)  # type: ignore[attr-defined]
        return Fp8Weight(scheme, dequantized, weight_scale, input_scale, weight.shape[1])

    def fp8_linear(
        self, x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        k = weight.in_features
        lead = x.shape[:-1]
        xhat = dequantized_activation(x.reshape(-1, k), weight.scheme, weight.input_scale)
        out = self.linear(xhat, weight.weight, bias)  # type: ignore[attr-defined]
        return out.reshape(*lead, weight.out_features)

    def fp8_expert_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        scheme: str = "block",
        input_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One FP8 expert's GEMM (lockstep/ops/moe.py, "FP8 experts"): x [M, K] and the
        expert's prepared weight [N, K'] (its `Fp8Weight.weight` parts, stacked) at `scheme`
        (with the static `input_scale` for "tensor"): the arithmetic of `fp8_linear`, so a
        row equals the dense FP8 linear's row."""
        xhat = dequantized_activation(x, scheme, input_scale)
        return self.linear(xhat, weight)  # type: ignore[attr-defined]
