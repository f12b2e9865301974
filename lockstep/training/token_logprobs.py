"""Each row's log-probability of its target token, from the final-normed rows, chunk by chunk
of rows: the [T, vocab] float32 logits and log-probabilities never exist at once.

Forward: per chunk of rows, the decoder's own LM head (`Decoder.head_logits`: the head linear,
soft-capping) and the backend's log-softmax, then the target's entry. Every op is row-local
on a deterministic backend, so a row's value has the bits of the whole-batch computation
(`LLM.score`'s). Backward: per chunk, the same ops recomputed under autograd (the
differentiable ops' own backwards, lockstep/training/differentiable_ops.py) and
differentiated at the target entries; only the rows and the head are kept between the two.
"""

from __future__ import annotations

from typing import Any

import torch

from lockstep.models.decoder import Decoder

# Logit elements per chunk (2**26 float32: 256 MiB, about 440 rows of a 152k vocabulary).
CHUNK_ELEMENTS = 2**26


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        decoder: Decoder,
        rows: int,
        x: torch.Tensor,
        head: torch.Tensor,
        targets: torch.Tensor,
    ) -> torch.Tensor:
        ctx.decoder, ctx.rows = decoder, rows
        ctx.save_for_backward(x, head, targets)
        out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        for lo in range(0, x.shape[0], rows):
            out[lo : lo + rows] = _picked(decoder, x[lo : lo + rows], head, targets[lo : lo + rows])
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, head, targets = ctx.saved_tensors
        decoder, rows = ctx.decoder, ctx.rows
        grad_x = torch.zeros_like(x)
        grad_head = torch.zeros_like(head)
        for lo in range(0, x.shape[0], rows):
            g = grad[lo : lo + rows]
            if not g.any():
                continue
            x_leaf = x[lo : lo + rows].detach().requires_grad_()
            head_leaf = head.detach().requires_grad_()
            with torch.enable_grad():
                picked = _picked(decoder, x_leaf, head_leaf, targets[lo : lo + rows])
            gx, gh = torch.autograd.grad(picked, [x_leaf, head_leaf], g)
            grad_x[lo : lo + rows] = gx
            grad_head += gh
        return None, None, grad_x, grad_head, None


def _picked(
    decoder: Decoder, x: torch.Tensor, head: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    logprobs = decoder.ops.log_softmax(decoder.head_logits(x, head))
    return logprobs.gather(1, targets[:, None])[:, 0]


def token_logprobs(
    decoder: Decoder, x: torch.Tensor, targets: torch.Tensor, rows: int | None = None
) -> torch.Tensor:
    """float32 [R]: row r's log-probability of token `targets[r]` from the final-normed rows
    x [R, hidden] (`Decoder.hidden_states`), by the decoder's head and log-softmax, `rows`
    rows at a time (default: `CHUNK_ELEMENTS` logits per chunk); the gradient reaches x and
    the decoder's LM head weight."""
    if rows is None:
        rows = max(1, CHUNK_ELEMENTS // decoder.spec.vocab_size)
    if rows < 1:
        raise ValueError(f"rows={rows} is invalid: expected >= 1")
    return _ChunkedTokenLogprobs.apply(decoder, rows, x, decoder.lm_head, targets)
