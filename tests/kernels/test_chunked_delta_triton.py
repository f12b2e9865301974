"""The chunked gated delta rule's Triton kernels (lockstep/ops/triton/chunked_delta.py): one
prefill, any chunking (1, 7, C-1, C, C+1 rows per call, random) and one-row decode steps give
the same outputs, boundary states, state and open rows, bit for bit; batch-mates in a pooled
launch do not change a sequence's bits; the kernels compute the torch reference's formulas
(within rounding). Negative controls: chunks counted from a call's first row and another chunk
size change the bits. Without CUDA they run under the Triton interpreter (small shapes, the
row-local interpreter dot of test_ops_triton); with CUDA on the GPU at Qwen3.5's head sizes.
TRITON_INTERPRET must be set before triton is imported."""

from __future__ import annotations

import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch.nn.functional as F

from lockstep.ops import chunked_delta as reference
from lockstep.ops.base import PooledRows
from lockstep.ops.triton import chunked_delta

GPU = torch.cuda.is_available()
if not GPU:  # the interpreter's tl.dot rounds by block shape: use the row-local one
    from test_ops_triton import _row_local_interpreter_dot

    _row_local_interpreter_dot()
DEV = "cuda" if GPU else "cpu"
# (Hk, Hv, Dk, Dv, C): Qwen3.5-9B's heads on the GPU, small ones for the interpreter.
SHAPE = (16, 32, 128, 128, 32) if GPU else (1, 2, 16, 16, 16)
HK, HV, DK, DV, C = SHAPE
# Against the float32 torch reference: TF32x3 products on the GPU, exact fp32 here.
TOL = 2e-4 if GPU else 2e-5
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _inputs(n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(n, HK, DK, generator=gen), dim=-1) * DK**-0.5
    k = F.normalize(torch.randn(n, HK, DK, generator=gen), dim=-1)
    v = torch.randn(n, HV, DV, generator=gen)
    g = -torch.rand(n, HV, generator=gen) * 0.5
    beta = torch.rand(n, HV, generator=gen)
    return tuple(t.to(DEV).contiguous() for t in (q, k, v, g, beta))


def _fresh(chunk: int = C, slots: int | None = None) -> list[torch.Tensor]:
    shapes = ((HV, DK, DV), (chunk, HK, DK), (chunk, HV, DV), (chunk, HV), (chunk, HV))
    lead = () if slots is None else (slots,)
    return [torch.zeros((*lead, *s), device=DEV) for s in shapes]


def _run(split: list[int], inputs, state=None, start: int = 0, chunk: int = C):
    state = _fresh(chunk) if state is None else state
    outs, bounds = [], {}
    for n in split:
        part = [t[start : start + n].contiguous() for t in inputs]
        out, got = chunked_delta.chunked_delta_rule(*part, *state, start)
        outs.append(out)
        bounds.update({p: s.clone() for p, s in got})
        start += n
    return torch.cat(outs), bounds, state


def _meaningful(state: list[torch.Tensor], position: int) -> list[torch.Tensor]:
    r = position % state[1].shape[0]
    return [state[0], *(t[:r] for t in state[1:])]


def _splits(n: int) -> list[list[int]]:
    fixed = [[1] * n] + [[m] * (n // m) + [n % m] for m in (7, C - 1, C, C + 1)]
    rng = random.Random(1)
    for _ in range(1):
        split, left = [], n
        while left:
            split.append(rng.randint(1, left))
            left -= split[-1]
        fixed.append(split)
    return [[x for x in s if x] for s in fixed]


def test_any_split_and_decode_give_the_bits_of_one_prefill() -> None:
    n = 2 * C + 5
    inputs = _inputs(n)
    ref_out, ref_bounds, ref_state = _run([n], inputs)
    assert sorted(ref_bounds) == [C, 2 * C]
    for split in _splits(n):
        out, bounds, state = _run(split, inputs)
        assert torch.equal(out, ref_out), split
        assert bounds.keys() == ref_bounds.keys(), split
        assert all(torch.equal(bounds[p], ref_bounds[p]) for p in bounds), split
        for a, b in zip(_meaningful(state, n), _meaningful(ref_state, n), strict=True):
            assert torch.equal(a, b), split


def test_matches_the_torch_reference() -> None:
    n = 2 * C + 3
    inputs = _inputs(n, seed=3)
    out, bounds, _ = _run([n], inputs)
    cpu = [t.cpu() for t in inputs]
    want, want_bounds = reference.chunked_delta_rule(*cpu, *[t.cpu() for t in _fresh()], 0)
    assert (out.cpu() - want).abs().max() < TOL
    for p, s in want_bounds:
        assert (bounds[p].cpu() - s).abs().max() < TOL


def test_pooled_step_gives_each_sequence_its_bits_alone() -> None:
    """Three sequences in one pooled launch (a prefill across two boundaries, a one-row step
    onto a boundary, a resumed mid-chunk run) in slots 2, 0, 3: every output row, boundary
    state, state and open row equals the sequence run alone."""
    plan = [(0, 2 * C + 3), (C - 1, 1), (C + 5, 6)]  # (start, rows)
    slots = [2, 0, 3]
    pool = _fresh(slots=4)
    alone, pooled_in = [], []
    for i, (start, n) in enumerate(plan):
        state = _fresh()
        if start:  # the state at `start`, reached alone
            _run([start], _inputs(start, seed=10 + i), state)
        for t, s in zip(pool, state, strict=True):
            t[slots[i]] = s
        rows = _inputs(n, seed=20 + i)
        pooled_in.append(rows)
        out, bounds = chunked_delta.chunked_delta_rule(*rows, *state, start)
        alone.append((out, bounds, state))
    cat = [torch.cat(parts).contiguous() for parts in zip(*pooled_in, strict=True)]
    seqs = PooledRows.build([n for _, n in plan], [s for s, _ in plan], slots, C, cat[0].device)
    out, bounds = chunked_delta.chunked_delta_rule_pooled(*cat, *pool, seqs)
    r0 = 0
    for i, ((start, n), (want_out, want_bounds, want_state)) in enumerate(
        zip(plan, alone, strict=True)
    ):
        assert torch.equal(out[r0 : r0 + n], want_out), i
        got = [bounds[j] for j, (seq, _) in enumerate(seqs.boundaries) if seq == i]
        want = [s for p, s in want_bounds if p < start + n]
        assert len(got) == len(want) and all(map(torch.equal, got, want)), i
        mine = [t[slots[i]] for t in pool]
        for a, b in zip(_meaningful(mine, start + n), _meaningful(want_state, start + n),
                        strict=True):  # fmt: skip
            assert torch.equal(a, b), i
        r0 += n


def test_negative_control_chunk_relative_or_another_chunk_size_changes_the_bits() -> None:
    """The equalities above are not blind: the rows after the first 5 computed with chunks
    counted from their first row (from the true state at position 5), or the whole sequence
    with another chunk size (C / 2 on the GPU, where 2C = 64 at these heads needs 238,116
    bytes of shared memory, more than an H100's 232,448; 2C in the interpreter, where C / 2
    would be below the kernels' smallest, 16), give other bits than the absolute chunks of C."""
    n = 2 * C + 3
    inputs = _inputs(n, seed=4)
    ref_out, _, _ = _run([n], inputs)
    cpu = [t[:5].cpu() for t in inputs]
    tile = [torch.cat([r, r.new_zeros((C - 5, *r.shape[1:]))]) for r in cpu]
    _, at5 = reference.chunk_tile(torch.zeros(HV, DK, DV), *tile)
    state = _fresh()
    state[0].copy_(at5)
    shifted = [t[5:].contiguous() for t in inputs]
    relative, _, _ = _run([n - 5], shifted, state)  # position 0 of the grid at row 5
    assert not torch.equal(relative, ref_out[5:])
    assert (relative - ref_out[5:]).abs().max() < 1e-3  # the same math, other rounding
    other_c, _, _ = _run([n], inputs, chunk=C // 2 if GPU else 2 * C)
    assert not torch.equal(other_c, ref_out)


@pytest.mark.slow
def test_tiny_hybrid_decoder_chunked_pooled_split_equals_one_prefill() -> None:
    """The whole tiny Qwen3.5 decoder on the Triton backend with the chunked rule, its state
    in a slot of a state pool (the engine's pooled path: conv, WY, state and open-rows
    kernels): a prefill in three passes, one a one-row step onto a chunk boundary, gives the
    logits, K/V and linear state of one prefill, bit for bit; the open rows hold the betas
    only the chunked kernels keep (the layout's option reached them)."""
    import dataclasses

    from lockstep.models.decoder import Decoder, ScratchKV
    from lockstep.models.forward_batch import ForwardBatch
    from lockstep.models.linear_attention import LinearState, LinearStatePool
    from lockstep.models.resolver import resolve_model
    from lockstep.ops.base import build_attention_meta
    from lockstep.ops.gpu_deterministic import GpuDeterministicOps

    dtype = torch.bfloat16 if GPU else torch.float32
    decoder = Decoder.load(resolve_model("random:tiny-qwen3.5"), GpuDeterministicOps(), dtype, DEV)
    # Chunks of 16 keep every pass within 32 rows (the interpreter's matmul tile table
    # changes its K block above 32 rows, which changes the interpreter's rounding).
    chunk = 16
    layout = dataclasses.replace(decoder.linear_layout, chunk=chunk, kernel="chunked")
    n = chunk + 4
    tokens = [random.Random(2).randrange(512) for _ in range(n)]

    def passes(lay, sizes: tuple[int, ...]):
        state = LinearState.resume(lay, None, LinearStatePool(lay, 2))
        kv = ScratchKV(decoder.spec, n, dtype, torch.device(DEV))
        logits, start = [], 0
        for size in sizes:
            end = start + size
            positions = list(range(start, end))
            meta = build_attention_meta([size], [start], [list(range(end))])
            batch = ForwardBatch.from_lists(tokens[start:end], positions, positions, meta,
                                            list(range(size)), [state])  # fmt: skip
            logits.append(decoder.forward(batch.to(DEV), kv))
            start = end
        return torch.cat(logits), kv, state

    want, want_kv, want_state = passes(layout, (n,))
    got, kv, state = passes(layout, (chunk - 1, 1, 4))
    assert torch.equal(got, want)
    assert torch.equal(kv.k, want_kv.k) and torch.equal(kv.v, want_kv.v)
    for a, b in zip(state.meaningful(), want_state.meaningful(), strict=True):
        assert torch.equal(a, b)
    assert state.open_beta[:, : n % chunk].abs().min() > 0


def test_key_and_value_blocks_split_and_match_the_reference() -> None:
    """Keys of four blocks of `chunked_delta.KB` columns (the state carried in blocks, the
    dots accumulated block after block) and values of two:
    one-row steps and a random split give one prefill's outputs, boundary states and state
    bit for bit, and the outputs match the torch reference's formulas."""
    hk, hv, dk, dv, c, n = 1, 2, 128, 64, 16, 16 + 5
    gen = torch.Generator().manual_seed(7)
    x = [F.normalize(torch.randn(n, hk, dk, generator=gen), dim=-1) * dk**-0.5,
         F.normalize(torch.randn(n, hk, dk, generator=gen), dim=-1),
         torch.randn(n, hv, dv, generator=gen), -torch.rand(n, hv, generator=gen) * 0.5,
         torch.rand(n, hv, generator=gen)]  # fmt: skip
    x = [t.to(DEV).contiguous() for t in x]

    def run(split: list[int]) -> tuple[torch.Tensor, dict, torch.Tensor]:
        out, bounds, state = _run(split, x, [t.to(DEV) for t in _zeros(hk, hv, dk, dv, c)])
        return out, bounds, state[0]

    want, want_bounds, want_state = run([n])
    assert sorted(want_bounds) == [c]
    for split in ([1] * n, [5, 13, 3]):
        out, bounds, state = run(split)
        assert torch.equal(out, want), split
        assert all(torch.equal(bounds[p], want_bounds[p]) for p in want_bounds), split
        assert torch.equal(state, want_state), split
    ref, _ = reference.chunked_delta_rule(*[t.cpu() for t in x], *_zeros(hk, hv, dk, dv, c), 0)
    assert (want.cpu() - ref).abs().max() < TOL


def _zeros(hk: int, hv: int, dk: int, dv: int, c: int) -> list[torch.Tensor]:
    shapes = ((hv, dk, dv), (c, hk, dk), (c, hv, dv), (c, hv), (c, hv))
    return [torch.zeros(s) for s in shapes]
