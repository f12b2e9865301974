"""MLA's attention-input kernels (lockstep/ops/triton/latent_input.py) against the composed
torch ops they replace (`ComposedLatentInput` over the GPU backend's own `rope` and
`write_latent`), bit for bit, at DeepSeek-V2-Lite's widths (latent 512, RoPE 64, 16 heads,
no-RoPE 128): the cache row (a float32, bfloat16 or float8_e4m3fn cache) and the absorbed
query, float32 and bfloat16 activations, irregular positions and slots. Negative controls:
positions off by one, and a RoPE whose products are contracted into FMAs, each fail the same
comparison.

Without CUDA the kernels run under the Triton interpreter (CPU tensors); with CUDA the same
tests run compiled on the GPU. TRITON_INTERPRET must be set before triton is imported.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from lockstep.ops.base import ComposedLatentInput  # noqa: E402
from lockstep.ops.fp8 import E4M3  # noqa: E402
from lockstep.ops.gpu_deterministic import GpuDeterministicOps  # noqa: E402

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
R, DR, HEADS, NOPE = 512, 64, 16, 128
POSITIONS = [1, 3, 517, 1023, 77]
SLOTS = [4, 9, 0, 13, 6]
POOL = 16
F32, BF16 = torch.float32, torch.bfloat16
# (activation dtype, cache dtype): the engine's caches are the activation dtype or e4m3; a
# bf16 cache under float32 activations checks the bf16 rounding of float32 values too.
CACHE_CASES = [(F32, F32), (F32, BF16), (F32, E4M3), (BF16, BF16), (BF16, E4M3)]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Inputs:
    """One step's rows at V2-Lite's widths: the projection `a` (q heads | latent | k_rope) as
    the block computes it, the normed latent, q_lat, RoPE tables, positions and slots."""

    def __init__(self, act: torch.dtype, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        t = len(POSITIONS)
        a = torch.randn(t, HEADS * (NOPE + DR) + R + DR, generator=gen) * 4
        a[0, -DR:] = 1000.0  # beyond e4m3's 448: saturates
        a[1, -DR:] = 1e-3  # e4m3 subnormals
        latent = torch.randn(t, R, generator=gen) * 3
        latent[2, :8] = 600.0
        self.a = a.to(DEV, act)
        self.latent = latent.to(DEV, act)
        self.q_lat = torch.randn(t, HEADS, R, generator=gen).to(DEV, act)
        inv = 10000.0 ** (-torch.arange(DR // 2, dtype=torch.float64) / (DR // 2))
        angles = torch.arange(2048, dtype=torch.float64)[:, None] * inv[None]
        self.cos = angles.cos().float().to(DEV)
        self.sin = angles.sin().float().to(DEV)
        self.positions = torch.tensor(POSITIONS, device=DEV)
        self.slots = torch.tensor(SLOTS, device=DEV)

    @property
    def k_rope(self) -> torch.Tensor:
        """The key's RoPE part: a strided view of `a`, as the block passes it."""
        return self.a[:, -DR:]

    @property
    def q_rope(self) -> torch.Tensor:
        """The query heads' RoPE parts: a strided view [T, H, DR] of `a`."""
        q = self.a[:, : HEADS * (NOPE + DR)].reshape(len(POSITIONS), HEADS, NOPE + DR)
        return q[:, :, NOPE:]


def _cache(dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    """A pool whose every row holds other values (no NaN codes), to see what is written."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == E4M3:
        return torch.randint(0, 0x7E, (POOL, 1, R + DR), generator=gen,
                             dtype=torch.uint8).view(E4M3).to(DEV)  # fmt: skip
    return torch.randn(POOL, 1, R + DR, generator=gen).to(DEV, dtype)


def _fused_ops() -> GpuDeterministicOps:
    """The backend with its MLA input kernels on (`EngineConfig.mla_fused_input`; off by
    default, when the backend composes the torch ops: then the comparisons below would
    compare the composition with itself)."""
    return GpuDeterministicOps(fused_latent_input=True)


def test_the_kernels_are_off_by_default() -> None:
    assert GpuDeterministicOps().fused_latent_input is False


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


@pytest.mark.parametrize(("act", "cache_dtype"), CACHE_CASES,
                         ids=[f"{_name(a)}-{_name(c)}" for a, c in CACHE_CASES])  # fmt: skip
def test_cache_row_is_the_composed_row(act: torch.dtype, cache_dtype: torch.dtype) -> None:
    ops, x = _fused_ops(), Inputs(act)
    before = _cache(cache_dtype)
    fused, composed = before.clone(), before.clone()
    ops.write_latent_row(fused, x.latent, x.k_rope, x.positions, x.cos, x.sin, x.slots)
    ComposedLatentInput.write_latent_row(ops, composed, x.latent, x.k_rope, x.positions, x.cos,
                                         x.sin, x.slots)  # fmt: skip
    assert torch.equal(_bytes(fused), _bytes(composed))
    others = [s for s in range(POOL) if s not in SLOTS]
    assert torch.equal(_bytes(fused[others]), _bytes(before[others]))
    # The rows were written (not left as they were), saturated where the values pass 448.
    assert not torch.equal(_bytes(fused[SLOTS]), _bytes(before[SLOTS]))
    if cache_dtype == E4M3:
        assert fused.float().abs().max().item() == 448.0


@pytest.mark.parametrize("act", [F32, BF16], ids=_name)
def test_query_is_the_composed_query(act: torch.dtype) -> None:
    ops, x = _fused_ops(), Inputs(act)
    fused = ops.latent_query(x.q_lat, x.q_rope, x.positions, x.cos, x.sin)
    composed = ComposedLatentInput.latent_query(ops, x.q_lat, x.q_rope, x.positions, x.cos, x.sin)
    assert fused.is_contiguous() and fused.dtype == act
    assert fused.shape == (len(POSITIONS), HEADS, R + DR)
    assert torch.equal(fused, composed)


def test_padding_rows_write_nothing() -> None:
    """A negative slot (a padding row) leaves the pool as it was; the other rows are
    written as usual."""
    ops, x = _fused_ops(), Inputs(BF16)
    before = _cache(BF16)
    fused = before.clone()
    slots = x.slots.clone()
    slots[0] = -1
    ops.write_latent_row(fused, x.latent, x.k_rope, x.positions, x.cos, x.sin, slots)
    untouched = [s for s in range(POOL) if s not in SLOTS[1:]]
    assert torch.equal(fused[untouched], before[untouched])
    assert not torch.equal(fused[SLOTS[1:]], before[SLOTS[1:]])


@pytest.mark.parametrize("act", [F32, BF16], ids=_name)
def test_negative_control_positions_off_by_one_miss(act: torch.dtype) -> None:
    """The comparisons above see a RoPE at the wrong position."""
    ops, x = _fused_ops(), Inputs(act)
    shifted = x.positions + 1
    fused, composed = _cache(act), _cache(act)
    ops.write_latent_row(fused, x.latent, x.k_rope, shifted, x.cos, x.sin, x.slots)
    ComposedLatentInput.write_latent_row(ops, composed, x.latent, x.k_rope, x.positions, x.cos,
                                         x.sin, x.slots)  # fmt: skip
    assert not torch.equal(_bytes(fused), _bytes(composed))
    query = ops.latent_query(x.q_lat, x.q_rope, shifted, x.cos, x.sin)
    want = ComposedLatentInput.latent_query(ops, x.q_lat, x.q_rope, x.positions, x.cos, x.sin)
    assert not torch.equal(query, want)


@triton.jit
def _contracted_rope(x, positions, cos, sin, out, sxt, sxh, s_cos, H: tl.constexpr,
                     HALF: tl.constexpr):  # fmt: skip
    """The control's RoPE: each rotated value as one FMA (x1*c + (-x2*s), x2*c + x1*s with
    one rounding fewer), what a compiler contracting multiply-adds would compute."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    dd = tl.arange(0, HALF)
    pos = tl.load(positions + t).to(tl.int64)
    c = tl.load(cos + pos * s_cos + dd)
    s = tl.load(sin + pos * s_cos + dd)
    src = x + t * sxt + h * sxh
    x1 = tl.load(src + dd).to(tl.float32)
    x2 = tl.load(src + HALF + dd).to(tl.float32)
    dst = out + (t * H + h) * (2 * HALF)
    tl.store(dst + dd, tl.fma(x1, c, -(x2 * s)))
    tl.store(dst + HALF + dd, tl.fma(x2, c, x1 * s))


def test_negative_control_fma_contracted_rope_misses() -> None:
    """A kernel whose RoPE products were contracted into FMAs (float32 activations, where
    nothing rounds the difference away) fails the query comparison: the equality above
    would catch a kernel compiled with contraction on. The interpreter's `tl.fma` rounds
    once, as the GPU's does, so this control runs on both."""
    ops, x = _fused_ops(), Inputs(F32)
    t = len(POSITIONS)
    rope = torch.empty(t, HEADS, DR, dtype=F32, device=DEV)
    q_rope = x.q_rope
    _contracted_rope[(t, HEADS)](q_rope, x.positions, x.cos, x.sin, rope, q_rope.stride(0),
                                 q_rope.stride(1), x.cos.stride(0), H=HEADS,
                                 HALF=triton.next_power_of_2(DR // 2))  # fmt: skip
    contracted = torch.cat([x.q_lat, rope], dim=2)
    want = ComposedLatentInput.latent_query(ops, x.q_lat, q_rope, x.positions, x.cos, x.sin)
    assert not torch.equal(contracted, want)
    # Off in the last bits only: the formula is right, its rounding is not the composed one.
    torch.testing.assert_close(contracted, want, rtol=1e-5, atol=1e-5)


def test_shapes_and_dtypes_are_checked() -> None:
    ops, x = _fused_ops(), Inputs(F32)
    with pytest.raises(ValueError, match="cache"):
        ops.write_latent_row(_cache(F32)[:, :, :R], x.latent, x.k_rope, x.positions, x.cos,
                             x.sin, x.slots)  # fmt: skip
    with pytest.raises(ValueError, match="rope tables"):
        ops.latent_query(x.q_lat, x.q_rope, x.positions, x.cos.double(), x.sin)
    with pytest.raises(ValueError, match="q_rope"):
        ops.latent_query(x.q_lat, x.q_rope[:2], x.positions, x.cos, x.sin)
