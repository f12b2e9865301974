"""The fused attention backward (lockstep/training/sdpa_grad.py): its gradients are the
full-matrix autograd gradients of causal attention (float32, relative 1e-5) on packed
batches with grouped-query heads, sequences of close lengths right-padded into one call;
computed in bfloat16 they stay within bfloat16's error; no tensor it makes is a score
matrix, where the full-matrix backward makes [Hq, n, n]; a batch of equal lengths is viewed,
not gathered (no index op, where a padded group makes them)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lockstep.training.sdpa_grad import fused_attention_grads, length_groups
from tests.support.grad_checks import LargestTensor, relative

HQ, HKV, D = 4, 2, 16
SCALE = D**-0.5
UNEVEN = [300, 17, 129, 64, 1]  # one group each: no two lengths are close
CLOSE = [40, 37, 33, 40, 5, 1, 2]  # groups of several, padded: 40, 40, 37, 33 together
EQUAL = [24, 24, 24, 9, 9]  # two groups of equal lengths, each packed in a row: views


def _inputs(seq_lens: Sequence[int]) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    t = sum(seq_lens)
    q = torch.randn(t, HQ, D, generator=gen) * 2  # peaked softmaxes as well as flat ones
    k, v = torch.randn(t, HKV, D, generator=gen), torch.randn(t, HKV, D, generator=gen)
    return q, k, v, torch.randn(t, HQ, D, generator=gen)


def _dense_grads(seq_lens: Sequence[int], q, k, v, grad):  # type: ignore[no-untyped-def]
    """Autograd of causal attention with each sequence's whole [Hq, n, n] scores."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    outs, start = [], 0
    for n in seq_lens:
        qb, kb, vb = (x[start : start + n].transpose(0, 1) for x in leaves)
        kb, vb = kb.repeat_interleave(HQ // HKV, 0), vb.repeat_interleave(HQ // HKV, 0)
        scores = (qb @ kb.transpose(1, 2)) * SCALE
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        outs.append((scores.masked_fill(~causal, float("-inf")).softmax(-1) @ vb).transpose(0, 1))
        start += n
    return torch.autograd.grad(torch.cat(outs), leaves, grad)


def test_groups_pad_close_lengths_together() -> None:
    assert length_groups([64] * 8) == [list(range(8))]
    assert length_groups(UNEVEN) == [[0], [2], [3], [1], [4]]
    groups = length_groups(CLOSE)
    assert groups[0] == [0, 3, 1, 2]  # longest first, padded to 40
    assert sorted(b for g in groups for b in g) == list(range(len(CLOSE)))


@pytest.mark.parametrize("seq_lens", [UNEVEN, CLOSE, EQUAL], ids=["uneven", "close", "equal"])
def test_fused_gradients_equal_the_full_matrix_gradients(seq_lens: list[int]) -> None:
    q, k, v, grad = _inputs(seq_lens)
    expected = _dense_grads(seq_lens, q, k, v, grad)
    got = fused_attention_grads(q, k, v, grad, seq_lens, SCALE)
    for name, g, e in zip("qkv", got, expected, strict=True):
        assert g.shape == e.shape and g.dtype == torch.float32
        assert relative(g, e) < 1e-5, name
    # The control: another cut of the same rows (one sequence's keys seen by another) moves
    # the gradient far past the bound, so the comparison above could fail.
    moved = [seq_lens[0] - 3, seq_lens[1] + 3, *seq_lens[2:]]
    other = fused_attention_grads(q, k, v, grad, moved, SCALE)
    assert relative(other[1], expected[1]) > 1e-2


def test_bfloat16_gradients_within_bfloat16_error() -> None:
    q, k, v, grad = _inputs(CLOSE)
    expected = _dense_grads(CLOSE, q, k, v, grad)
    got = fused_attention_grads(q, k, v, grad, CLOSE, SCALE, dtype=torch.bfloat16)
    for name, g, e in zip("qkv", got, expected, strict=True):
        assert g.dtype == torch.float32  # q's dtype, whatever the attention ran in
        # The control side: it really ran in bfloat16 (float32 is within 1e-5, above).
        assert 1e-4 < relative(g, e) < 2e-2, name


def test_fused_backward_holds_no_score_matrix() -> None:
    q, k, v, grad = _inputs(UNEVEN)
    padded_inputs = max(UNEVEN) * HQ * D  # the largest group, one sequence of 300 rows
    full = HQ * max(UNEVEN) ** 2
    assert full > 4 * padded_inputs  # the shapes tell the two backwards apart
    with LargestTensor() as fused:
        fused_attention_grads(q, k, v, grad, UNEVEN, SCALE)
    assert fused.largest <= sum(UNEVEN) * HQ * D  # the packed inputs and gradients
    # The control: the full-matrix backward makes a tensor of the longest sequence's scores.
    with LargestTensor() as dense:
        _dense_grads(UNEVEN, q, k, v, grad)
    assert dense.largest >= full


def test_repeated_kv_heads_where_the_kernel_lacks_grouped_heads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CUDA's float32 attention reads no grouped KV heads: the KV heads are repeated before
    the call and autograd sums their gradients back (forced here on the CPU)."""
    import lockstep.training.sdpa_grad as sdpa_grad

    monkeypatch.setattr(sdpa_grad, "_native_gqa", lambda device, dtype: False)
    q, k, v, grad = _inputs(CLOSE)
    expected = _dense_grads(CLOSE, q, k, v, grad)
    got = fused_attention_grads(q, k, v, grad, CLOSE, SCALE)
    for name, g, e in zip("qkv", got, expected, strict=True):
        assert g.shape == e.shape and relative(g, e) < 1e-5, name


class _IndexOps(TorchDispatchMode):
    """Counts the index gathers and scatters (aten.index, aten.index_put) run while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket in (torch.ops.aten.index, torch.ops.aten.index_put,
                                   torch.ops.aten.index_put_):  # fmt: skip
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_equal_lengths_in_a_row_are_viewed_not_gathered() -> None:
    q, k, v, grad = _inputs(EQUAL)
    with _IndexOps() as equal:
        fused_attention_grads(q, k, v, grad, EQUAL, SCALE)
    assert equal.count == 0
    # The control: a padded group gathers its rows and scatters their gradients back.
    q, k, v, grad = _inputs(CLOSE)
    with _IndexOps() as close:
        fused_attention_grads(q, k, v, grad, CLOSE, SCALE)
    assert close.count > 0
