"""The torch chunked gated delta rule (lockstep/ops/chunked_delta.py): a token's output and
every boundary state have the same bits however the rows arrive (one prefill, one row at a
time, any chunking), and the rule is the recurrence's math (float64 recurrence, within 1e-5).
Negative controls: chunks counted from each call's first row, or another chunk size, change
the bits, and the comparison sees it."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from lockstep.ops.chunked_delta import chunk_tile, chunked_delta_rule

# (Hk, Hv, Dk, Dv, C): grouped value heads, small enough for the CPU's row-local loops.
HK, HV, DK, DV, C = 1, 2, 8, 8, 8


def _inputs(n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(n, HK, DK, generator=gen), dim=-1) * DK**-0.5
    k = F.normalize(torch.randn(n, HK, DK, generator=gen), dim=-1)
    v = torch.randn(n, HV, DV, generator=gen)
    g = -torch.rand(n, HV, generator=gen) * 0.5
    beta = torch.rand(n, HV, generator=gen)
    return q, k, v, g, beta


def _fresh(chunk: int = C) -> list[torch.Tensor]:
    shapes = ((HV, DK, DV), (chunk, HK, DK), (chunk, HV, DV), (chunk, HV), (chunk, HV))
    return [torch.zeros(s) for s in shapes]


def _run(split: list[int], inputs: tuple[torch.Tensor, ...], chunk: int = C):
    state = _fresh(chunk)
    outs, bounds, start = [], {}, 0
    for n in split:
        part = [t[start : start + n] for t in inputs]
        out, got = chunked_delta_rule(*part, *state, start)
        outs.append(out)
        bounds.update({p: s.clone() for p, s in got})
        start += n
    return torch.cat(outs), bounds, state[0]


def _splits(n: int) -> list[list[int]]:
    fixed = [[1] * n, [7] * (n // 7) + [n % 7], [C - 1] * (n // (C - 1)) + [n % (C - 1)],
             [C] * (n // C) + [n % C], [C + 1] * (n // (C + 1)) + [n % (C + 1)]]  # fmt: skip
    rng = random.Random(1)
    for _ in range(3):
        split, left = [], n
        while left:
            split.append(rng.randint(1, left))
            left -= split[-1]
        fixed.append(split)
    return [[x for x in s if x] for s in fixed]


def test_any_split_gives_the_bits_of_one_prefill() -> None:
    n = 3 * C + 5
    inputs = _inputs(n)
    ref_out, ref_bounds, ref_state = _run([n], inputs)
    assert sorted(ref_bounds) == [C, 2 * C, 3 * C]
    for split in _splits(n):
        out, bounds, state = _run(split, inputs)
        assert torch.equal(out, ref_out), split
        assert bounds.keys() == ref_bounds.keys(), split
        assert all(torch.equal(bounds[p], ref_bounds[p]) for p in bounds), split
        assert torch.equal(state, ref_state), split


def _recurrence(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token in float64: S = e^g S; S += k (beta (v - S^T k))^T;
    out = S^T q."""
    q, k, v, g, beta = (t.double() for t in inputs)
    s = torch.zeros(HV, DK, DV, dtype=torch.float64)
    outs = []
    for t in range(q.shape[0]):
        kt = k[t].repeat_interleave(HV // HK, dim=0)
        qt = q[t].repeat_interleave(HV // HK, dim=0)
        s = s * g[t].exp()[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", s, kt))
        s = s + kt[:, :, None] * u[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", s, qt))
    return torch.stack(outs), s


def test_matches_the_recurrence() -> None:
    n = 2 * C + 3
    inputs = _inputs(n, seed=3)
    out, bounds, _ = _run([n], inputs)
    want, _ = _recurrence(inputs)
    assert (out.double() - want).abs().max() < 1e-5
    _, at_boundary = _recurrence(tuple(t[: 2 * C] for t in inputs))
    assert (bounds[2 * C].double() - at_boundary).abs().max() < 1e-5


def test_a_decode_row_gets_its_prefill_bits_from_a_partial_tile() -> None:
    """The tile with the rows after i zeroed (a decode step's tile) gives row i the bits of
    the whole tile (a prefill's)."""
    q, k, v, g, beta = _inputs(C, seed=5)
    state = torch.randn(HV, DK, DV, generator=torch.Generator().manual_seed(6)) * 0.1
    whole, _ = chunk_tile(state, q, k, v, g, beta)
    for i in range(C):
        cut = [torch.cat([t[: i + 1], torch.zeros_like(t[i + 1 :])]) for t in (q, k, v, g, beta)]
        part, _ = chunk_tile(state, *cut)
        assert torch.equal(part[: i + 1], whole[: i + 1]), i


def test_negative_control_chunks_counted_from_each_call_change_the_bits() -> None:
    """Chunk tiles started at each call's first row (the state carried through a partial
    tile), or another chunk size, give other bits than the absolute chunks: the equality
    above is not blind."""
    n = 2 * C + 3
    inputs = _inputs(n, seed=4)
    ref_out, _, _ = _run([n], inputs)
    state, outs, start = torch.zeros(HV, DK, DV), [], 0
    for size in (5, n - 5):
        left = size
        while left:  # chunk-relative: tiles from the call's first row
            m = min(left, C)
            rows = [t[start : start + m] for t in inputs]
            tile = [torch.cat([r, r.new_zeros((C - m, *r.shape[1:]))]) for r in rows]
            out, state = chunk_tile(state, *tile)
            outs.append(out[:m])
            start, left = start + m, left - m
    relative = torch.cat(outs)
    assert not torch.equal(relative, ref_out)
    assert (relative - ref_out).abs().max() < 1e-4  # the same math, other rounding
    other_c, _, _ = _run([n], inputs, chunk=C // 2)
    assert not torch.equal(other_c, ref_out)


def test_matches_the_recurrent_cpu_kernel() -> None:
    """Against the kernel it replaces when on (the CPU's per-row `gdn_rule`): the same outputs
    and boundary states within 1e-5, not the same bits."""
    from lockstep.ops.cpu_deterministic import CpuDeterministicOps

    n = 2 * C + 3
    inputs = _inputs(n, seed=7)
    out, bounds, _ = _run([n], inputs)
    shapes = ((HV, DK, DV), (C, HK, DK), (C, HV), (C, HV, DV))
    old, old_bounds = CpuDeterministicOps().gated_delta_rule(
        *inputs, *[torch.zeros(s) for s in shapes], 0
    )
    assert (out - old).abs().max() < 1e-5
    assert not torch.equal(out, old)
    for p, s in old_bounds:
        assert (bounds[p] - s).abs().max() < 1e-5


def test_chunk_tasks_cut_each_sequence_at_absolute_boundaries() -> None:
    """`PooledRows.build`'s chunk tasks (what the Triton kernels walk): 40 rows from position
    30 and one row at 31, chunks of 32, give (sequence, first position, first row, rows) =
    (0, 30, 0, 2), (0, 32, 2, 32), (0, 64, 34, 6), (1, 31, 40, 1)."""
    from lockstep.ops.base import PooledRows

    seqs = PooledRows.build([40, 1], [30, 31], [5, 6], 32, torch.device("cpu"))
    tasks = zip(*(getattr(seqs, f).tolist() for f in ("task_seq", "task_pos", "task_row",
                                                       "task_n")), strict=True)  # fmt: skip
    assert list(tasks) == [(0, 30, 0, 2), (0, 32, 2, 32), (0, 64, 34, 6), (1, 31, 40, 1)]
    assert seqs.task_cu.tolist() == [0, 3, 4] and seqs.task_count == 4
