"""The gradient of causal attention over a packed batch, in blocks (FlashAttention's
recompute backward, in plain torch): never more than one [Hq, block, block] tile of scores.

For each sequence and each block of its queries, two passes over the key blocks at or before
the block's last query:

    pass 1   the rows' softmax statistics by the online rule (running max m, sum l) and
             their output O = sum_j P_ij V_j; L = m + log l; delta_i = sum_d dO_id O_id
    pass 2   per key block: P = exp(S - L) (S = scale q k^T, causal mask on the diagonal
             block), dV += P^T dO, dS = P * (dO V^T - delta), dQ += scale dS K,
             dK += scale dS^T Q

which is the exact gradient of softmax(S) V written blockwise (delta_i = sum_j P_ij dP_ij).
Grouped-query heads: a key block is repeated over its query heads (head h reads KV head
h // group, transformers' repeat_kv) and its dK, dV are summed back over the group.

Everything runs in float32 (float64 stays float64), whatever the activation dtype: the
forward's values come from the engine's kernel, this is only its gradient. Keys of one
sequence are only its own rows, as in the forward (`AttentionMeta` from the packed layout).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Query and key rows per tile: scores are [Hq, BLOCK, BLOCK] at most. Larger tiles mean fewer
# torch calls (the loop is Python), smaller ones less memory.
BLOCK = 256


def blocked_attention_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    seq_lens: Sequence[int],
    scale: float,
    block: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq [T, Hq, D], dk, dv [T, Hkv, D]) of out = causal softmax(scale q k^T) v
    per packed sequence (rows cut by `seq_lens`), given dL/dout `grad_out` [T, Hq, D]. q, k,
    v are the attention's inputs after norms and RoPE; the result has their dtype, widened to
    float32 unless float64."""
    if block < 1:
        raise ValueError(f"block={block} is invalid: expected >= 1")
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, grad_out = (t.to(wide) for t in (q, k, v, grad_out))
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv or sum(seq_lens) != q.shape[0]:
        raise ValueError(f"{hq} query heads over {hkv} KV heads, {q.shape[0]} rows for "
                         f"lengths summing to {sum(seq_lens)}")  # fmt: skip
    group = hq // hkv
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    start = 0
    for n in seq_lens:
        rows = slice(start, start + n)
        _sequence_grads(q[rows], k[rows], v[rows], grad_out[rows], dq[rows], dk[rows],
                        dv[rows], scale, block, group)  # fmt: skip
        start += n
    return dq, dk, dv


def _heads_first(x: torch.Tensor, group: int = 1) -> torch.Tensor:
    """[n, H, D] -> [H * group, n, D], each head repeated `group` times (repeat_kv)."""
    x = x.transpose(0, 1)
    return x.repeat_interleave(group, 0) if group > 1 else x


def _group_sum(x: torch.Tensor, group: int) -> torch.Tensor:
    """[Hq, n, D] -> [n, Hkv, D]: the sum over each KV head's query heads."""
    if group > 1:
        x = x.unflatten(0, (-1, group)).sum(1)
    return x.transpose(0, 1)


def _scores(
    qb: torch.Tensor, k: torch.Tensor, rows: tuple[int, int], keys: tuple[int, int],
    scale: float, group: int,
) -> torch.Tensor:  # fmt: skip
    """The scores [Hq, bq, bk] of query rows `rows` (qb, heads first) against key rows `keys`,
    -inf where a key comes after its query."""
    (q0, q1), (k0, k1) = rows, keys
    s = (qb @ _heads_first(k[k0:k1], group).transpose(1, 2)) * scale
    if k1 > q0 + 1:  # some key lies after some query of the block
        after = (
            torch.arange(k0, k1, device=k.device)[None, :]
            > torch.arange(q0, q1, device=k.device)[:, None]
        )
        s = s.masked_fill(after, float("-inf"))
    return s


def _sequence_grads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, scale: float, block: int, group: int,
) -> None:  # fmt: skip
    """One sequence's gradients, accumulated into the views dq, dk, dv (module docstring)."""
    n = q.shape[0]
    for q0 in range(0, n, block):
        q1 = min(q0 + block, n)
        qb, dob = _heads_first(q[q0:q1]), _heads_first(do[q0:q1])  # [Hq, bq, D]
        key_blocks = [(k0, min(k0 + block, q1)) for k0 in range(0, q1, block)]
        m = torch.full(qb.shape[:2], float("-inf"), dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)  # noqa: E741 (the softmax's sum, as the literature names it)
        acc = torch.zeros_like(qb)
        for k0, k1 in key_blocks:
            s = _scores(qb, k, (q0, q1), (k0, k1), scale, group)
            m_new = torch.maximum(m, s.amax(-1))
            rescale = (m - m_new).exp()
            p = (s - m_new[..., None]).exp()
            l = l * rescale + p.sum(-1)  # noqa: E741
            acc = acc * rescale[..., None] + p @ _heads_first(v[k0:k1], group)
            m = m_new
        lse = m + l.log()
        delta = (dob * (acc / l[..., None])).sum(-1, keepdim=True)  # [Hq, bq, 1]
        dqb = torch.zeros_like(qb)
        for k0, k1 in key_blocks:
            s = _scores(qb, k, (q0, q1), (k0, k1), scale, group)
            p = (s - lse[..., None]).exp()
            vb = _heads_first(v[k0:k1], group)
            dv[k0:k1] += _group_sum(p.transpose(1, 2) @ dob, group)
            ds = p * (dob @ vb.transpose(1, 2) - delta)
            dqb += (ds @ _heads_first(k[k0:k1], group)) * scale
            dk[k0:k1] += _group_sum((ds.transpose(1, 2) @ qb) * scale, group)
        dq[q0:q1] += dqb.transpose(0, 1)
