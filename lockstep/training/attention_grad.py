"""The gradient of causal attention over a packed batch, in tiles (FlashAttention's recompute
backward, in plain torch): scores exist one [Hq, block, block] tile per query block at a time,
so memory grows with the tokens, never with their square.

Each sequence's rows are cut into tiles of `block` rows at positions 0, block, 2 block, ...
(its last tile zero-padded). Query tile i of a sequence sees its key tiles 0..i. The pairs
(query tile i, key tile i - o) of every sequence form "offset o"; each offset is one batched
matmul over all of its pairs, so the Python loop runs max tiles per sequence times, not once
per pair:

    pass 1   over the offsets: each query row's softmax statistics by the online rule
             (running max m, sum l) and its output O = sum_j P_ij V_j; L = m + log l;
             delta_i = sum_d dO_id O_id
    pass 2   over the offsets: P = exp(S - L) (S = scale q k^T, causal mask at offset 0),
             dV += P^T dO, dS = P * (dO V^T - delta), dQ += scale dS K, dK += scale dS^T Q

which is the exact gradient of softmax(S) V written tile by tile (delta_i = sum_j P_ij dP_ij).
Padded rows hold zeros and a zero dO: they add nothing to dK, dV, and their dQ is dropped.
Grouped-query heads: a key tile is repeated over its query heads (head h reads KV head
h // group, transformers' repeat_kv) and its dK, dV are summed back over the group.

Everything runs in float32 (float64 stays float64), whatever the activation dtype: the
forward's values come from the engine's kernel, this is only its gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Rows per tile: scores are [pairs, Hq, BLOCK, BLOCK] with at most one pair per query tile.
BLOCK = 256


def blocked_attention_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    seq_lens: Sequence[int],
    scale: float,
    block: int = BLOCK,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq [T, Hq, D], dk [T, Hkv, D], dv [T, Hkv, Dv]) of out = causal
    softmax(scale q k^T) v per packed sequence (rows cut by `seq_lens`), given dL/dout
    `grad_out` [T, Hq, Dv]. q, k, v are the attention's inputs after norms and RoPE (v may be
    narrower than q and k: MLA's values); the result has their dtype, widened to float32
    unless float64. `window`: the row at position p sees keys p - window + 1 .. p only."""
    if block < 1:
        raise ValueError(f"block={block} is invalid: expected >= 1")
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv or sum(seq_lens) != q.shape[0]:
        raise ValueError(f"{hq} query heads over {hkv} KV heads, {q.shape[0]} rows for "
                         f"lengths summing to {sum(seq_lens)}")  # fmt: skip
    tiles = _Tiles(seq_lens, block, q.device)
    qt, kt, vt, dot = (tiles.cut(t.to(wide)) for t in (q, k, v, grad_out))  # [N, H, b, D]
    group = hq // hkv
    n, b = qt.shape[0], block
    m = torch.full((n, hq, b), float("-inf"), dtype=wide, device=q.device)
    l = torch.zeros_like(m)  # noqa: E741 (the softmax's sum, as the literature names it)
    acc = qt.new_zeros(*qt.shape[:-1], vt.shape[-1])
    pairs = tiles.pairs
    if window is not None:  # key tiles wholly outside every row's window add nothing
        pairs = [pair for offset, pair in enumerate(pairs) if (offset - 1) * b + 1 < window]
    for offset, (rows, keys) in enumerate(pairs):
        s = _scores(qt[rows], kt[keys], scale, group, offset, window)
        m_old = m[rows]
        m_new = torch.maximum(m_old, s.amax(-1))
        rescale = (m_old - m_new).exp()
        p = (s - m_new[..., None]).exp()
        l[rows] = l[rows] * rescale + p.sum(-1)
        acc[rows] = acc[rows] * rescale[..., None] + p @ _repeat(vt[keys], group)
        m[rows] = m_new
    lse = m + l.log()
    delta = (dot * (acc / l[..., None])).sum(-1, keepdim=True)  # [N, Hq, b, 1]
    dq, dk, dv = torch.zeros_like(qt), torch.zeros_like(kt), torch.zeros_like(vt)
    for offset, (rows, keys) in enumerate(pairs):
        q_rows, k_keys, do_rows = qt[rows], _repeat(kt[keys], group), dot[rows]
        s = _scores(q_rows, kt[keys], scale, group, offset, window)
        p = (s - lse[rows][..., None]).exp()
        dv.index_add_(0, keys, _group_sum(p.transpose(-1, -2) @ do_rows, group))
        ds = p * (do_rows @ _repeat(vt[keys], group).transpose(-1, -2) - delta[rows])
        dq.index_add_(0, rows, (ds @ k_keys) * scale)
        dk.index_add_(0, keys, _group_sum((ds.transpose(-1, -2) @ q_rows) * scale, group))
    return tiles.join(dq), tiles.join(dk), tiles.join(dv)


class _Tiles:
    """The packed rows cut into tiles of `block` rows per sequence, and the (query tile, key
    tile) index pairs of each offset (module docstring), as device tensors."""

    def __init__(self, seq_lens: Sequence[int], block: int, device: torch.device) -> None:
        self.block = block
        first, total = [], 0  # each sequence's first tile
        for n in seq_lens:
            first.append(total)
            total += _count(n, block)
        self.count = total
        # Each packed row's place among the tiles' rows.
        slot = [first[s] * block + j for s, n in enumerate(seq_lens) for j in range(n)]
        self.slot = torch.tensor(slot, dtype=torch.int64, device=device)
        deepest = max((_count(n, block) for n in seq_lens), default=0)
        pairs = []
        for offset in range(deepest):
            rows = [first[s] + i for s, n in enumerate(seq_lens)
                    for i in range(offset, _count(n, block))]  # fmt: skip
            keys = [r - offset for r in rows]
            pairs.append((torch.tensor(rows, device=device), torch.tensor(keys, device=device)))
        self.pairs = pairs

    def cut(self, x: torch.Tensor) -> torch.Tensor:
        """Packed rows [T, H, D] -> tiles [N, H, block, D] (padding rows zero)."""
        tiled = x.new_zeros(self.count * self.block, *x.shape[1:])
        tiled[self.slot] = x
        return tiled.unflatten(0, (self.count, self.block)).transpose(1, 2)

    def join(self, tiles: torch.Tensor) -> torch.Tensor:
        """Tiles [N, H, block, D] -> packed rows [T, H, D] (padding rows dropped)."""
        return tiles.transpose(1, 2).flatten(0, 1)[self.slot]


def _count(n: int, block: int) -> int:
    return -(-n // block)


def _repeat(x: torch.Tensor, group: int) -> torch.Tensor:
    """[N, Hkv, b, D] -> [N, Hkv * group, b, D], each KV head repeated (repeat_kv)."""
    return x.repeat_interleave(group, 1) if group > 1 else x


def _group_sum(x: torch.Tensor, group: int) -> torch.Tensor:
    """[N, Hq, b, D] -> [N, Hkv, b, D]: the sum over each KV head's query heads."""
    return x.unflatten(1, (-1, group)).sum(2) if group > 1 else x


def _scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, group: int, offset: int, window: int | None
) -> torch.Tensor:
    """[pairs, Hq, b, b] scores of query tiles q against the key tiles `offset` tiles
    before them: -inf where the key comes after the query (offset 0) or lies outside the
    query's `window` (a query row i and key row j are offset * b + i - j positions apart).
    A row whose keys in this tile are all masked adds nothing (its exp underflows to 0 in
    pass 2; pass 1 keeps its running max)."""
    s = (q @ _repeat(k, group).transpose(-1, -2)) * scale
    b = s.shape[-1]
    rows = torch.arange(b, device=s.device)
    apart = offset * b + rows[:, None] - rows[None, :]
    hidden = apart < 0
    if window is not None:
        hidden = hidden | (apart >= window)
    if hidden.any():
        s = s.masked_fill(hidden, float("-inf"))
    return s
