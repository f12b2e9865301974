"""The piecewise CUDA graphs' arithmetic, on the CPU: a step of T rows padded to a bucket of B
with copies of row 0, attention run on the T rows into a static output whose padding rows
hold finite stale values, gives each real row its eager bits (what every replay computes;
the graphs themselves run on the GPU: tests/gpu/test_gpu_piecewise_graphs.py)."""

from __future__ import annotations

import pytest
import torch

from lockstep.config import ConfigError, EngineConfig
from lockstep.engine import memory
from lockstep.engine.engine import Engine
from lockstep.engine.piecewise_graphs import (
    attend_into,
    forward_with_holes,
    padded_rows,
    supports,
)
from lockstep.models.decoder import ScratchKV
from lockstep.models.forward_batch import ForwardBatch
from lockstep.ops.base import build_attention_meta

# A mixed step: a decode row (sequence 0, position 6), a 5-token prompt chunk (sequence 1,
# positions 3..7) and a 2-token chunk (sequence 2, positions 0..1).
TABLES = [list(range(0, 7)), list(range(20, 28)), [40, 41]]
COUNTS, STARTS = [1, 5, 2], [6, 3, 0]


def _batch(tokens: list[int]) -> ForwardBatch:
    positions = [p for n, s in zip(COUNTS, STARTS, strict=True) for p in range(s, s + n)]
    slots = [t[p] for t, n, s in zip(TABLES, COUNTS, STARTS, strict=True)
             for p in range(s, s + n)]  # fmt: skip
    meta = build_attention_meta(COUNTS, STARTS, TABLES)
    return ForwardBatch.from_lists(tokens, positions, slots, meta, [0, 5, 7])


def _cache(engine: Engine, fill: list[int]) -> ScratchKV:
    """A KV cache whose earlier positions hold the K/V of `fill` (one eager prefill of every
    sequence's tokens before the step), so that the step attends to real keys."""
    spec = engine.decoder.spec
    kv = ScratchKV(spec, 64, engine.decoder.act_dtype, torch.device("cpu"))
    tokens, positions, slots, counts, starts, tables = [], [], [], [], [], []
    for table, start in zip(TABLES, STARTS, strict=True):
        if start:
            tokens += fill[:start]
            positions += list(range(start))
            slots += table[:start]
            counts.append(start)
            starts.append(0)
            tables.append(table)
    meta = build_attention_meta(counts, starts, tables)
    engine.decoder.forward(ForwardBatch.from_lists(tokens, positions, slots, meta, [0]), kv)
    return kv


def _padded(batch: ForwardBatch, b: int, rows: torch.Tensor | None = None) -> ForwardBatch:
    rows = padded_rows(batch, b) if rows is None else rows
    return ForwardBatch(rows[0], rows[1], rows[2], batch.meta, batch.logit_rows)


def _piecewise_logits(engine: Engine, batch: ForwardBatch, kv: ScratchKV, b: int,
                      rows: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """What a replay computes: the padded step, attention on the T real rows written into a
    static o (stale values before), row 0's output copied to its padding rows."""
    decoder, t = engine.decoder, batch.num_tokens
    spec, ops = decoder.spec, decoder.ops
    o_static = torch.full((b, spec.num_heads, spec.head_dim), 0.25, dtype=decoder.act_dtype)

    def hole(q, layer_kv, meta, scale, window):
        attend_into(ops, q[:t], layer_kv, meta, scale, window, o_static)
        return o_static

    hidden = forward_with_holes(decoder, _padded(batch, b, rows), kv, hole)
    return decoder.head_logits(hidden.index_select(0, batch.logit_rows))


@pytest.fixture(scope="module", params=["random:tiny", "random:tiny-qwen3-moe"])
def engine(request):
    return Engine(EngineConfig(model=request.param, kv_tokens=256, num_threads=1))


def test_padded_rows_repeat_row_zero() -> None:
    batch = _batch([7, 8, 9, 10, 11, 12, 13, 14])
    rows = padded_rows(batch, 12)
    assert rows[0].tolist() == [7, 8, 9, 10, 11, 12, 13, 14, 7, 7, 7, 7]
    assert rows[1].tolist() == [6, 3, 4, 5, 6, 7, 0, 1, 6, 6, 6, 6]
    assert rows[2].tolist() == [6, 23, 24, 25, 26, 27, 40, 41, 6, 6, 6, 6]
    with pytest.raises(ValueError, match="8 rows do not fit a bucket of 4"):
        padded_rows(batch, 4)


def test_padded_step_with_static_attention_output_gives_eager_bits(engine) -> None:
    fill = [3, 1, 4, 1, 5, 9, 2]
    tokens = [6, 5, 3, 5, 8, 9, 7, 9]
    batch = _batch(tokens)
    want = engine.decoder.forward(batch, _cache(engine, fill))
    for b in (8, 16, 48):
        got = _piecewise_logits(engine, batch, _cache(engine, fill), b)
        assert torch.equal(got, want), b


def test_negative_control_padding_that_is_not_row_zero_changes_bits(engine) -> None:
    """Padding rows that write other K/V into row 0's slot (another token there): the real
    rows read it, and the comparison above sees the difference."""
    fill = [3, 1, 4, 1, 5, 9, 2]
    batch = _batch([6, 5, 3, 5, 8, 9, 7, 9])
    want = engine.decoder.forward(batch, _cache(engine, fill))
    rows = padded_rows(batch, 16)
    rows[0, 8:] = 100  # another token, still written to row 0's slot
    rows[2, 8:] = batch.out_slots[1]  # ... and to sequence 1's first new key
    got = _piecewise_logits(engine, batch, _cache(engine, fill), 16, rows)
    assert not torch.equal(got, want)


def test_supports_names_why_not() -> None:
    engine = Engine(EngineConfig(model="random:tiny", kv_tokens=64, num_threads=1))
    assert supports(engine.decoder) == "device cpu is not CUDA"
    hybrid = Engine(EngineConfig(model="random:tiny-qwen3.5", kv_tokens=64, num_threads=1))
    assert supports(hybrid.decoder).startswith("step hooks (")  # the linear states' hook


def test_config_refuses_a_non_boolean() -> None:
    with pytest.raises(ConfigError, match=r"^piecewise_cuda_graphs='yes' is invalid"):
        EngineConfig(piecewise_cuda_graphs="yes")  # type: ignore[arg-type]
    assert not EngineConfig(device="cpu", piecewise_cuda_graphs=True).use_piecewise_cuda_graphs


def test_reservation_counts_the_piecewise_pool() -> None:
    engine = Engine(EngineConfig(model="random:tiny", kv_tokens=64, num_threads=1))
    spec = engine.decoder.spec
    args = (spec, 2, 8192, 256, ([1, 2, 4], [2048]))
    without = memory.step_workspace(*args)
    with_pieces = memory.step_workspace(*args, piecewise_tokens=2048)
    per_row = (4 * spec.hidden_size + spec.q_size + 2 * spec.kv_size + 2 * spec.q_size
               + 3 * spec.intermediate_size)  # fmt: skip
    static = 2 * spec.q_size + spec.hidden_size
    assert with_pieces.graphs - without.graphs == 2048 * ((per_row + static) * 2 + 24)
    assert with_pieces.activations == without.activations


def test_negative_control_padding_rows_without_row_zero_attention_output(engine) -> None:
    """Padding rows that keep a stale attention output stop being copies of row 0 after the
    first layer, and their K/V, written to row 0's slot, change row 0's bits: why
    `attend_into` gives them row 0's output."""
    fill = [3, 1, 4, 1, 5, 9, 2]
    batch = _batch([6, 5, 3, 5, 8, 9, 7, 9])
    decoder, t = engine.decoder, batch.num_tokens
    want = decoder.forward(batch, _cache(engine, fill))
    ops = decoder.ops
    o_static = torch.full((16, decoder.spec.num_heads, decoder.spec.head_dim), 0.25,
                          dtype=decoder.act_dtype)  # fmt: skip

    def stale_padding(q, layer_kv, meta, scale, window):
        o_static[:t].copy_(ops.attention(q[:t], layer_kv, meta, scale, window))
        return o_static

    kv = _cache(engine, fill)
    hidden = forward_with_holes(decoder, _padded(batch, 16), kv, stale_padding)
    got = decoder.head_logits(hidden.index_select(0, batch.logit_rows))
    assert not torch.equal(got[0], want[0])  # row 0's sequence read the padding's K/V
    assert torch.equal(got[1:], want[1:])
