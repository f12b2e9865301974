"""The static inputs of the CUDA-graph decode runner (layout, padding, staging), checked on
CPU tensors; the graphs themselves are tested on the GPU (tests/gpu/test_gpu_engine.py and
tests/kernels/test_ops_triton.py)."""

from __future__ import annotations

import torch

from lockstep.engine.cuda_graphs import _Staging, _StaticInputs
from lockstep.models.forward_batch import ForwardBatch
from lockstep.ops.base import build_attention_meta


def _decode_batch(tokens: list[int], positions: list[int], tables: list[list[int]]):
    meta = build_attention_meta([1] * len(tokens), positions, tables)
    i64 = torch.int64
    return ForwardBatch(
        token_ids=torch.tensor(tokens, dtype=i64),
        positions=torch.tensor(positions, dtype=i64),
        out_slots=torch.tensor([t[p] for t, p in zip(tables, positions, strict=True)], dtype=i64),
        meta=meta,
        logit_rows=torch.arange(len(tokens), dtype=i64),
    )


def test_fill_pads_with_row_zero_and_keeps_constants() -> None:
    cpu = torch.device("cpu")
    staging = _Staging(cpu)
    inputs = _StaticInputs(4, 16, cpu)
    tables = [[5, 6, 7], [9, 8], [1, 2, 3, 4]]
    inputs.fill(_decode_batch([11, 12, 13], [2, 1, 3], tables), staging)
    s = inputs.batch
    assert s.token_ids.tolist() == [11, 12, 13, 11]  # padding rows repeat row 0
    assert s.positions.tolist() == [2, 1, 3, 2]
    assert s.out_slots.tolist() == [7, 8, 4, 7]  # row 0 writes its own slot again
    assert s.meta.q_start.tolist() == [2, 1, 3, 2]
    assert s.meta.kv_len.tolist() == [3, 2, 4, 3]
    assert s.meta.cu_kv.tolist() == [0, 3, 5, 0, 9]  # padding starts at row 0's slots
    assert s.meta.cu_q.tolist() == [0, 1, 2, 3, 4]
    assert s.meta.slot_table[:9].tolist() == [5, 6, 7, 9, 8, 1, 2, 3, 4]
    assert s.logit_rows.tolist() == [0, 1, 2, 3]
    assert (s.meta.max_q, s.meta.max_kv) == (1, 16)

    # A second, smaller step through the same staging: everything it owns is rewritten, the
    # constants (cu_q, logit_rows) are untouched.
    inputs.fill(_decode_batch([21], [0], [[14]]), staging)
    assert s.token_ids.tolist() == [21] * 4
    assert s.meta.cu_kv.tolist() == [0, 0, 0, 0, 1]
    assert s.meta.kv_len.tolist() == [1] * 4
    assert s.meta.slot_table[:1].tolist() == [14]
    assert s.meta.cu_q.tolist() == [0, 1, 2, 3, 4]
    assert s.logit_rows.tolist() == [0, 1, 2, 3]


def test_staging_is_shared_and_grows_to_the_largest_bucket() -> None:
    cpu = torch.device("cpu")
    staging = _Staging(cpu)
    small, large = _StaticInputs(1, 8, cpu), _StaticInputs(8, 32, cpu)
    small.fill(_decode_batch([3], [4], [[0, 1, 2, 3, 4]]), staging)
    tables = [list(range(10 * i, 10 * i + 20)) for i in range(8)]
    large.fill(_decode_batch(list(range(8)), [19] * 8, tables), staging)
    assert staging.host32.numel() >= 3 * 8 + 1 + 8 * 20
    assert large.batch.meta.slot_table[: 8 * 20].tolist() == sum(tables, [])
    # The small bucket's device inputs are its own: the large fill did not touch them.
    assert small.batch.meta.slot_table[:5].tolist() == [0, 1, 2, 3, 4]
    assert small.batch.token_ids.tolist() == [3]


def test_pending_tokens_are_patched_from_the_device_padding_included() -> None:
    """Overlapped decode: rows whose token is still pending are built with a placeholder and
    copied from the previous step's token tensor; padding rows repeat row 0, so when row 0's
    token is pending theirs is patched too (else they would write another token's K/V into
    row 0's slot)."""
    cpu = torch.device("cpu")
    staging = _Staging(cpu)
    inputs = _StaticInputs(4, 16, cpu)
    tables = [[5, 6, 7], [9, 8], [1, 2, 3, 4]]
    previous = torch.tensor([70, 71, 72], dtype=torch.int64)  # last step's chosen tokens
    # Row 0 takes previous[2], row 2 previous[0]; row 1's token is known (12).
    inputs.fill(_decode_batch([0, 12, 0], [2, 1, 3], tables), staging, ([(0, 2), (2, 0)], previous))
    assert inputs.batch.token_ids.tolist() == [72, 12, 70, 72]
    # Control: without the patch the placeholders stay (the test sees the patch).
    inputs.fill(_decode_batch([0, 12, 0], [2, 1, 3], tables), staging)
    assert inputs.batch.token_ids.tolist() == [0, 12, 0, 0]
    # Only row 1 pending: padding keeps row 0's known token.
    inputs.fill(_decode_batch([5, 0, 6], [2, 1, 3], tables), staging, ([(1, 1)], previous))
    assert inputs.batch.token_ids.tolist() == [5, 71, 6, 5]


def test_hybrid_padding_rows_write_the_spare_rows_not_row_zeros() -> None:
    """A hybrid model's padding rows compute from the scratch state, so they must not write
    row 0's KV slot or state: they point at the spare KV row and the pool's scratch slot.
    Real rows carry their pool slot, position and position + 1."""
    import dataclasses

    from lockstep.models.linear_attention import LinearLayout, LinearState, LinearStatePool
    from lockstep.models.resolver import resolve_model

    cpu = torch.device("cpu")
    spec = resolve_model("random:tiny-qwen3.5").spec
    layout = LinearLayout.of(spec, cpu)
    pool = LinearStatePool(layout, 4)
    states = [LinearState.resume(layout, None, pool) for _ in range(3)]
    for state, position in zip(states, (2, 1, 3), strict=True):
        state.position = position
    inputs = _StaticInputs(4, 16, cpu, pool, spare_kv_slot=99)
    tables = [[5, 6, 7], [9, 8], [1, 2, 3, 4]]
    batch = dataclasses.replace(_decode_batch([11, 12, 13], [2, 1, 3], tables),
                                linear_states=states)  # fmt: skip
    inputs.fill(batch, _Staging(cpu))
    s = inputs.batch
    assert s.out_slots.tolist() == [7, 8, 4, 99]
    assert s.pooled is not None and s.state_pool is pool
    assert s.pooled.slots.tolist() == [st.slot for st in states] + [pool.scratch_slot]
    assert s.pooled.starts.tolist() == [2, 1, 3, 2]
    assert s.pooled.ends.tolist() == [3, 2, 4, 3]
    assert s.pooled.cu.tolist() == [0, 1, 2, 3, 4] and s.pooled.boundaries == []
    # The chunked rule's tasks: one per row, as PooledRows.build makes them for an eager step.
    from lockstep.ops.base import PooledRows

    eager = PooledRows.build([1] * 4, [2, 1, 3, 2], [0] * 4, layout.chunk, cpu)
    for name in ("task_seq", "task_pos", "task_row", "task_n", "task_cu"):
        assert getattr(s.pooled, name).tolist() == getattr(eager, name).tolist(), name
    assert s.pooled.task_count == eager.task_count == 4
    assert pool.scratch_slot not in [st.slot for st in states]
    inputs.point_at_scratch()
    assert s.out_slots.tolist() == [99] * 4
    assert s.pooled.slots.tolist() == [pool.scratch_slot] * 4
    for state in states:
        state.release()
    assert pool.num_free == 4
