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

from lockstep.ops.torch_fast import stock_gated_delta_rule
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
