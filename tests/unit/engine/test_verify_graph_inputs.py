"""Verify-step CUDA graphs' static inputs (lockstep/engine/cuda_graphs.py), on the CPU: a step
whose b sequences each verify Q rows, padded to a bucket of B sequences with copies of sequence
0's Q rows, gives each real row its eager bits and writes the same K/V (what every replay
computes; the graphs themselves run on the GPU: tests/gpu/test_gpu_speculative.py). Negative
control: padding that writes another token's K/V into sequence 0's slots changes the bits."""

from __future__ import annotations

import pytest
import torch

from lockstep.config import ConfigError, EngineConfig
from lockstep.engine.cuda_graphs import DecodeGraphRunner, _Staging, _StaticInputs
from lockstep.engine.engine import Engine
from lockstep.models.decoder import ScratchKV
from lockstep.models.forward_batch import ForwardBatch
from lockstep.ops.base import build_attention_meta

Q = 3  # the last token and two drafts
# Two sequences with 5 and 2 earlier tokens, each verifying Q rows after them.
TABLES = [list(range(0, 8)), [30, 31, 32, 33, 34]]
STARTS = [5, 2]
CPU = torch.device("cpu")


def _verify_batch(tokens: list[int], q: int = Q) -> ForwardBatch:
    positions = [p for s in STARTS for p in range(s, s + q)]
    slots = [t[p] for t, s in zip(TABLES, STARTS, strict=True) for p in range(s, s + q)]
    meta = build_attention_meta([q] * len(STARTS), STARTS, [t[: s + q] for t, s in
                                                           zip(TABLES, STARTS, strict=True)])  # fmt: skip
    return ForwardBatch.from_lists(tokens, positions, slots, meta, list(range(len(tokens))))


def _cache(engine: Engine, fill: list[int]) -> ScratchKV:
    """The sequences' earlier positions hold the K/V of `fill`'s tokens."""
    kv = ScratchKV(engine.decoder.spec, 64, engine.decoder.act_dtype, CPU)
    tokens = [t for s in STARTS for t in fill[:s]]
    positions = [p for s in STARTS for p in range(s)]
    slots = [t[p] for t, s in zip(TABLES, STARTS, strict=True) for p in range(s)]
    meta = build_attention_meta(STARTS, [0] * len(STARTS), TABLES)
    engine.decoder.forward(ForwardBatch.from_lists(tokens, positions, slots, meta, [0]), kv)
    return kv


def _static(batch: ForwardBatch, bb: int, cb: int = 16, q: int = Q) -> _StaticInputs:
    inputs = _StaticInputs(bb, cb, CPU, q=q)
    inputs.fill(batch, _Staging(CPU))
    return inputs


def _as_read(static: ForwardBatch) -> ForwardBatch:
    """The static batch with each sequence's slot table written out whole: the keys the GPU
    kernels read for sequence b are slot_table[cu_kv[b] : cu_kv[b] + kv_len[b]]; padding
    sequences point back at sequence 0's, which the CPU attention (non-decreasing cu_kv)
    does not take."""
    m = static.meta
    starts, lens, table = m.cu_kv.tolist(), m.kv_len.tolist(), m.slot_table.tolist()
    tables = [table[c : c + n] for c, n in zip(starts, lens, strict=False)]
    counts = (m.cu_q[1:] - m.cu_q[:-1]).tolist()
    meta = build_attention_meta(counts, m.q_start.tolist(), tables)
    return ForwardBatch(static.token_ids, static.positions, static.out_slots, meta,
                        static.logit_rows)  # fmt: skip


@pytest.fixture(scope="module", params=["random:tiny", "random:tiny-qwen3-moe"])
def engine(request):
    return Engine(EngineConfig(model=request.param, kv_tokens=256, num_threads=1))


def test_fill_repeats_sequence_zeros_rows_and_sets_the_constants() -> None:
    inputs = _static(_verify_batch([11, 12, 13, 21, 22, 23]), bb=4)
    s = inputs.batch
    assert s.token_ids.tolist() == [11, 12, 13, 21, 22, 23] + [11, 12, 13] * 2
    assert s.positions.tolist() == [5, 6, 7, 2, 3, 4] + [5, 6, 7] * 2
    assert s.out_slots.tolist() == [5, 6, 7, 32, 33, 34] + [5, 6, 7] * 2
    assert s.meta.cu_q.tolist() == [0, 3, 6, 9, 12]
    assert s.meta.q_start.tolist() == [5, 2, 5, 5]
    assert s.meta.kv_len.tolist() == [8, 5, 8, 8]
    assert s.meta.cu_kv.tolist() == [0, 8, 0, 0, 13]
    assert s.logit_rows.tolist() == list(range(12))
    assert (s.meta.max_q, s.meta.max_kv) == (Q, 16)


def test_fill_refuses_what_the_bucket_does_not_hold() -> None:
    with pytest.raises(ValueError, match="does not fill 2 sequences of 3 rows"):
        _static(_verify_batch([1, 2, 3, 4], q=2), bb=4, q=Q)  # 2 rows a sequence, not 3
    inputs = _StaticInputs(4, 16, CPU, q=Q)
    with pytest.raises(ValueError, match="pending tokens only at 1"):
        inputs.fill(_verify_batch([1] * 6), _Staging(CPU), ([(0, 0)], torch.zeros(1)))


def test_padded_verify_step_gives_eager_bits_and_writes_the_same_kv(engine) -> None:
    fill = [3, 1, 4, 1, 5]
    batch = _verify_batch([6, 5, 3, 5, 8, 9])
    kv_eager = _cache(engine, fill)
    want = engine.decoder.forward(batch, kv_eager)
    for bb in (2, 4, 8):
        kv = _cache(engine, fill)
        static = _as_read(_static(batch, bb).batch)
        got = engine.decoder.forward(static, kv)[: batch.num_tokens]
        assert torch.equal(got, want), bb
        assert torch.equal(kv.k, kv_eager.k) and torch.equal(kv.v, kv_eager.v), bb


def test_negative_control_padding_with_another_token_changes_bits(engine) -> None:
    fill = [3, 1, 4, 1, 5]
    batch = _verify_batch([6, 5, 3, 5, 8, 9])
    want = engine.decoder.forward(batch, _cache(engine, fill))
    static = _static(batch, 4).batch
    static.token_ids[6:] = 100  # padding sequences' tokens, still written to sequence 0's slots
    got = engine.decoder.forward(_as_read(static), _cache(engine, fill))[: batch.num_tokens]
    assert not torch.equal(got, want)


def test_can_run_takes_verify_steps_only_when_asked() -> None:
    runner = DecodeGraphRunner.__new__(DecodeGraphRunner)  # a CUDA-free runner for the rule
    runner.batch_buckets, runner.context_buckets = [1, 2, 4, 8], [2048]
    runner.state_pool, runner.verify_graphs = None, False
    verify, decode = _verify_batch([1] * 6), _verify_batch([1, 2], q=1)
    assert runner.can_run(decode) and not runner.can_run(verify)
    runner.verify_graphs = True
    assert runner.can_run(verify)  # bucket 2 x 3 rows <= 8
    runner.batch_buckets = [1, 2, 4]
    assert not runner.can_run(verify)  # 2 x 3 rows > the output's 4
    uneven = ForwardBatch.from_lists(
        [1] * 5, [5, 6, 7, 2, 3], [5, 6, 7, 32, 33],
        build_attention_meta([3, 2], STARTS, [TABLES[0][:8], TABLES[1][:4]]), [0],
    )  # fmt: skip
    runner.batch_buckets = [1, 2, 4, 8]
    assert not runner.can_run(uneven)  # sequences of 3 and 2 rows


def test_config_refuses_a_non_boolean() -> None:
    with pytest.raises(ConfigError, match=r"^verify_cuda_graphs='yes' is invalid"):
        EngineConfig(verify_cuda_graphs="yes")  # type: ignore[arg-type]
    assert not EngineConfig(device="cuda").use_verify_cuda_graphs  # off by default
    assert EngineConfig(device="cuda", verify_cuda_graphs=True).use_verify_cuda_graphs
    assert not EngineConfig(device="cuda", verify_cuda_graphs=True, cuda_graphs=False
                            ).use_verify_cuda_graphs  # fmt: skip
    assert not EngineConfig(device="cpu", verify_cuda_graphs=True).use_verify_cuda_graphs
