"""The training module's backward pieces on CUDA at Qwen3-8B's shapes (bfloat16), against a
float32 autograd of the plain formula:

  * the fused attention backward (lockstep/training/sdpa_grad.py; FlashAttention's kernels):
    32 query heads over 8 KV heads of 128, packed sequences of several lengths (padded groups
    among them): within twice the error of torch's own bfloat16 autograd of the same formula
    (or 1e-2) of the float32 gradient; no op it runs returns a tensor larger than a padded
    group's inputs (the fused kernels ran: SDPA's math fallback would build [G * H, L, L]
    scores, as the control, the full-matrix backward, does);
  * the LM head's closed-form backward (lockstep/training/token_logprobs.py) over a 151,936
    vocabulary: within twice the error of transformers' way (bfloat16 logits, float32
    log-softmax, autograd) of the float32 gradient, or 1e-2.

  * the fused attention-input backward (lockstep/ops/triton/attention_input_grad.py: q/k head
    RMSNorms and RoPE) over 4,096 rows of q|k|v: within twice the error of torch's bfloat16
    autograd of the same formula (or 1e-2) of the float32 gradient.

Each has a control that moves it past the bound (another cut of the rows; shifted targets;
the rotation turned the other way). Only where CUDA is present; the CPU runs the same checks
at small shapes (tests/unit/training/test_sdpa_backward.py, test_head_backward.py,
test_attention_input_grad.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.grad_checks import LargestTensor, relative

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

HQ, HKV, D = 32, 8, 128  # Qwen3-8B's attention
HIDDEN, VOCAB = 4096, 151936
SCALE = D**-0.5
LENS = [2048, 2048, 1500, 1450, 700, 3, 1]  # 2048, 2048 and 1500 share a padded call


def _dense_attention_grads(q, k, v, grad, lens):  # type: ignore[no-untyped-def]
    """Autograd of causal attention with each sequence's whole scores, in q's dtype."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    outs, start = [], 0
    for n in lens:
        qb, kb, vb = (x[start : start + n].transpose(0, 1) for x in leaves)
        kb, vb = kb.repeat_interleave(HQ // HKV, 0), vb.repeat_interleave(HQ // HKV, 0)
        scores = (qb @ kb.transpose(1, 2)) * SCALE
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        outs.append((weights @ vb).transpose(0, 1))
        start += n
    return torch.autograd.grad(torch.cat(outs), leaves, grad)


def test_fused_attention_backward_on_cuda() -> None:
    from lockstep.training.sdpa_grad import fused_attention_grads, length_groups

    assert any(len(g) > 1 for g in length_groups(LENS))  # padded calls are exercised
    gen = torch.Generator(device="cuda").manual_seed(0)
    t = sum(LENS)
    q = torch.randn(t, HQ, D, device="cuda", generator=gen) * 2
    k = torch.randn(t, HKV, D, device="cuda", generator=gen)
    v = torch.randn(t, HKV, D, device="cuda", generator=gen)
    grad = torch.randn(t, HQ, D, device="cuda", generator=gen)
    reference = _dense_attention_grads(q, k, v, grad, LENS)
    bf16 = [x.bfloat16() for x in (q, k, v, grad)]
    stock = _dense_attention_grads(*bf16, LENS)  # torch's own bf16 autograd, the yardstick

    with LargestTensor() as fused:
        ours = fused_attention_grads(q, k, v, grad, LENS, SCALE, dtype=torch.bfloat16)
    for name, g, e, s in zip("qkv", ours, reference, stock, strict=True):
        assert torch.isfinite(g).all(), name
        assert relative(g, e) <= max(2 * relative(s, e), 1e-2), name
    padded = max(len(g) * LENS[g[0]] for g in length_groups(LENS))
    bound = max(padded, t) * HQ * D  # a padded group's q, or the packed gradients
    assert fused.largest <= bound
    # The control: another cut of the same rows moves the gradient past the bound.
    moved = fused_attention_grads(q, k, v, grad, [2000, 2096, *LENS[2:]], SCALE,
                                  dtype=torch.bfloat16)  # fmt: skip
    assert relative(moved[1], reference[1]) > 1e-1
    # The control of the size bound: the full-matrix backward makes [H, L, L] scores.
    assert HQ * LENS[0] ** 2 > 2 * bound
    with LargestTensor() as dense:
        _dense_attention_grads(*bf16, LENS)
    assert dense.largest >= HQ * LENS[0] ** 2


def test_head_backward_on_cuda() -> None:
    from lockstep.training.token_logprobs import head_logprob_grads

    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = 2048
    x = torch.randn(rows, HIDDEN, device="cuda", generator=gen).bfloat16()
    head = (torch.randn(VOCAB, HIDDEN, device="cuda", generator=gen) * 0.02).bfloat16()
    targets = torch.randint(0, VOCAB, (rows,), device="cuda", generator=gen)
    grad = torch.randn(rows, device="cuda", generator=gen)

    def autograd(x: torch.Tensor, head: torch.Tensor, logits_dtype: torch.dtype, targets):  # type: ignore[no-untyped-def]
        leaves = [x.clone().requires_grad_(), head.clone().requires_grad_()]
        logits = (leaves[0] @ leaves[1].T).to(logits_dtype).float()
        picked = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
        return torch.autograd.grad((picked * grad).sum(), leaves), torch.logsumexp(logits, -1)

    (ex, eh), _ = autograd(x.float(), head.float(), torch.float32, targets)
    (sx, sh), lse = autograd(x, head, torch.bfloat16, targets)  # transformers' way
    gx, gh = head_logprob_grads(x, head, targets, lse, grad)
    assert gx.dtype == gh.dtype == torch.bfloat16
    assert relative(gx, ex) <= max(2 * relative(sx, ex), 1e-2)
    assert relative(gh, eh) <= max(2 * relative(sh, eh), 1e-2)
    # The control: the gradient of other targets is far from the reference.
    _, other = head_logprob_grads(x, head, (targets + 1) % VOCAB, lse, grad)
    assert relative(other, eh) > 1e-1


def test_attention_input_backward_on_cuda() -> None:
    from lockstep.ops.triton.attention_input_grad import attention_input_backward

    gen = torch.Generator(device="cuda").manual_seed(2)
    t, eps = 4096, 1e-6
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, device="cuda", generator=gen).bfloat16()
    qn = torch.rand(D, device="cuda", generator=gen) + 0.5
    kn = torch.rand(D, device="cuda", generator=gen) + 0.5
    positions = torch.arange(t, device="cuda")
    inv_freq = 1e6 ** -(torch.arange(0, D, 2, device="cuda", dtype=torch.float64) / D)
    angles = torch.arange(t, device="cuda", dtype=torch.float64)[:, None] * inv_freq
    cos, sin = angles.cos().float(), angles.sin().float()
    dq = torch.randn(t, HQ, D, device="cuda", generator=gen).bfloat16()
    dk = torch.randn(t, HKV, D, device="cuda", generator=gen).bfloat16()
    dv = torch.randn(t, HKV, D, device="cuda", generator=gen).bfloat16()

    def autograd(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        x = qkv.to(dtype).requires_grad_()
        weights = [qn.clone().requires_grad_(), kn.clone().requires_grad_()]
        q, k, v = x.split([HQ * D, HKV * D, HKV * D], dim=1)
        outs = []
        for part, heads, w in ((q, HQ, weights[0]), (k, HKV, weights[1])):
            h = part.reshape(t, heads, D)
            normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w).to(dtype)
            a, b = normed.chunk(2, -1)
            c, s = cos[:, None].to(dtype), sin[:, None].to(dtype)
            outs.append(torch.cat([a * c - b * s, b * c + a * s], -1))
        outs.append(v.reshape(t, HKV, D))
        return torch.autograd.grad(outs, [x, *weights], [g.to(dtype) for g in (dq, dk, dv)])

    ex, eq, ek = autograd(torch.float32)
    sx, sq, sk = autograd(torch.bfloat16)  # torch's own bf16 autograd, the yardstick
    gx, gq, gk = attention_input_backward(qkv, dq, dk, dv, qn, kn, eps, positions, cos, sin)
    assert gx.dtype == torch.bfloat16 and gq is not None and gk is not None
    assert relative(gx, ex) <= max(2 * relative(sx, ex), 1e-2)
    assert relative(gq, eq) <= max(2 * relative(sq, eq), 1e-2)
    assert relative(gk, ek) <= max(2 * relative(sk, ek), 1e-2)
    # The control: the rotation turned the other way is far from the reference.
    turned, _, _ = attention_input_backward(qkv, dq, dk, dv, qn, kn, eps, positions, cos, -sin)
    assert relative(turned, ex) > 1e-1
