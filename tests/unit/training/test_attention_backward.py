"""The blocked attention backward (lockstep/training/attention_grad.py): its gradients are the
full-matrix autograd gradients (float32, relative 1e-5) on a packed batch of several
sequences with grouped-query heads, with a sliding window (windows shorter than, equal to and
longer than a tile) and with values narrower than the keys (MLA), and no tensor it makes is larger than one [Hq, block,
block] tile of scores per query tile, where the full-matrix backward makes [Hq, n, n]."""

from __future__ import annotations

import pytest
import torch

from lockstep.training.attention_grad import blocked_attention_grads
from tests.support.grad_checks import LargestTensor

SEQ_LENS = [300, 17, 129, 64, 1]  # across tile edges, a sequence of one token
HQ, HKV, D = 4, 2, 16
BLOCK = 32
SCALE = D**-0.5


def _dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """Causal attention per sequence with the whole [Hq, n, n] score matrix (transformers'),
    a row at position p seeing keys p - window + 1 .. p where a window is given."""
    outs, start = [], 0
    for n in SEQ_LENS:
        qb = q[start : start + n].transpose(0, 1)
        kb = k[start : start + n].transpose(0, 1).repeat_interleave(HQ // HKV, 0)
        vb = v[start : start + n].transpose(0, 1).repeat_interleave(HQ // HKV, 0)
        scores = (qb @ kb.transpose(1, 2)) * SCALE
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        if window is not None:
            causal &= torch.ones(n, n, dtype=torch.bool).triu(1 - window)
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        outs.append((weights @ vb).transpose(0, 1))
        start += n
    return torch.cat(outs)


def _inputs() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    t = sum(SEQ_LENS)
    q = torch.randn(t, HQ, D, generator=gen) * 2  # peaked softmaxes as well as flat ones
    k = torch.randn(t, HKV, D, generator=gen)
    v = torch.randn(t, HKV, D, generator=gen)
    grad = torch.randn(t, HQ, D, generator=gen)
    return q, k, v, grad


def _dense_grads(q, k, v, grad, window=None):  # type: ignore[no-untyped-def]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    return torch.autograd.grad(_dense(*leaves, window), leaves, grad)


@pytest.mark.parametrize("window", [2, 8, BLOCK, 45, 200])  # 1: dq is exactly 0
def test_windowed_gradients_equal_the_full_matrix_gradients(window: int) -> None:
    q, k, v, grad = _inputs()
    expected = _dense_grads(q, k, v, grad, window)
    got = blocked_attention_grads(q, k, v, grad, SEQ_LENS, SCALE, block=BLOCK, window=window)
    for name, g, e in zip("qkv", got, expected, strict=True):
        assert ((g - e).norm() / e.norm()).item() < 1e-5, name
    # The control: without the window the gradient is another one.
    unwindowed = blocked_attention_grads(q, k, v, grad, SEQ_LENS, SCALE, block=BLOCK)
    assert ((unwindowed[1] - expected[1]).norm() / expected[1].norm()).item() > 1e-2


def test_values_narrower_than_keys() -> None:
    """MLA's latent attention: the values are the first columns of the keys' rows."""
    q, k, _, _ = _inputs()
    narrow = D // 4
    v = k[..., :narrow].clone()
    grad = torch.randn(q.shape[0], HQ, narrow, generator=torch.Generator().manual_seed(1))
    expected = _dense_grads(q, k, v, grad)
    got = blocked_attention_grads(q, k, v, grad, SEQ_LENS, SCALE, block=BLOCK)
    for name, g, e in zip("qkv", got, expected, strict=True):
        assert g.shape == e.shape
        assert ((g - e).norm() / e.norm()).item() < 1e-5, name


def test_blocked_gradients_equal_the_full_matrix_gradients() -> None:
    q, k, v, grad = _inputs()
    expected = _dense_grads(q, k, v, grad)
    got = blocked_attention_grads(q, k, v, grad, SEQ_LENS, SCALE, block=BLOCK)
    for name, g, e in zip("qkv", got, expected, strict=True):
        assert g.shape == e.shape and g.dtype == torch.float32
        assert ((g - e).norm() / e.norm()).item() < 1e-5, name
    # The control: another sequence cut (the keys of one sequence seen by another) moves the
    # gradient far past the bound, so the comparison above could fail.
    moved = blocked_attention_grads(q, k, v, grad, [250, 67, 129, 64, 1], SCALE, block=BLOCK)
    assert ((moved[1] - expected[1]).norm() / expected[1].norm()).item() > 1e-2


def test_blocked_backward_holds_no_score_matrix() -> None:
    q, k, v, grad = _inputs()
    # One [Hq, block, block] score tile per query tile (the tiles of one offset), which also
    # bounds the inputs cut into tiles (D <= block): linear in the tokens.
    query_tiles = sum(-(-n // BLOCK) for n in SEQ_LENS)
    bound = query_tiles * HQ * BLOCK * BLOCK
    full = HQ * max(SEQ_LENS) ** 2
    assert full > 4 * bound  # the shapes tell the two backwards apart
    with LargestTensor() as blocked:
        blocked_attention_grads(q, k, v, grad, SEQ_LENS, SCALE, block=BLOCK)
    assert blocked.largest <= bound
    # The control: the full-matrix backward makes a tensor of the longest sequence's scores.
    with LargestTensor() as dense:
        _dense_grads(q, k, v, grad)
    assert dense.largest >= full
