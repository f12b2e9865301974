"""The LM head's closed-form backward (lockstep/training/token_logprobs.py,
`head_logprob_grads`): in float64 it is torch autograd's gradient of
sum_r g_r * log_softmax(softcap(x W^T))[r, target_r] to 1e-12, with and without soft-capping,
whatever the vocabulary chunk; in float32 within 1e-5, with the fused Triton dlogits kernel
too (lockstep/ops/triton/row_grads.py, CUDA's path, here under Triton's interpreter); a
bfloat16 head with float32 rows returns a bfloat16 gradient. Controls: a forgotten soft-cap,
a wrong log-sum-exp and a shifted target each move it past the bound. Through the autograd
Function (`token_logprobs`, a small fake head), rows without a gradient are left out and the
gradients stay autograd's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lockstep.training.token_logprobs import head_logprob_grads, token_logprobs
from tests.support.grad_checks import relative

T, H, V = 23, 16, 50


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64).to(dtype)
    head = (torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.7).to(dtype)
    targets = torch.randint(0, V, (T,), generator=gen)
    grad = torch.randn(T, generator=gen, dtype=torch.float64).float()
    grad[[0, 7]] = 0.0  # rows without a gradient (a sequence's first token, a prompt token)
    return x, head, targets, grad


def _logits(x: torch.Tensor, head: torch.Tensor, softcap: float | None) -> torch.Tensor:
    z = x @ head.T
    return z if softcap is None else torch.tanh(z / softcap) * softcap


def _autograd(x, head, targets, grad, softcap):  # type: ignore[no-untyped-def]
    """torch autograd of the plain formula, and each row's log-sum-exp."""
    leaves = [x.clone().requires_grad_(), head.clone().requires_grad_()]
    logits = _logits(*leaves, softcap)
    picked = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    grads = torch.autograd.grad((picked * grad.to(picked.dtype)).sum(), leaves)
    return grads, torch.logsumexp(logits.detach(), -1)


@pytest.mark.parametrize("softcap", [None, 3.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("columns", [None, 7, V], ids=["default", "7", "whole"])
def test_closed_form_is_autograd_in_float64(softcap: float | None, columns: int | None) -> None:
    x, head, targets, grad = _inputs(torch.float64)
    (ex, eh), lse = _autograd(x, head, targets, grad, softcap)
    gx, gh = head_logprob_grads(x, head, targets, lse, grad, softcap, columns)
    assert gx.dtype == gh.dtype == torch.float64
    assert relative(gx, ex) < 1e-12 and relative(gh, eh) < 1e-12


@pytest.mark.parametrize("softcap", [None, 3.0], ids=["plain", "softcap"])
def test_fused_dlogits_kernel_is_autograd(softcap: float | None) -> None:
    x, head, targets, grad = _inputs(torch.float64)
    (ex, eh), lse = _autograd(x, head, targets, grad, softcap)
    x32, head32, lse32 = x.float(), head.float(), lse.float()
    gx, gh = head_logprob_grads(x32, head32, targets, lse32, grad, softcap, 7, fused=True)
    assert gx.dtype == gh.dtype == torch.float32
    assert relative(gx, ex) < 1e-5 and relative(gh, eh) < 1e-5
    # bfloat16 rows and head (CUDA's case): bfloat16 gradients within bfloat16's rounding.
    gx, gh = head_logprob_grads(x.bfloat16(), head.bfloat16(), targets, lse32, grad, softcap, 7,
                                fused=True)  # fmt: skip
    assert gx.dtype == gh.dtype == torch.bfloat16
    assert relative(gx, ex) < 3e-2 and relative(gh, eh) < 3e-2
    # The control: the kernel with a shifted target.
    _, other = head_logprob_grads(x32, head32, (targets + 1) % V, lse32, grad, softcap, 7,
                                  fused=True)  # fmt: skip
    assert relative(other, eh) > 1e-3


def test_float32_within_rounding_and_bfloat16_heads() -> None:
    x, head, targets, grad = _inputs(torch.float64)
    (ex, eh), lse = _autograd(x, head, targets, grad, 3.0)
    gx, gh = head_logprob_grads(x.float(), head.float(), targets, lse.float(), grad, 3.0, 7)
    assert gx.dtype == gh.dtype == torch.float32
    assert relative(gx, ex) < 1e-5 and relative(gh, eh) < 1e-5
    # A bfloat16 model on the CPU: float32 rows, a bfloat16 head, float32 matmuls.
    gx, gh = head_logprob_grads(x.float(), head.bfloat16(), targets, lse.float(), grad, 3.0, 7)
    assert gx.dtype == torch.float32 and gh.dtype == torch.bfloat16
    assert relative(gh, eh) < 2e-2


def test_controls_move_the_gradient_past_the_bound() -> None:
    x, head, targets, grad = _inputs(torch.float64)
    (ex, eh), lse = _autograd(x, head, targets, grad, 3.0)
    forgotten_cap = head_logprob_grads(x, head, targets, lse, grad, None, 7)
    wrong_lse = head_logprob_grads(x, head, targets, lse + 0.1, grad, 3.0, 7)
    shifted = head_logprob_grads(x, head, (targets + 1) % V, lse, grad, 3.0, 7)
    for gx, gh in (forgotten_cap, wrong_lse, shifted):
        assert relative(gx, ex) > 1e-3 and relative(gh, eh) > 1e-3


class _PlainHead:
    """A small fake of the decoder's head for `token_logprobs`: plain torch logits (x W^T,
    soft-capped) and log-softmax."""

    def __init__(self, head: torch.Tensor, softcap: float | None) -> None:
        self.lm_head = head
        self.ops = SimpleNamespace(log_softmax=lambda z: torch.log_softmax(z, -1))
        self.spec = SimpleNamespace(final_logit_softcap=softcap, vocab_size=head.shape[0])

    def head_logits(self, x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        return _logits(x, head, self.spec.final_logit_softcap)


def test_rows_without_a_gradient_are_left_out_exactly() -> None:
    """Rows whose incoming gradient is 0 (prompt tokens) are skipped in the backward; the
    gradients are still autograd's, in row chunks of 5 and the whole batch alike."""
    x, head, targets, grad = _inputs(torch.float64)
    grad[10:18] = 0.0  # a prompt
    (ex, eh), _ = _autograd(x, head, targets, grad, 3.0)
    for rows in (5, None):
        leaves = [x.clone().requires_grad_(), head.clone().requires_grad_()]
        fake = _PlainHead(leaves[1], 3.0)
        picked = token_logprobs(fake, leaves[0], targets, rows)  # type: ignore[arg-type]
        gx, gh = torch.autograd.grad((picked * grad.double()).sum(), leaves)
        # The Function keeps a float32 log-sum-exp (its logprobs are float32): 1e-6.
        assert relative(gx, ex) < 1e-6 and relative(gh, eh) < 1e-6
        assert not gx[10:18].any()
        # The control: other targets give another gradient.
        shifted = token_logprobs(fake, leaves[0], (targets + 1) % V, rows)  # type: ignore[arg-type]
        _, other = torch.autograd.grad((shifted * grad.double()).sum(), leaves)
        assert relative(other, eh) > 1e-3
