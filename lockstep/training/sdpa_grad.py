"""The gradient of causal attention over a packed batch by torch's fused attention and its own
backward (`F.scaled_dot_product_attention`: FlashAttention's kernels on CUDA in bfloat16 or
float16, the memory-efficient ones in float32, the fused CPU kernel on the CPU), never a
[n, n] score matrix.

The forward's values come from the engine's kernel; this is only its gradient, so it need not
have the engine's bits: the fused backward recomputes the scores tile by tile from q and k
in the forward's dtype with float32 accumulation, as transformers' own backward does.

Sequences of similar lengths are right-padded into one [G, H, L, D] batch, one fused call per
group (a batch of equal lengths is one group). The padding is exact: with a causal mask a
real row never sees a padded key (padded keys come after every real row), and a padded row
gets a zero output gradient, so it adds nothing to any real row's dK or dV (its dS is
P * (dO V^T - rowsum(dO * O)) = 0); its own gradients are dropped.

    sequences (rows of the packed batch)      group (G = 2, L = 5)
    a: a0 a1 a2 a3 a4                          a0 a1 a2 a3 a4
    b: b0 b1 b2 b3                             b0 b1 b2 b3 __   (__: zeros, dO = 0)

A group of equal lengths packed one after another (a batch of equal sequences, the usual
training batch) needs no padding: its [G, H, L, D] batch is a view of the packed rows, and
the gradients are written back by one slice copy each, with no index gathers or scatters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

# A group of sequences padded to its longest, L, may cost at most this many times its
# sequences' own attention work (sum of n^2, the causal score tiles): bounds the padding's
# waste while putting sequences of close lengths in one call.
PADDED_WORK = 1.25


def length_groups(seq_lens: Sequence[int], padded_work: float = PADDED_WORK) -> list[list[int]]:
    """The sequences (indices into `seq_lens`) cut into groups, each padded to its first (its
    longest): longest first, a sequence joins the open group while count * L^2 stays within
    `padded_work` times the group's sum of n^2, else it opens the next group."""
    order = sorted(range(len(seq_lens)), key=lambda b: (-seq_lens[b], b))
    groups: list[list[int]] = []
    work = 0
    for b in order:
        n = seq_lens[b]
        if groups:
            longest = seq_lens[groups[-1][0]]
            if (len(groups[-1]) + 1) * longest**2 <= padded_work * (work + n * n):
                groups[-1].append(b)
                work += n * n
                continue
        groups.append([b])
        work = n * n
    return groups


def fused_attention_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    seq_lens: Sequence[int],
    scale: float,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq [T, Hq, D], dk [T, Hkv, D], dv [T, Hkv, D], in q's dtype) of out = causal
    softmax(scale q k^T) v per packed sequence (rows cut by `seq_lens`), given dL/dout
    `grad_out` [T, Hq, D]; grouped-query heads (Hq a multiple of Hkv) read KV head h // group.
    `dtype`: the dtype the fused attention runs in (default q's; bfloat16 on CUDA takes
    FlashAttention's kernels). No sliding window, and values as wide as the keys: the blocked
    backward (training/attention_grad.py) takes those."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    if hq % hkv or sum(seq_lens) != t or v.shape[-1] != d:
        raise ValueError(f"{hq} query heads over {hkv} KV heads, value width {v.shape[-1]} for "
                         f"key width {d}, {t} rows for lengths summing to {sum(seq_lens)}")  # fmt: skip
    dtype = dtype or q.dtype
    starts = [0]
    for n in seq_lens:
        starts.append(starts[-1] + n)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for group in length_groups(seq_lens):
        lens = [seq_lens[b] for b in group]
        first, longest = starts[group[0]], lens[0]
        place: _Placement | _Slice
        if all(starts[b] == first + j * longest and seq_lens[b] == longest
               for j, b in enumerate(group)):  # fmt: skip
            # Equal lengths, one after another in the packed rows: the batch is a view.
            place = _Slice(first, len(group), longest, dtype)
        else:
            # Row i of sequence group[j] sits at slot j * L + i of the padded batch.
            rows = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in group])
            slots = torch.cat([torch.arange(n) + j * longest for j, n in enumerate(lens)])
            place = _Placement(rows.to(q.device), slots.to(q.device), len(group), longest, dtype)
        leaves = [place.pad(x).requires_grad_() for x in (q, k, v)]
        with torch.enable_grad():
            qp, kp, vp = leaves
            native_gqa = hq != hkv and _native_gqa(q.device, dtype)
            if hq != hkv and not native_gqa:  # autograd sums the repeats' gradients back
                kp, vp = kp.repeat_interleave(hq // hkv, 1), vp.repeat_interleave(hq // hkv, 1)
            out = F.scaled_dot_product_attention(
                qp, kp, vp, is_causal=True, scale=scale, enable_gqa=native_gqa
            )
        grads = torch.autograd.grad(out, leaves, place.pad(grad_out))
        for target, g in zip((dq, dk, dv), grads, strict=True):
            place.put(target, g)
    return dq, dk, dv


def _native_gqa(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fused kernel SDPA picks reads grouped KV heads itself (`enable_gqa`): the
    CPU's, and FlashAttention's on CUDA (bfloat16, float16). CUDA's float32 kernel
    (memory-efficient attention) does not: with `enable_gqa` SDPA would fall back to its math
    backend, which builds the [L, L] scores, so the KV heads are repeated instead."""
    return device.type == "cpu" or dtype in (torch.bfloat16, torch.float16)


class _Placement:
    """Where a group's packed rows sit in its padded [G, H, L, D] batch (module docstring)."""

    def __init__(self, rows: torch.Tensor, slots: torch.Tensor, count: int, longest: int,
                 dtype: torch.dtype) -> None:  # fmt: skip
        self.rows, self.slots, self.count, self.longest, self.dtype = (
            rows, slots, count, longest, dtype
        )  # fmt: skip

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Packed rows [T, H, D] -> the group's [G, H, L, D] in `dtype`, padding zeros."""
        out = x.new_zeros(self.count * self.longest, *x.shape[1:], dtype=self.dtype)
        out[self.slots] = x[self.rows].to(self.dtype)
        return out.unflatten(0, (self.count, self.longest)).transpose(1, 2)

    def put(self, target: torch.Tensor, x: torch.Tensor) -> None:
        """The group's rows of [G, H, L, D] `x` into their rows of packed `target` [T, H, D]
        (padding dropped)."""
        target[self.rows] = x.transpose(1, 2).flatten(0, 1)[self.slots].to(target.dtype)


class _Slice:
    """A group of `count` sequences of `length` rows each, packed one after another from row
    `first`: its [G, H, L, D] batch is a view of those rows (no padding, no index copies)."""

    def __init__(self, first: int, count: int, length: int, dtype: torch.dtype) -> None:
        self.rows = slice(first, first + count * length)
        self.count, self.length, self.dtype = count, length, dtype

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Packed rows [T, H, D] -> the group's [G, H, L, D] in `dtype` (a view where x has
        that dtype)."""
        return x[self.rows].to(self.dtype).unflatten(0, (self.count, self.length)).transpose(1, 2)

    def put(self, target: torch.Tensor, x: torch.Tensor) -> None:
        """[G, H, L, D] `x` into the group's rows of packed `target` [T, H, D]."""
        target[self.rows] = x.transpose(1, 2).flatten(0, 1)
