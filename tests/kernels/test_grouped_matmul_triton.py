"""MLA's absorbed projections as one grouped matmul (lockstep/ops/triton/matmul.py,
`grouped_matmul`; lockstep/models/blocks/mla.py): heads as groups, each group's rows the bits
of the dense `matmul` of that head alone, the head loop the MLA block ran before.

Without CUDA the kernel runs under the Triton interpreter on small shapes (strided views of a
wider tensor, K tails, every table config, M from 1 up); on CUDA on DeepSeek's shapes
(V2-Lite: 16 heads, V3: 128; dn 128, R 512, dv 128), where `matmul` uses TMA loads and the
grouped kernel pointer loads. Negative control: another K block size gives other bits (the
interpreter), so the comparison can fail.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from lockstep.ops.triton import matmul as mm

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float32

if not GPU:
    from test_ops_triton import _row_local_interpreter_dot

    _row_local_interpreter_dot()

# (heads, nope, latent, value): the interpreter's are small; K 40 has a tail at BK 32.
SHAPES = [(16, 128, 512, 128), (128, 128, 512, 128)] if GPU else [(3, 32, 48, 32), (2, 40, 32, 16)]
MS = [1, 2, 7, 64, 129, 300, 2048] if GPU else [1, 2, 5, 17]


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEV, DTYPE)


def _per_head(x: torch.Tensor, w: torch.Tensor, config: mm.MatmulConfig | None = None):
    """The head loop: one dense matmul per head on a contiguous copy of its rows."""
    return torch.stack(
        [mm.matmul(x[:, h].contiguous(), w[h], config=config) for h in range(x.shape[1])], 1
    )


@pytest.mark.parametrize(("heads", "nope", "latent", "value"), SHAPES)
def test_grouped_matmul_is_the_head_loop_bit_for_bit(
    heads: int, nope: int, latent: int, value: int
) -> None:
    """W_UK on the no-RoPE columns of q (a strided view, read in place) and W_UV on the
    attention's output, every M: the head loop's bits."""
    rope = 16
    w_uk = _randn(heads, latent, nope, seed=1, scale=nope**-0.5)
    w_uv = _randn(heads, value, latent, seed=2, scale=latent**-0.5)
    q = _randn(max(MS), heads, nope + rope, seed=3)
    o = _randn(max(MS), heads, latent, seed=4)
    for m in MS:
        q_nope = q[:m, :, :nope]
        assert not q_nope.is_contiguous()
        got = mm.grouped_matmul(q_nope, w_uk)
        assert got.shape == (m, heads, latent)
        assert torch.equal(got, _per_head(q_nope, w_uk)), ("w_uk", m)
        assert torch.equal(mm.grouped_matmul(o[:m], w_uv), _per_head(o[:m], w_uv)), ("w_uv", m)


@pytest.mark.skipif(GPU, reason="the interpreter's configs: the GPU runs the table")
def test_every_table_config_and_the_negative_control() -> None:
    """Each table config (as `matmul` would pick it for some M) gives the head loop's bits
    under the same config; a K block of another size changes them."""
    heads, k, n = 2, 96, 48
    x = _randn(9, heads, k, seed=5)
    w = _randn(heads, n, k, seed=6, scale=k**-0.5)
    for *_, cfg in mm.TILE_TABLE:
        assert torch.equal(mm.grouped_matmul(x, w, config=cfg), _per_head(x, w, cfg)), cfg
    base = mm.MatmulConfig(16, 32, 32, 4, 2)
    other = mm.MatmulConfig(16, 32, 64, 4, 2)
    assert torch.equal(mm.grouped_matmul(x, w, config=base), _per_head(x, w, base))
    assert not torch.equal(mm.grouped_matmul(x, w, config=other), _per_head(x, w, base))


def test_shapes_and_dtypes_are_checked() -> None:
    x = _randn(3, 2, 32, seed=7)
    with pytest.raises(ValueError, match="x \\[M, G, K\\] and w \\[G, N, K\\]"):
        mm.grouped_matmul(x, _randn(3, 16, 32, seed=8))
    with pytest.raises(ValueError, match="K axis contiguous"):
        mm.grouped_matmul(x.transpose(1, 2).contiguous().transpose(1, 2), _randn(2, 16, 32, seed=9))
