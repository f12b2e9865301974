"""Radix snapshots of linear-attention state (lockstep/cache/linear_snapshots.py): which chunk
boundaries a request keeps, the pool's fixed slots, the radix cache taking, giving back and
evicting them, and a step capturing only the boundaries reserved for it."""

from __future__ import annotations

import pytest
import torch

from lockstep.cache import CacheIntegrityError, KVPool, RadixCache
from lockstep.cache.linear_snapshots import LinearSnapshotPool, SnapshotPolicy
from lockstep.models.linear_attention import (
    LinearLayout,
    LinearSnapshot,
    LinearState,
    LinearStatePool,
    pooled_rows,
)

C = 32
LAYOUT = LinearLayout(num_layers=2, conv_dim=6, conv_kernel=3, num_key_heads=1,
                      num_value_heads=2, key_head_dim=2, value_head_dim=3, chunk=C,
                      device=torch.device("cpu"))  # fmt: skip


def _kv(num_slots: int = 256) -> KVPool:
    return KVPool(num_slots, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                  device="cpu")  # fmt: skip


def _insert(cache: RadixCache, tokens: list[int], states: dict[int, LinearSnapshot]) -> None:
    result = cache.insert(tokens, cache.pool.alloc(len(tokens)), None, None, states)
    cache.pool.free(result.duplicate_slots)


# ---------------------------------------------------------------- the keep policy


@pytest.mark.parametrize(
    ("prompt_len", "start", "end", "kept"),
    [
        (100, 0, 100, [96]),  # the prompt's end: 96 is at or below both 100 and 99
        (96, 0, 96, [64, 96]),  # 96 extends to a longer prompt, 64 serves the same one again
        (31, 0, 40, []),  # no boundary at or below the prompt's end
        (1200, 0, 1200, [512, 1024, 1184]),  # interval points and the prompt's end
        (1200, 0, 400, []),  # a first prefill chunk crosses none of them
        (1200, 400, 1100, [512, 1024]),  # a later chunk crosses two interval points
        (1200, 1184, 1200, []),  # a resume at a kept boundary does not keep it again
        (1200, 1170, 1185, [1184]),  # a resume below the prompt's end
        (100, 1000, 1100, [1024]),  # decode past the prompt: interval points only
        (100, 1023, 1024, [1024]),  # a one-token decode step ending on one
        (100, 1024, 1025, []),  # the step after it
    ],
)
def test_policy_keeps_prompt_ends_and_every_interval(prompt_len, start, end, kept) -> None:
    assert SnapshotPolicy(C, 512).kept(prompt_len, start, end) == kept


@pytest.mark.parametrize(
    ("prompt_len", "start", "end", "latest"),
    [
        (100, 127, 128, 128),  # a decode step ending on a boundary past the prompt
        (100, 128, 129, None),  # one crossing none
        (100, 0, 100, None),  # the prompt's prefill: its ends are kept for good
        (100, 90, 200, 192),  # a recomputed tail (after preemption): its last one only
        (100, 511, 512, None),  # an interval point is kept for good
        (100, 96, 97, None),  # the prompt's own end
    ],
)
def test_policy_keeps_the_end_of_the_generated_text(prompt_len, start, end, latest) -> None:
    assert SnapshotPolicy(C, 512).latest(prompt_len, start, end) == latest


def test_policy_over_a_whole_sequence_in_any_steps_keeps_the_same_set() -> None:
    """What is kept depends on the positions only, never on how the steps split them."""
    policy = SnapshotPolicy(C, 64)
    whole = policy.kept(170, 0, 300)
    assert whole == [64, 128, 160, 192, 256]
    for step in (1, 7, 32, 33, 100):
        cuts = list(range(0, 300, step)) + [300]
        steps = zip(cuts, cuts[1:], strict=False)
        assert [p for a, b in steps for p in policy.kept(170, a, b)] == whole
    with pytest.raises(ValueError, match="multiple of 32"):
        SnapshotPolicy(C, 48)


# ---------------------------------------------------------------- the pool


def test_pool_lends_fixed_slots_and_never_more() -> None:
    pool = LinearSnapshotPool(LAYOUT, 3)
    assert pool.nbytes == 3 * LAYOUT.snapshot_bytes
    snaps = [pool.acquire(32 * (i + 1)) for i in range(3)]
    assert all(s is not None for s in snaps) and pool.num_free == 0
    assert pool.acquire(128) is None  # full: nothing is allocated
    assert len({s.slot for s in snaps}) == 3 and snaps[1].conv.data_ptr() == pool.conv[1].data_ptr()
    pool.check_integrity(snaps)
    with pytest.raises(CacheIntegrityError, match="free 0 \\+ held 2 != 3"):
        pool.check_integrity(snaps[:2])
    with pytest.raises(CacheIntegrityError, match="held twice"):
        pool.check_integrity([snaps[0], snaps[0], snaps[1]])
    held = snaps[0]
    held.release()
    assert pool.num_free == 1 and held.pool is None
    with pytest.raises(ValueError, match="not lent"):
        pool.release(LinearSnapshot(32, held.conv, held.recurrent, pool, 0))
    LinearSnapshot(32, held.conv, held.recurrent).release()  # tensors of its own: no pool


# ---------------------------------------------------------------- the radix cache's share


def test_cache_takes_every_snapshot_and_gives_back_what_it_does_not_keep() -> None:
    pool = LinearSnapshotPool(LAYOUT, 4)
    cache = RadixCache(_kv(), state_aligned=True, snapshots=pool)
    tokens = list(range(100))
    _insert(cache, tokens, {32: pool.acquire(32), 96: pool.acquire(96)})
    assert (cache.num_states, pool.num_free) == (2, 2)
    # The same prefix again, with a snapshot at 32 (the tree's stays) and a new one at 64.
    _insert(cache, tokens[:70], {32: pool.acquire(32), 64: pool.acquire(64)})
    assert (cache.num_states, pool.num_free) == (3, 1)
    assert len(cache.pooled_snapshots()) == 3
    pool.check_integrity(cache.pooled_snapshots())
    disabled = RadixCache(_kv(), enabled=False, state_aligned=True, snapshots=pool)
    disabled.insert([1, 2], torch.tensor([0, 1]), None, None, {32: pool.acquire(32)})
    assert pool.num_free == 1
    cache.flush()
    assert (cache.num_states, cache.state_bytes, pool.num_free) == (0, 0, 4)


def test_eviction_for_a_snapshot_frees_lru_unlocked_leaves_and_spares_locked_paths() -> None:
    pool = LinearSnapshotPool(LAYOUT, 2)
    cache = RadixCache(_kv(), state_aligned=True, snapshots=pool)
    _insert(cache, [1] * 40, {32: pool.acquire(32)})  # older
    _insert(cache, [2] * 40, {32: pool.acquire(32)})
    newer = cache.match_prefix([2] * 40).node
    assert pool.num_free == 0
    cache.lock(newer)
    assert cache.evict_for_snapshots(1) == 40  # the older leaf: its KV and its snapshot
    assert pool.num_free == 1 and cache.num_cached_tokens == 40
    assert cache.evict_for_snapshots(1) == 0  # one is free already
    assert pool.acquire(64) is not None and pool.num_free == 0
    assert cache.evict_for_snapshots(1) == 0  # the only snapshot is on a locked path
    assert cache.num_cached_tokens == 40 and pool.num_free == 0
    _insert(cache, [3] * 20, {})  # an unlocked leaf without a snapshot is not evicted for one
    assert cache.evict_for_snapshots(1) == 0 and cache.num_cached_tokens == 60
    cache.unlock(newer)
    assert cache.evict_for_snapshots(1) > 0 and pool.num_free == 1
    cache.check_integrity(in_use=0)


# ---------------------------------------------------------------- a step captures what it keeps


def test_state_keeps_only_reserved_boundaries() -> None:
    states = LinearStatePool(LAYOUT, 2)
    pool = LinearSnapshotPool(LAYOUT, 2)
    state = LinearState.resume(LAYOUT, None, pool=states, keep_all=False)
    assert state.keep == {} and not state.keeps(32)
    state.keep[64] = pool.acquire(64)
    assert state.keeps(64) and not state.keeps(32)
    state.conv.fill_(1.0)
    state.advance(32)  # ends on 32: not reserved, nothing taken
    assert state.captured == {}
    state.conv.fill_(2.0)
    state.recurrent.fill_(3.0)
    state.advance(32)  # ends on 64: the reserved slot gets the slot's window and state
    snap = state.captured[64]
    assert snap.pool is pool and bool((snap.conv == 2).all()) and bool((snap.recurrent == 3).all())
    assert state.keep == {}
    state.keep[96] = pool.acquire(96)
    assert pool.num_free == 0
    state.release()  # reserved and captured alike go back
    assert pool.num_free == 2 and states.num_free == 2
    every = LinearState.resume(LAYOUT, None, pool=states)
    assert every.keep is None and every.keeps(32)
    every.advance(32)
    assert 32 in every.captured and every.captured[32].pool is None


def test_pooled_step_captures_only_the_reserved_crossings() -> None:
    """A backend with pooled linear attention builds its step's `PooledRows` with `keep`: the
    crossings before each sequence's last row are all listed, only the reserved ones get a
    buffer index (`boundaries`, in the order the kernel returns their states)."""

    class PooledOps:
        def causal_conv_silu_pooled(self, mixed, windows, weight, seqs): ...
        def update_conv_windows(self, mixed, windows, weight, seqs): ...
        def gated_delta_rule_pooled(self, q, k, v, g, beta, state, ok, og, ou, seqs): ...

    states_pool = LinearStatePool(LAYOUT, 2)
    pool = LinearSnapshotPool(LAYOUT, 4)
    a = LinearState.resume(LAYOUT, None, pool=states_pool, keep_all=False)
    b = LinearState.resume(LAYOUT, None, pool=states_pool, keep_all=False)
    a.keep[64] = pool.acquire(64)
    b.keep[32] = pool.acquire(32)
    b.keep[96] = pool.acquire(96)
    rows = pooled_rows(PooledOps(), [a, b], [100, 100], LAYOUT)
    assert rows is not None
    assert rows.boundaries == [(0, 64), (1, 32), (1, 96)]
    assert rows.bound_index.tolist() == [-1, 0, -1, 1, -1, 2]
