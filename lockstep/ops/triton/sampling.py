"""The sampler's float64 work in one pass each, bit for bit its reference in
`lockstep.engine.sampler`: the Gumbel noise (`gumbel_noise_reference`) and top-p's
fixed-point probabilities (`probability_units_reference`).

Noise for row r, token v is a pure function of (seed_r, position_r, v): integer hashing, then
-log(-log(u)) with the reference's log built from IEEE basic operations on float64 (frexp by
bit fields, one division, a 30-term Horner series). Basic operations are correctly rounded,
so the same sequence of them gives the same bits on any device; multiply-add contraction is
off (`enable_fp_fusion=False`) so the compiler cannot fuse a * b + c into one rounding, and
every float64 constant that float32 cannot hold (the series' coefficients, ln 2) is read from
a float64 tensor, never written as a literal (Triton would type a literal as float32).

The references run ~200 (noise) and ~50 (units) full-width float64 passes in torch; each
kernel is one pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lockstep.ops.triton.launch import interpreting, pdl_launch, wait_for_inputs

BLOCK = 1024
LOG_TERMS = 30  # the reference's Horner series length


_CONSTANTS: dict[torch.device, torch.Tensor] = {}


def float64_constants(device: torch.device) -> torch.Tensor:
    """float64 [LOG_TERMS + 1]: the log series' coefficients in Horner order (1/59, ..., 1/3,
    1), then ln 2, computed by Python exactly as the reference computes them. Cached per device
    (a copy per call would make every sampling step wait for the device; the engine's
    `sampler.warm_up` makes the one copy at start-up)."""
    if device not in _CONSTANTS:
        coef = [1.0 / (2 * i + 1) for i in range(LOG_TERMS - 1, -1, -1)]
        _CONSTANTS[device] = torch.tensor([*coef, 0.6931471805599453], dtype=torch.float64,
                                          device=device)  # fmt: skip
    return _CONSTANTS[device]


@triton.jit
def _hash32(x):
    """The reference's 32-bit mixer on int64 values < 2**32."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    return (x >> 16) ^ x


@triton.jit
def _log(x, coef, TERMS: tl.constexpr):
    """log(x) for float64 x >= 0, the reference's operations: x = m * 2**e, m in [0.5, 1)
    (frexp from the bit fields; frexp(0) = (0, 0) as torch's), z = (m - 1) / (m + 1), then
    2 z sum(z**2i / (2i + 1)) + e ln 2."""
    bits = x.to(tl.int64, bitcast=True)
    e = ((bits >> 52) & 0x7FF) - 1022
    m = ((bits & 0xFFFFFFFFFFFFF) | 0x3FE0000000000000).to(tl.float64, bitcast=True)
    zero = x == 0.0
    m = tl.where(zero, x, m)
    e = tl.where(zero, 0, e)
    z = (m - 1.0) / (m + 1.0)
    z2 = z * z
    total = tl.zeros_like(z)
    for i in tl.static_range(TERMS):
        total = total * z2 + tl.load(coef + i)
    return 2.0 * z * total + e.to(tl.float64) * tl.load(coef + TERMS)


@triton.jit
def _gumbel_kernel(seeds, positions, coef, out, n, TERMS: tl.constexpr, BLOCK: tl.constexpr,
                   PDL: tl.constexpr):  # fmt: skip
    """Noise of row program_id(0), columns of block program_id(1): the reference's key from
    (seed, position), its uniform per column, then -log(-log(u))."""
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    seed = tl.load(seeds + row)
    key = _hash32(tl.load(positions + row) & 0xFFFFFFFF)
    key = _hash32(key ^ ((seed >> 32) & 0xFFFFFFFF))
    key = _hash32(key ^ (seed & 0xFFFFFFFF))
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    a = _hash32(_hash32(idx) ^ key)
    b = _hash32(a ^ 0x5BD1E995)
    # 53 random bits (32 from a, 21 from b), +0.5: strictly inside (0, 1).
    bits = a.to(tl.float64) * 2097152.0 + (b >> 11).to(tl.float64)
    u = (bits + 0.5) / 9007199254740992.0
    g = -_log(-_log(u, coef, TERMS), coef, TERMS)
    tl.store(out + row.to(tl.int64) * n + idx, g, mask=idx < n)


# n (rows x V) varies with the number of top-p rows: not specialized, so that no batch
# compiles a second binary while serving.
@triton.jit(do_not_specialize=["n"])
def _units_kernel(x, coef, out, n, TERMS: tl.constexpr, UNIT_SCALE: tl.constexpr,
                  BLOCK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """The reference's `_exp` on max(x, -64) (NaN too), times 2**unit_bits, truncated:
    k = x / ln2 rounded half to even (by adding and subtracting 2**52: |x / ln2| < 93),
    r = x - k ln2, 17 Taylor terms, then times 2**k from its bit fields (k >= -93: exact, as
    ldexp)."""
    wait_for_inputs(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x + offs, mask=mask, other=-64.0)  # padding lanes: small units, never stored
    v = tl.where(v >= -64.0, v, -64.0)  # NaN too, as the reference (tl.maximum would not)
    ln2 = tl.load(coef + TERMS)  # after the log series' coefficients
    k = (v / ln2 - 4503599627370496.0) + 4503599627370496.0
    r = v - k * ln2
    term = tl.full(r.shape, 1.0, tl.float64)
    total = tl.full(r.shape, 1.0, tl.float64)
    for i in tl.static_range(1, 18):
        term = term * r / i
        total = total + term
    scale = ((k.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)
    tl.store(out + offs, (total * scale * UNIT_SCALE).to(tl.int64), mask=mask)


def _opts(device: torch.device, rows: int) -> dict:
    """Launch options: contraction off (a * b + c stays two roundings, as in the reference);
    the interpreter takes no compiler options and computes each operation in numpy, which
    never contracts."""
    opts = {"num_warps": 4, **pdl_launch(device, rows)}
    if not interpreting():
        opts["enable_fp_fusion"] = False
    return opts


def probability_units(x: torch.Tensor, unit_bits: int) -> torch.Tensor:
    """int64 trunc(exp(x) * 2**unit_bits) of float64 x <= 0 (`probability_units_reference`).
    The sampler uses 44 bits; tests use up to 100 on x <= -(unit_bits - 62) ln 2, where the
    result still fits int64 (elsewhere it would not)."""
    if x.dtype != torch.float64 or not 0 <= unit_bits <= 100:
        raise ValueError(f"probability_units wants float64 x and 0 <= unit_bits <= 100; got "
                         f"{x.dtype}, {unit_bits}")  # fmt: skip
    xc = x.contiguous()
    out = torch.empty(xc.shape, dtype=torch.int64, device=x.device)
    if xc.numel():
        _units_kernel[(triton.cdiv(xc.numel(), BLOCK),)](
            xc, float64_constants(x.device), out, xc.numel(), TERMS=LOG_TERMS,
            UNIT_SCALE=float(2**unit_bits), BLOCK=BLOCK, **_opts(x.device, xc.shape[0] if xc.dim() else 1),
        )  # fmt: skip
    return out


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, n: int) -> torch.Tensor:
    """float64 [R, n] noise for int64 seeds [R] and positions [R] (on one device)."""
    if (
        seeds.dtype != torch.int64
        or positions.dtype != torch.int64
        or seeds.dim() != 1
        or (positions.shape != seeds.shape or positions.device != seeds.device)
    ):
        raise ValueError("gumbel_noise wants int64 seeds [R] and positions [R] on one device")
    r = seeds.shape[0]
    out = torch.empty((r, n), dtype=torch.float64, device=seeds.device)
    if r and n:
        _gumbel_kernel[(r, triton.cdiv(n, BLOCK))](
            seeds.contiguous(), positions.contiguous(), float64_constants(seeds.device), out, n,
            TERMS=LOG_TERMS, BLOCK=BLOCK, **_opts(seeds.device, r),
        )  # fmt: skip
    return out
