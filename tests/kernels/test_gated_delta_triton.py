"""The Triton Gated DeltaNet kernels (lockstep/ops/triton/gated_delta.py) against the CPU
kernel's formula and transformers' stock chunked form, and the rule's split invariance, bit for
bit: one prefill, one-row decode steps and random chunkings give the same outputs and boundary
states. Without CUDA they run under the Triton interpreter (small shapes); with CUDA on the GPU
at Qwen3.5's head sizes. TRITON_INTERPRET must be set before triton is imported.
"""

from __future__ import annotations

import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch.nn.functional as F

from lockstep.ops.base import PooledRows
from lockstep.ops.torch_stock import stock_gated_delta_rule
from lockstep.ops.triton import gated_delta

GPU = torch.cuda.is_available()
if not GPU:  # the interpreter's tl.dot rounds by block shape: use the row-local one
    from test_ops_triton import _row_local_interpreter_dot

    _row_local_interpreter_dot()
DEV = "cuda" if GPU else "cpu"
# (Hk, Hv, Dk, Dv, C): Qwen3.5's heads on the GPU, small ones for the interpreter.
SHAPE = (4, 8, 128, 128, 32) if GPU else (1, 2, 16, 16, 16)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _inputs(n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    hk, hv, dk, dv, _ = SHAPE
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(n, hk, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(n, hk, dk, generator=gen), dim=-1)
    v = torch.randn(n, hv, dv, generator=gen)
    g = -torch.rand(n, hv, generator=gen) * 0.5
    beta = torch.rand(n, hv, generator=gen)
    return tuple(t.to(DEV).contiguous() for t in (q, k, v, g, beta))


def _fresh() -> list[torch.Tensor]:
    hk, hv, dk, dv, c = SHAPE
    return [torch.zeros(s, device=DEV) for s in ((hv, dk, dv), (c, hk, dk), (c, hv), (c, hv, dv))]


def _run(chunks: list[int], inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, dict]:
    state = _fresh()
    outs, bounds, start = [], {}, 0
    for n in chunks:
        part = [t[start : start + n].contiguous() for t in inputs]
        out, got = gated_delta.gated_delta_rule(*part, *state, start)
        outs.append(out)
        bounds.update({p: s.clone() for p, s in got})
        start += n
    return torch.cat(outs), bounds


def test_any_split_gives_the_bits_of_one_prefill() -> None:
    n = 2 * SHAPE[4] + 7
    inputs = _inputs(n)
    ref_out, ref_bounds = _run([n], inputs)
    assert sorted(ref_bounds) == [SHAPE[4], 2 * SHAPE[4]]
    rng = random.Random(1)
    splits = [[1] * n, [SHAPE[4] - 1, 2, n - SHAPE[4] - 1]]
    for _ in range(3):
        split, left = [], n
        while left:
            split.append(rng.randint(1, left))
            left -= split[-1]
        splits.append(split)
    for split in splits:
        out, bounds = _run(split, inputs)
        assert torch.equal(out, ref_out), split
        assert bounds.keys() == ref_bounds.keys()
        assert all(torch.equal(bounds[p], ref_bounds[p]) for p in bounds), split


def test_matches_the_stock_chunked_form() -> None:
    """Same math as transformers' chunked gated delta rule (float32, within 1e-4)."""
    n = 2 * SHAPE[4] + 7
    inputs = _inputs(n, seed=3)
    out, bounds = _run([n], inputs)
    want, _ = stock_gated_delta_rule(*(t.cpu() for t in inputs), _fresh()[0].cpu(), SHAPE[4])
    assert (out.cpu() - want).abs().max() < 1e-4
    _, at_boundary = stock_gated_delta_rule(
        *(t[: 2 * SHAPE[4]].cpu() for t in inputs), _fresh()[0].cpu(), SHAPE[4]
    )
    assert (bounds[2 * SHAPE[4]].cpu() - at_boundary).abs().max() < 1e-4


def test_negative_control_the_stock_form_depends_on_the_split() -> None:
    """The comparison above is not blind: transformers' form, chunked from each call's first
    row, gives other bits when the same rows arrive in another split."""
    n = 2 * SHAPE[4] + 7
    inputs = [t.cpu() for t in _inputs(n, seed=4)]
    whole, _ = stock_gated_delta_rule(*inputs, _fresh()[0].cpu(), SHAPE[4])
    head, state = stock_gated_delta_rule(*(t[:5] for t in inputs), _fresh()[0].cpu(), SHAPE[4])
    tail, _ = stock_gated_delta_rule(*(t[5:] for t in inputs), state, SHAPE[4])
    assert not torch.equal(torch.cat([head, tail]), whole)


def test_gates_norm_and_activations() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(37, 6, generator=gen) * 10, torch.randn(37, 6, generator=gen)
    a_log, dt = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    g, beta = gated_delta.gdn_gates(*(t.to(DEV) for t in (a, b, a_log, dt)))
    assert torch.allclose(g.cpu(), -a_log.exp() * F.softplus(a + dt), rtol=1e-5, atol=1e-6)
    assert torch.allclose(beta.cpu(), b.sigmoid(), rtol=1e-5, atol=1e-6)
    x = torch.randn(5, 48, generator=gen)
    y = gated_delta.l2_normalize(x.to(DEV), 1e-6, 0.5).cpu()
    assert torch.allclose(y, F.normalize(x, dim=-1) * 0.5, rtol=1e-5, atol=1e-6)
    z = torch.randn(5, 48, generator=gen)
    sig = gated_delta.gate_activation(x.to(DEV), z.to(DEV), "sigmoid").cpu()
    silu = gated_delta.gate_activation(x.to(DEV), z.to(DEV), "silu").cpu()
    assert torch.allclose(sig, x * z.sigmoid(), rtol=1e-5, atol=1e-6)
    assert torch.allclose(silu, x * F.silu(z), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_tiny_hybrid_decoder_split_equals_one_prefill() -> None:
    """The whole tiny Qwen3.5 decoder on the Triton backend (matmul, norms, the composed
    partial-rotary attention input, attention, the DeltaNet kernels): a prefill in three
    passes, one of them a one-row step across a chunk boundary, gives the logits, K/V and
    linear state of one prefill bit for bit."""
    import dataclasses

    from lockstep.models.decoder import Decoder, ScratchKV
    from lockstep.models.forward_batch import ForwardBatch
    from lockstep.models.resolver import resolve_model
    from lockstep.ops.base import build_attention_meta
    from lockstep.ops.gpu_deterministic import GpuDeterministicOps

    dtype = torch.bfloat16 if GPU else torch.float32
    ops = GpuDeterministicOps()
    decoder = Decoder.load(resolve_model("random:tiny-qwen3.5"), ops, dtype, DEV)
    # Chunks of 16 keep every pass within 32 rows: under the interpreter the matmul's tile
    # table changes its K block above 32 rows, which changes the interpreter's (not the
    # GPU's) rounding.
    chunk = 16
    decoder.linear_layout = dataclasses.replace(decoder.linear_layout, chunk=chunk)
    n = chunk + 4
    tokens = [random.Random(2).randrange(512) for _ in range(n)]
    want, ref = decoder.cold_prefill(tokens)
    kv = ScratchKV(decoder.spec, n, dtype, torch.device(DEV))
    state = decoder.new_linear_state()
    logits, start = [], 0
    for size in (chunk - 1, 1, 4):
        end = start + size
        positions = list(range(start, end))
        meta = build_attention_meta([size], [start], [list(range(end))])
        batch = ForwardBatch.from_lists(tokens[start:end], positions, positions, meta,
                                        list(range(size)), [state])  # fmt: skip
        logits.append(decoder.forward(batch.to(DEV), kv))
        start = end
    assert torch.equal(torch.cat(logits), want)
    assert torch.equal(kv.k, ref.k) and torch.equal(kv.v, ref.v)
    for a, b in zip(state.meaningful(), ref.linear_state.meaningful(), strict=True):
        assert torch.equal(a, b)


def _pool(slots: int) -> list[torch.Tensor]:
    hk, hv, dk, dv, c = SHAPE
    shapes = ((slots, hv, dk, dv), (slots, c, hk, dk), (slots, c, hv), (slots, c, hv, dv))
    return [torch.zeros(s, device=DEV) for s in shapes]


def test_pooled_step_gives_each_sequence_its_bits_alone() -> None:
    """Three sequences in one pooled launch (a prefill across two boundaries, a one-row step
    onto a boundary, a resumed mid-chunk run), in slots 2, 0, 3 of a pool: every output row,
    boundary state, state and open row equals the sequence run alone."""
    c = SHAPE[4]
    plan = [(0, 2 * c + 3), (c - 1, 1), (c + 5, 6)]  # (start, rows)
    slots = [2, 0, 3]
    alone, pooled_in = [], []
    pool = _pool(4)
    for seed, (start, n) in enumerate(plan):
        before = _inputs(start, seed=10 + seed) if start else None
        state = _fresh()
        if before is not None:  # the state at `start`, reached alone
            gated_delta.gated_delta_rule(*before, *state, 0)
        for t, s in zip(pool, state, strict=True):
            t[slots[seed]] = s
        rows = _inputs(n, seed=20 + seed)
        pooled_in.append(rows)
        out, bounds = gated_delta.gated_delta_rule(*rows, *state, start)
        alone.append((out, bounds, state))
    cat = [torch.cat(parts).contiguous() for parts in zip(*pooled_in, strict=True)]
    seqs = PooledRows.build([n for _, n in plan], [s for s, _ in plan], slots, c, cat[0].device)
    out, bounds = gated_delta.gated_delta_rule_pooled(*cat, *pool, seqs)
    r0 = 0
    for i, ((start, n), (want_out, want_bounds, want_state)) in enumerate(
        zip(plan, alone, strict=True)
    ):
        assert torch.equal(out[r0 : r0 + n], want_out), i
        r0 += n
        got = {p: bounds[b] for b, (seq, p) in enumerate(seqs.boundaries) if seq == i}
        end = start + n
        if end % c == 0:  # the last row's boundary: the state the slot ends in
            got[end] = pool[0][slots[i]]
        assert got.keys() == dict(want_bounds).keys(), i
        assert all(torch.equal(got[p], s) for p, s in want_bounds), i
        r = end % c
        for t, s, rows in zip(pool, want_state, (None, r, r, r), strict=True):
            want = s if rows is None else s[:rows]
            have = t[slots[i]] if rows is None else t[slots[i]][:rows]
            assert torch.equal(have, want), i
    # Control: the same rows with the first sequence's start one row later differ.
    pool2 = _pool(4)
    moved = PooledRows.build([n for _, n in plan], [1, c - 1, c + 5], slots, c, cat[0].device)
    out2, _ = gated_delta.gated_delta_rule_pooled(*cat, *pool2, moved)
    assert not torch.equal(out2[: plan[0][1]], alone[0][0])


def test_pooled_step_captures_only_the_kept_boundaries() -> None:
    """With `keep`, the boundary buffer holds only the kept crossings, each the bits of the
    full capture; outputs and the slots' states do not change."""
    c = SHAPE[4]
    plan = [(0, 3 * c + 2), (c + 3, 2 * c)]  # (start, rows): 3 and 2 crossings
    per_seq = [_inputs(n, seed=30 + i) for i, (_, n) in enumerate(plan)]
    cat = [torch.cat(p).contiguous() for p in zip(*per_seq, strict=True)]
    rows, starts = [n for _, n in plan], [s for s, _ in plan]
    full_pool, kept_pool = _pool(2), _pool(2)
    full = PooledRows.build(rows, starts, [0, 1], c, cat[0].device)
    kept = PooledRows.build(
        rows,
        starts,
        [0, 1],
        c,
        cat[0].device,
        keep=lambda seq, p: p in (2 * c, 3 * c) and seq == 0 or p == 2 * c,
    )
    out_full, b_full = gated_delta.gated_delta_rule_pooled(*cat, *full_pool, full)
    out_kept, b_kept = gated_delta.gated_delta_rule_pooled(*cat, *kept_pool, kept)
    assert kept.boundaries == [(0, 2 * c), (0, 3 * c), (1, 2 * c)]
    assert b_kept.shape[0] == 3 and b_full.shape[0] == 5
    for i, bound in enumerate(kept.boundaries):
        assert torch.equal(b_kept[i], b_full[full.boundaries.index(bound)]), bound
    assert torch.equal(out_kept, out_full)
    assert all(torch.equal(a, b) for a, b in zip(full_pool, kept_pool, strict=True))
    # Control: a different kept set puts other states in the buffer.
    assert not torch.equal(b_kept[0], b_full[0])


def test_pooled_conv_is_the_per_sequence_formula() -> None:
    """The pooled short convolution + SiLU, the boundary windows and the window update equal
    the per-sequence torch formula of lockstep.models.linear_attention, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    cd, kk, c = 40, 4, 8
    plan, slots = [(0, 19), (7, 1), (13, 4)], [1, 2, 0]
    windows = torch.randn(3, kk - 1, cd, generator=gen).to(DEV)
    weight = torch.randn(cd, kk, generator=gen).to(DEV)
    total = sum(n for _, n in plan)
    # A strided, low-precision input as the fused projection gives it.
    proj = torch.randn(total, cd + 9, generator=gen).to(DEV, torch.bfloat16)
    mixed = proj[:, :cd]
    seqs = PooledRows.build([n for _, n in plan], [s for s, _ in plan], slots, c, DEV)
    before = windows.clone()
    act = gated_delta.causal_conv_silu_pooled(mixed, windows, weight, seqs)
    found = gated_delta.update_conv_windows(mixed, windows, weight, seqs)
    r0 = 0
    for i, (start, n) in enumerate(plan):
        rows = torch.cat([before[slots[i]], mixed[r0 : r0 + n].float()])
        conv = rows[0:n] * weight[:, 0]
        for k in range(1, kk):
            conv = conv + rows[k : k + n] * weight[:, k]
        want = gated_delta.gate_activation(torch.ones_like(conv), conv.contiguous(), "silu")
        assert torch.equal(act[r0 : r0 + n], want), i
        assert torch.equal(windows[slots[i]], rows[n : n + kk - 1]), i
        for b, (seq, p) in enumerate(seqs.boundaries):
            if seq == i:
                assert torch.equal(found[b], rows[p - start : p - start + kk - 1]), (i, p)
        r0 += n
    assert seqs.boundaries == [(0, 8), (0, 16), (2, 16)]
    # Control: another slot's window gives other rows for the first outputs.
    other = PooledRows.build([n for _, n in plan], [s for s, _ in plan], [0, 2, 1], c, DEV)
    moved = gated_delta.causal_conv_silu_pooled(mixed, before.clone(), weight, other)
    assert not torch.equal(moved[:1], act[:1])


@pytest.mark.slow
def test_tiny_hybrid_decoder_pooled_batch_equals_each_alone() -> None:
    """The tiny Qwen3.5 decoder on the Triton backend, two sequences in one pooled step (one
    resumed mid-chunk, one from 0 across a boundary): the logits, K/V and linear states of
    each sequence computed alone (a state of its own, the per-sequence loop) bit for bit."""
    import dataclasses

    from lockstep.models.decoder import Decoder, ScratchKV
    from lockstep.models.forward_batch import ForwardBatch
    from lockstep.models.linear_attention import LinearState, LinearStatePool
    from lockstep.models.resolver import resolve_model
    from lockstep.ops.base import build_attention_meta
    from lockstep.ops.gpu_deterministic import GpuDeterministicOps

    dtype = torch.bfloat16 if GPU else torch.float32
    decoder = Decoder.load(resolve_model("random:tiny-qwen3.5"), GpuDeterministicOps(), dtype, DEV)
    chunk = 8  # few rows per pass: the interpreter is slow (and see the test above)
    decoder.linear_layout = layout = dataclasses.replace(decoder.linear_layout, chunk=chunk)
    rng = random.Random(3)
    seqs = [[rng.randrange(512) for _ in range(n)] for n in (chunk + 3, 5)]
    first = 3  # sequence 0 resumes at 3, sequence 1 starts at 0

    def run(states: list[LinearState], parts: list[tuple[int, int, int]], kv: ScratchKV):
        """One step over (sequence, start, end) parts; K/V slots: sequence * 64 + position."""
        tokens, positions, slots, q_counts, tables, logit_rows = [], [], [], [], [], []
        for seq, start, end in parts:
            tokens += seqs[seq][start:end]
            positions += range(start, end)
            slots += [seq * 64 + p for p in range(start, end)]
            q_counts.append(end - start)
            tables.append([seq * 64 + p for p in range(end)])
            logit_rows += range(len(logit_rows), len(logit_rows) + end - start)
        meta = build_attention_meta(q_counts, [s for _, s, _ in parts], tables)
        batch = ForwardBatch.from_lists(tokens, positions, slots, meta, logit_rows, states)
        return decoder.forward(batch.to(DEV), kv)

    kv_alone = ScratchKV(decoder.spec, 128, dtype, torch.device(DEV))
    alone_states = [decoder.new_linear_state(), decoder.new_linear_state()]
    run(alone_states[:1], [(0, 0, first)], kv_alone)
    want = [run(alone_states[:1], [(0, first, len(seqs[0]))], kv_alone),
            run(alone_states[1:], [(1, 0, len(seqs[1]))], kv_alone)]  # fmt: skip
    kv = ScratchKV(decoder.spec, 128, dtype, torch.device(DEV))
    pool = LinearStatePool(layout, 3)
    states = [LinearState.resume(layout, None, pool), LinearState.resume(layout, None, pool)]
    run(states[:1], [(0, 0, first)], kv)
    got = run(states, [(0, first, len(seqs[0])), (1, 0, len(seqs[1]))], kv)
    assert torch.equal(got, torch.cat(want))
    assert torch.equal(kv.k, kv_alone.k) and torch.equal(kv.v, kv_alone.v)
    for mine, theirs in zip(states, alone_states, strict=True):
        assert mine.position == theirs.position
        assert all(torch.equal(a, b) for a, b in zip(mine.meaningful(), theirs.meaningful(),
                                                     strict=True))  # fmt: skip
        assert mine.captured.keys() == theirs.captured.keys()
        for p, snap in theirs.captured.items():
            assert torch.equal(mine.captured[p].conv, snap.conv)
            assert torch.equal(mine.captured[p].recurrent, snap.recurrent)
    assert states[0].captured.keys() == {chunk}  # the boundary the step crossed
