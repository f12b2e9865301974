"""A speculative verify chunk's cut back (`LinearState.begin_verify` / `end_verify`,
lockstep/models/linear_attention.py) on the pooled Triton Gated DeltaNet path, the one the
GPU engine runs (the CPU engine loops over sequences: tests/contract/test_speculative_hybrid.py):
a Gated DeltaNet layer of tiny Qwen3.5 on the Triton backend (the interpreter without CUDA),
both rules. A verify step of n rows from position P, cut back to P + m (m = 1, 3, n), leaves the
state (window, boundary state, open rows) that computing the P + m kept rows alone leaves,
bit for bit, and the next step's outputs are that state's. Control: the window the verify step
left is not the cut back one (rebuilding it is part of what the comparison checks).
"""

from __future__ import annotations

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

GPU = torch.cuda.is_available()
if not GPU:  # the interpreter's tl.dot rounds by block shape: use the row-local one
    from test_ops_triton import _row_local_interpreter_dot

    _row_local_interpreter_dot()
DEV = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float32


# Few rows per chunk (the interpreter is slow); the chunked kernels take 16 or more.
@pytest.mark.parametrize(("kernel", "chunk"), [("recurrent", 8), ("chunked", 16)])
def test_verify_cut_back_equals_the_kept_rows_alone(kernel: str, chunk: int) -> None:
    from lockstep.models.decoder import Decoder
    from lockstep.models.forward_batch import ForwardBatch
    from lockstep.models.linear_attention import (
        LinearState,
        LinearStatePool,
        gated_deltanet,
        pooled_rows,
    )
    from lockstep.models.resolver import resolve_model
    from lockstep.ops.base import build_attention_meta
    from lockstep.ops.gpu_deterministic import GpuDeterministicOps

    decoder = Decoder.load(resolve_model("random:tiny-qwen3.5"), GpuDeterministicOps(), DTYPE, DEV)
    ops, spec = decoder.ops, decoder.spec
    first = next(i for i in range(spec.num_layers) if spec.is_linear(i))
    weights = decoder.layers[first].mixer
    # One linear layer (the decoder's first), its rule and a small chunk.
    layout = dataclasses.replace(decoder.linear_layout, chunk=chunk, kernel=kernel, num_layers=1)
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(chunk, spec.hidden_size, generator=gen).to(DEV, DTYPE)
    start, verify = 2, 5  # a verify chunk of 5 rows from P = 2 ends before the boundary

    def step(state: LinearState, begin: int, x: torch.Tensor) -> torch.Tensor:
        """The layer over rows x at positions begin.. of the state's sequence, pooled."""
        n = x.shape[0]
        positions = list(range(begin, begin + n))
        meta = build_attention_meta([n], [begin], [list(range(begin + n))])
        batch = ForwardBatch.from_lists([0] * n, positions, positions, meta, list(range(n)),
                                        [state]).to(DEV)  # fmt: skip
        pooled = pooled_rows(ops, [state], [n], layout)
        assert pooled is not None, "the Triton backend runs the pooled path"
        out = gated_deltanet(ops, x, weights, 0, batch, layout, weights.eps, [n], pooled,
                             state.pool, decoder.parallel)  # fmt: skip
        state.advance(n)
        return out

    def fresh() -> LinearState:
        return LinearState.resume(layout, None, LinearStatePool(layout, 1))

    moved = 0
    cuts = (1, 3, verify)  # the first row only, some drafts, every draft (the interpreter is slow)
    for kept in cuts:
        state = fresh()
        step(state, 0, rows[:start])
        # The verify rows: the kept ones, then rejected drafts' rows (other values).
        drafts = -rows[start + kept : start + verify]
        state.begin_verify()
        step(state, start, torch.cat([rows[start : start + kept], drafts]))
        after_verify = state.conv.clone()
        state.end_verify(start + kept)
        plain = fresh()
        step(plain, 0, rows[: start + kept])
        assert state.position == plain.position == start + kept
        for mine, theirs in zip(state.meaningful(), plain.meaningful(), strict=True):
            assert torch.equal(mine, theirs), kept
        # Rejected open rows are zero again, as a fresh state's.
        assert not state.open_k[:, (start + kept) % chunk :].any()
        moved += not torch.equal(after_verify, plain.conv)
        # The next step continues from the cut-back state as from the plain one.
        after = rows[start + kept : start + kept + 2]
        assert torch.equal(step(state, start + kept, after), step(plain, start + kept, after))
    assert moved == len(cuts) - 1  # every cut but the full one moved the window
