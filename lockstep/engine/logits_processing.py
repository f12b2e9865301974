"""Logits processing: what a request's own parameters and tokens do to its logits row before
the token choice (`sampler.choose_token_tensor`). vLLM's order and formulas, on float32:

1. structured output: tokens the request's grammar does not allow next become -inf;
2. bad words: the last token of a bad word whose other tokens end the output becomes -inf;
3. min_tokens: while the output is shorter, EOS and stop_token_ids become -inf;
4. logit_bias: x + float32(bias) for each listed token;
5. repetition penalty r, over the tokens in the prompt or the output: x / r if x > 0, else
   x * r;
6. frequency penalty f and presence penalty p, over the output: x - f * count, then
   x - p * (count > 0) (count as float32).

Each step is one IEEE-754 basic operation per element (or a select), and a feature a row does
not use is its exact identity (x / 1, x * 1, x - 0 * c, a mask of all true), so a row's
result depends on its own request only, whatever its batch-mates use; the GPU and CPU compute
the same bits. This runs eagerly after the forward (outside CUDA graphs), on the rows of the
requests that process logits; the others are untouched. Reported logprobs stay those of the
raw logits (vLLM's default `raw_logprobs`).

The grammar's bitmask is computed on the host (llguidance) while the device runs the
forward. With overlapped decode, a step launched ahead enqueues its forward at once and its
processing and choice after the host has the previous step's tokens (`ModelRunner.sample`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from lockstep.engine.grammar import bitmask_words, fill_bitmasks

if TYPE_CHECKING:
    from lockstep.engine.request import Request


def _device_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def banned_tokens(request: Request) -> list[int]:
    """Tokens the request may not choose next, besides its grammar's: the last token of each
    bad word whose other tokens end the output, and, while the output is shorter than
    min_tokens, its stop ids (EOS unless ignored, and stop_token_ids)."""
    params, output = request.params, request.output_ids
    banned: set[int] = set()
    for word in request.bad_word_ids:
        head = len(word) - 1
        if head == 0 or (len(output) >= head and output[len(output) - head :] == word[:-1]):
            banned.add(word[-1])
    if len(output) < params.min_tokens:
        banned.update(request.stop_ids)
    return sorted(banned)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [R, vocab_size] from int32 [R, words]: token t is allowed if bit t % 32 of word
    t // 32 is set."""
    ids = torch.arange(vocab_size, device=bitmask.device)
    words = bitmask.index_select(1, ids >> 5)
    return ((words >> (ids & 31).to(torch.int32)) & 1).bool()


def process_logits(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """The processed float32 logits [R, V] of `requests` (row r is requests[r]'s raw logits
    row). Rows of requests that process nothing
    are returned as they are; `logits` itself is not modified."""
    rows = [i for i, r in enumerate(requests) if r.params.processes_logits]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[1]
    index = _device_tensor(rows, torch.int64, device)
    x = logits.index_select(0, index)
    chosen = [requests[i] for i in rows]
    x = _apply_grammar(x, chosen)
    x = _apply_bans(x, chosen)
    x = _apply_logit_bias(x, chosen)
    x = _apply_penalties(x, chosen, vocab)
    out = logits.clone()
    out.index_copy_(0, index, x)
    return out


def _apply_grammar(x: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    constrained = [(i, r.grammar) for i, r in enumerate(requests) if r.grammar is not None]
    if not constrained:
        return x
    vocab = x.shape[1]
    bitmask = torch.full((len(requests), bitmask_words(vocab)), -1, dtype=torch.int32,
                         pin_memory=x.device.type == "cuda")  # fmt: skip
    fill_bitmasks([(grammar, i) for i, grammar in constrained], bitmask)
    allowed = unpack_bitmask(bitmask.to(x.device, non_blocking=True), vocab)
    return torch.where(allowed, x, -torch.inf)


def _apply_bans(x: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    pairs = [(i, t) for i, r in enumerate(requests) for t in banned_tokens(r)]
    if not pairs:
        return x
    flat = _device_tensor([i * x.shape[1] + t for i, t in pairs], torch.int64, x.device)
    x = x.clone()
    x.view(-1).index_fill_(0, flat, -torch.inf)
    return x


def _apply_logit_bias(x: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    entries = [(i, t, b) for i, r in enumerate(requests) for t, b in r.params.logit_bias]
    if not entries:
        return x
    v = x.shape[1]
    flat = _device_tensor([i * v + t for i, t, _ in entries], torch.int64, x.device)
    bias = _device_tensor([b for _, _, b in entries], torch.float32, x.device)
    out = x.view(-1)
    # Each (row, token) once: one float32 addition per biased element.
    return out.index_copy(0, flat, out.index_select(0, flat) + bias).view_as(x)


def _apply_penalties(x: torch.Tensor, requests: list[Request], vocab: int) -> torch.Tensor:
    penalized = [
        i
        for i, r in enumerate(requests)
        if r.params.repetition_penalty != 1.0 or r.params.frequency_penalty
        or r.params.presence_penalty
    ]  # fmt: skip
    if not penalized:
        return x
    device, k = x.device, len(requests)
    # Output counts of every processed row (rows without penalties get neutral factors).
    out_flat = [i * vocab + t for i in penalized for t in requests[i].output_ids]
    counts = torch.zeros(k * vocab, dtype=torch.int32, device=device)
    if out_flat:
        ones = torch.ones(len(out_flat), dtype=torch.int32, device=device)
        counts.index_add_(0, _device_tensor(out_flat, torch.int64, device), ones)
    counts = counts.view(k, vocab)
    rep_rows = [i for i in penalized if requests[i].params.repetition_penalty != 1.0]
    if rep_rows:
        seen = counts > 0
        prompt_flat = [i * vocab + t for i in rep_rows for t in requests[i].prompt_token_set]
        if prompt_flat:
            seen.view(-1).index_fill_(0, _device_tensor(prompt_flat, torch.int64, device), True)
        r = _device_tensor([requests[i].params.repetition_penalty for i in range(k)],
                           torch.float32, device)[:, None]  # fmt: skip
        factor = torch.where(seen, r, 1.0)
        x = torch.where(x > 0, x / factor, x * factor)
    freq = _device_tensor([r.params.frequency_penalty for r in requests], torch.float32, device)
    pres = _device_tensor([r.params.presence_penalty for r in requests], torch.float32, device)
    x = x - freq[:, None] * counts.to(torch.float32)
    return x - pres[:, None] * (counts > 0).to(torch.float32)
