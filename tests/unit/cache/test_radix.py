"""RadixCache: unit tests per operation and split case, namespaces, disabled mode, stored
logprobs and the scored match, corruption controls, and a hypothesis state machine that runs
the engine's request life cycle (match, scored match, lock, allocate, chunked insert with
logprobs, finish or abort) against a naive per-prefix reference model.

LOCKSTEP_LONG_TESTS=1 runs the state machine on many more, non-derandomized examples.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from lockstep.cache import CacheIntegrityError, KVPool, Node, RadixCache
from lockstep.cache.stored_logprobs import MAX_STORED_TOP, StoredLogprobs
from lockstep.engine.outputs import TokenLogprob

LONG = os.environ.get("LOCKSTEP_LONG_TESTS") == "1"


def make_pool(num_slots: int = 64) -> KVPool:
    return KVPool(
        num_slots, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu"
    )


def tree_contents(cache: RadixCache) -> dict[tuple[str | None, tuple[int, ...]], int]:
    """Every cached prefix (per namespace) and the slot holding its last token."""
    out: dict[tuple[str | None, tuple[int, ...]], int] = {}
    for ns, root in cache._roots.items():
        stack: list[tuple[Node, tuple[int, ...]]] = [(root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                for i, slot in enumerate(child.slots.tolist()):
                    out[(ns, prefix + child.key[: i + 1])] = slot
                stack.append((child, prefix + child.key))
    return out


def edges(node: Node) -> list[tuple[int, ...]]:
    return sorted(c.key for c in node.children.values())


def depth(node: Node) -> int:
    """Where `node` ends: the tokens on its path from the root."""
    n = 0
    while node.parent is not None:
        n += len(node.key)
        node = node.parent
    return n


def tree_logprobs(cache: RadixCache) -> dict[tuple[str | None, tuple[int, ...]], tuple]:
    """Every cached prefix whose last position holds a stored logprob: (alternatives stored,
    logprob, alternatives)."""
    out: dict[tuple[str | None, tuple[int, ...]], tuple] = {}
    for ns, root in cache._roots.items():
        stack: list[tuple[Node, tuple[int, ...]]] = [(root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                rows = child.logprobs
                for i in range(len(child.key)):
                    k = int(rows.num_top[i])
                    if k >= 0:
                        ids, lps = rows.top_ids[i, :k].tolist(), rows.top_logprobs[i, :k].tolist()
                        top = tuple(zip(ids, lps, strict=True))
                        out[(ns, prefix + child.key[: i + 1])] = (k, float(rows.logprob[i]), top)
                stack.append((child, prefix + child.key))
    return out


def synthetic_row(prefix: tuple[int, ...], k: int) -> TokenLogprob:
    """A stored row for the last token of `prefix` that is a pure function of the prefix (as
    real logprobs are) and consistent with its token for check_integrity: the token (a small
    id) is less likely than its k alternatives (ids 100..), which are sorted."""
    code = sum((i + 1) * (t + 7) for i, t in enumerate(prefix)) % 997
    top = tuple((100 + j, -0.5 - j / 4) for j in range(k))
    return TokenLogprob(prefix[-1], -1.0 - code / 8, top)


def synthetic(tokens: tuple[int, ...], start: int, ks: list[int]) -> StoredLogprobs:
    """Rows for positions start..start+len(ks)-1 of `tokens`; k = -1 stores nothing."""
    return StoredLogprobs.from_rows(
        [None if k < 0 else synthetic_row(tokens[: start + i + 1], k) for i, k in enumerate(ks)]
    )


# ---- match and insert --------------------------------------------------------------------


def test_empty_cache_matches_nothing():
    cache = RadixCache(make_pool())
    m = cache.match_prefix([1, 2, 3])
    assert m.length == 0 and m.slots.numel() == 0 and m.slots.dtype == torch.int64
    assert m.node is cache._default_root
    assert cache.match_prefix([]).length == 0
    cache.check_integrity(in_use=0)


def test_insert_then_match_exact_longer_and_shorter_query():
    pool = make_pool()
    cache = RadixCache(pool)
    slots = pool.alloc(5)
    res = cache.insert([1, 2, 3, 4, 5], slots)
    assert (res.num_existing, res.num_cached) == (0, 5)
    assert res.duplicate_slots.numel() == 0 and res.cached_slots.tolist() == slots.tolist()
    assert res.node.key == (1, 2, 3, 4, 5)
    cache.check_integrity(in_use=0)

    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert m.length == 5 and m.slots.tolist() == slots.tolist() and m.node is res.node
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert m.length == 5 and m.node is res.node
    m = cache.match_prefix([9, 1, 2])
    assert m.length == 0 and m.node is cache._default_root
    cache.check_integrity(in_use=0)


def test_match_ending_mid_edge_splits_and_keeps_handles():
    pool = make_pool()
    cache = RadixCache(pool)
    slots = pool.alloc(6)
    lower = cache.insert([1, 2, 3, 4, 5, 6], slots).node
    cache.lock(lower)
    m = cache.match_prefix([1, 2, 3, 9])
    # The match ends inside the edge: split so that m.node ends exactly at [1, 2, 3].
    assert m.length == 3 and m.node.key == (1, 2, 3) and m.slots.tolist() == slots[:3].tolist()
    assert edges(cache._default_root) == [(1, 2, 3)] and edges(m.node) == [(4, 5, 6)]
    # The old handle keeps ending at the full prefix; the upper half inherits its lock.
    assert lower.parent is m.node and lower.key == (4, 5, 6)
    assert m.node.lock_ref == 1 and cache.num_locked_tokens == 6
    cache.check_integrity(in_use=0)
    cache.unlock(lower)
    assert m.node.lock_ref == 0 and cache.num_locked_tokens == 0
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).node is lower
    cache.check_integrity(in_use=0)


def test_query_shorter_than_the_edge_splits_at_its_end():
    pool = make_pool()
    cache = RadixCache(pool)
    cache.insert([1, 2, 3, 4], pool.alloc(4))
    m = cache.match_prefix([1, 2])
    assert m.length == 2 and m.node.key == (1, 2) and edges(m.node) == [(3, 4)]
    cache.check_integrity(in_use=0)


def test_insert_diverging_mid_edge_branches():
    pool = make_pool()
    cache = RadixCache(pool)
    a = pool.alloc(5)
    cache.insert([1, 2, 3, 4, 5], a)
    m = cache.match_prefix([1, 2, 7, 8])
    assert m.length == 2
    cache.lock(m.node)
    tail = pool.alloc(2)
    res = cache.insert([1, 2, 7, 8], torch.cat([m.slots, tail]))
    assert (res.num_existing, res.num_cached) == (2, 4)
    assert res.duplicate_slots.numel() == 0  # the prefix slots are the tree's own
    assert res.cached_slots.tolist() == a[:2].tolist() + tail.tolist()
    assert res.node.key == (7, 8) and res.node.parent is m.node
    assert edges(m.node) == [(3, 4, 5), (7, 8)]
    cache.unlock(m.node)
    assert cache.num_cached_tokens == 7 and pool.num_free == 64 - 7
    cache.check_integrity(in_use=0)


def test_insert_with_fresh_slots_returns_duplicates_to_free():
    pool = make_pool()
    cache = RadixCache(pool)
    a = pool.alloc(3)
    cache.insert([1, 2, 3], a)
    b = pool.alloc(5)  # a second request computed the same prefix itself
    res = cache.insert([1, 2, 3, 4, 5], b)
    assert res.num_existing == 3
    assert res.duplicate_slots.tolist() == b[:3].tolist()
    assert res.cached_slots.tolist() == a.tolist() + b[3:].tolist()
    pool.free(res.duplicate_slots)
    cache.check_integrity(in_use=0)
    assert cache.num_cached_tokens == 5 and pool.num_free == 64 - 5


def test_insert_mixing_shared_and_duplicate_prefix_slots():
    # A request matched 2 tokens, computed 3 more; meanwhile another request cached 4 tokens.
    pool = make_pool()
    cache = RadixCache(pool)
    cache.insert([1, 2], pool.alloc(2))
    m = cache.match_prefix([1, 2, 3, 4, 5])
    cache.lock(m.node)
    mine = torch.cat([m.slots, pool.alloc(3)])
    other = cache.insert([1, 2, 3, 4], torch.cat([m.slots, pool.alloc(2)]))
    assert other.duplicate_slots.numel() == 0
    res = cache.insert([1, 2, 3, 4, 5], mine)
    assert res.num_existing == 4 and res.duplicate_slots.tolist() == mine[2:4].tolist()
    pool.free(res.duplicate_slots)
    cache.unlock(m.node)
    cache.check_integrity(in_use=0)
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots.tolist() == res.cached_slots.tolist()


def test_insert_of_a_cached_prefix_ending_mid_edge_takes_nothing():
    pool = make_pool()
    cache = RadixCache(pool)
    a = pool.alloc(4)
    cache.insert([1, 2, 3, 4], a)
    res = cache.insert([1, 2], a[:2])
    assert (res.num_existing, res.num_cached) == (2, 2) and res.duplicate_slots.numel() == 0
    assert res.node.key == (1, 2) and edges(res.node) == [(3, 4)]
    cache.check_integrity(in_use=0)


def test_insert_rejects_bad_slots_without_changing_anything():
    pool = make_pool()
    cache = RadixCache(pool)
    a = pool.alloc(3)
    cache.insert([1, 2, 3], a)
    with pytest.raises(ValueError, match="already owned"):
        cache.insert([5, 6], a[:2])  # the tree's own slots handed back as new
    with pytest.raises(ValueError, match="other positions"):
        cache.insert([1, 2, 3], a.flip(0))  # tree slots at the wrong positions
    free_slot = torch.tensor([63, 62])
    with pytest.raises(ValueError, match="free in the pool"):
        cache.insert([5, 6], free_slot)
    b = pool.alloc(1)
    with pytest.raises(ValueError, match="more than once"):
        cache.insert([5, 6], torch.cat([b, b]))
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        cache.insert([5, 6], b)
    with pytest.raises(ValueError, match="int64"):
        cache.insert([5], b.to(torch.int32))
    assert cache.num_cached_tokens == 3
    cache.check_integrity(in_use=1)


def test_tokens_may_be_a_tensor_or_tuple():
    pool = make_pool()
    cache = RadixCache(pool)
    cache.insert(torch.tensor([4, 5, 6]), pool.alloc(3))
    assert cache.match_prefix((4, 5, 6)).length == 3
    assert cache.match_prefix(torch.tensor([4, 5])).length == 2


def test_long_prompt_mismatch_positions_across_compare_chunks():
    pool = make_pool(40_000)
    cache = RadixCache(pool)
    tokens = [(i * 7919) % 50_000 for i in range(32_768)]
    slots = pool.alloc(len(tokens))
    cache.insert(tokens, slots)
    for cut in (1, 63, 64, 65, 127, 20_000, 32_767):
        query = tokens[:cut] + [-1] + tokens[cut + 1 :]
        m = cache.match_prefix(query)
        assert m.length == cut and m.slots.tolist() == slots[:cut].tolist()
    assert cache.match_prefix(tokens).length == len(tokens)
    cache.check_integrity(in_use=0)


# ---- locks, eviction, flush --------------------------------------------------------------


def test_lock_unlock_counters_and_misuse():
    pool = make_pool()
    cache = RadixCache(pool)
    node = cache.insert([1, 2, 3], pool.alloc(3)).node
    assert (cache.num_cached_tokens, cache.num_locked_tokens, cache.num_evictable_tokens) == (
        3,
        0,
        3,
    )
    cache.lock(node)
    cache.lock(node)
    assert (cache.num_locked_tokens, cache.num_evictable_tokens) == (3, 0)
    cache.unlock(node)
    assert cache.num_locked_tokens == 3
    cache.unlock(node)
    assert cache.num_locked_tokens == 0
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(node)
    cache.check_integrity(in_use=0)
    # The root may be locked and unlocked like any node (it is never evicted anyway).
    root = cache.match_prefix([9]).node
    cache.lock(root)
    cache.unlock(root)
    cache.check_integrity(in_use=0)


def test_evict_is_lru_and_cascades_to_parents():
    pool = make_pool()
    cache = RadixCache(pool)
    a = pool.alloc(3)
    cache.insert([1, 2, 3], a)
    cache.insert([1, 2, 4], torch.cat([a[:2], pool.alloc(1)]))  # splits: [1, 2] -> {[3], [4]}
    cache.insert([5, 6], pool.alloc(2))
    cache.match_prefix([1, 2, 3])  # [3] is now more recent than [4] and [5, 6]
    assert cache.evict(1) == 1  # the oldest leaf: [4]
    assert cache.match_prefix([1, 2, 4]).length == 2
    assert cache.evict(1) == 2  # next oldest: [5, 6] (the match above touched only [1, 2])
    assert cache.match_prefix([5, 6]).length == 0
    assert cache.num_cached_tokens == 3 and pool.num_free == 61
    # Evicting the last leaf under [1, 2] makes [1, 2] an evictable leaf in the same call.
    assert cache.evict(3) == 3
    assert cache.num_cached_tokens == 0 and pool.num_free == 64
    assert cache.evict(5) == 0
    cache.check_integrity(in_use=0)


def test_evict_never_touches_locked_nodes_and_handles_detach():
    pool = make_pool()
    cache = RadixCache(pool)
    a = pool.alloc(3)
    kept = cache.insert([1, 2, 3], a).node
    gone = cache.insert([1, 2, 3, 4, 5], torch.cat([a, pool.alloc(2)])).node
    other = cache.insert([7], pool.alloc(1)).node
    cache.lock(kept)
    assert cache.num_evictable_tokens == 3
    assert cache.evict(100) == 3  # [4, 5] and [7]; [1, 2, 3] is locked
    assert cache.num_cached_tokens == 3 and cache.num_locked_tokens == 3
    for evicted in (gone, other):
        with pytest.raises(ValueError, match="no longer in the cache"):
            cache.lock(evicted)
    assert cache.evict(0) == 0
    cache.unlock(kept)
    assert cache.flush() == 3 and pool.num_free == 64
    cache.check_integrity(in_use=0)


def test_evict_frees_whole_nodes_even_past_the_ask():
    pool = make_pool()
    cache = RadixCache(pool)
    cache.insert(list(range(10)), pool.alloc(10))
    assert cache.evict(1) == 10


def test_flush_frees_everything_unlocked_and_reports_it():
    pool = make_pool()
    cache = RadixCache(pool)
    cache.insert([1, 2, 3], pool.alloc(3))
    node = cache.insert([4, 5], pool.alloc(2)).node
    cache.lock(node)
    running = pool.alloc(7)  # a request's own slots: never touched by the cache
    assert cache.flush() == 3
    assert cache.num_cached_tokens == 2
    cache.check_integrity(in_use=7)
    cache.unlock(node)
    assert cache.flush() == 2
    pool.free(running)
    assert pool.num_free == 64
    cache.check_integrity(in_use=0)


# ---- namespaces and disabled mode --------------------------------------------------------


def test_namespaces_never_share():
    pool = make_pool()
    cache = RadixCache(pool)
    a = pool.alloc(3)
    cache.insert([1, 2, 3], a, namespace="salt-a")
    assert cache.match_prefix([1, 2, 3]).length == 0
    assert cache.match_prefix([1, 2, 3], namespace="salt-b").length == 0
    assert cache.match_prefix([1, 2, 3], namespace="salt-a").slots.tolist() == a.tolist()
    b = pool.alloc(3)
    res = cache.insert([1, 2, 3], b)  # the default namespace caches its own copy
    assert res.num_existing == 0 and res.duplicate_slots.numel() == 0
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == b.tolist()
    cache.check_integrity(in_use=0)
    # Empty namespace roots are dropped once unlocked and empty; the default root stays.
    assert cache.flush() == 6
    assert set(cache._roots) == {None}
    cache.check_integrity(in_use=0)


def test_namespace_root_survives_eviction_while_locked():
    pool = make_pool()
    cache = RadixCache(pool)
    m = cache.match_prefix([1, 2], namespace="lora-x")
    cache.lock(m.node)  # an empty match in a new namespace: its root is the handle
    cache.flush()
    slots = pool.alloc(2)
    res = cache.insert([1, 2], slots, namespace="lora-x")
    assert res.node.parent is m.node
    cache.unlock(m.node)
    cache.check_integrity(in_use=0)


def test_disabled_cache_takes_nothing_through_the_same_calls():
    pool = make_pool(16)
    cache = RadixCache(pool, enabled=False)
    # The engine's unfinished-request path: insert, free duplicates, continue on the result.
    m = cache.match_prefix([1, 2, 3, 4])
    assert m.length == 0 and m.slots.numel() == 0
    cache.lock(m.node)
    slots = pool.alloc(4)
    res = cache.insert([1, 2, 3, 4], slots)
    assert (res.num_existing, res.num_cached) == (0, 0)
    assert res.cached_slots.numel() == 0 and res.duplicate_slots.numel() == 0
    pool.free(res.duplicate_slots)
    slots = torch.cat([res.cached_slots, slots[res.num_cached :]])
    cache.lock(res.node)
    cache.unlock(m.node)
    assert cache.num_cached_tokens == 0
    cache.check_integrity(in_use=4)
    # The finished-request path: free what the caller still owns.
    res = cache.insert([1, 2, 3, 4], slots)
    pool.free(res.duplicate_slots)
    pool.free(slots[res.num_cached :])
    cache.unlock(res.node)
    assert pool.num_free == 16 and cache.match_prefix([1, 2, 3, 4]).length == 0
    assert cache.evict(10) == 0 and cache.flush() == 0
    cache.check_integrity(in_use=0)


# ---- stored logprobs and the scored match -------------------------------------------------


def test_stored_logprobs_round_trip_cap_and_refuse_what_float32_cannot_hold():
    rows = [None, synthetic_row((1, 2), 0), synthetic_row((1, 2, 3), 3)]
    stored = StoredLogprobs.from_rows(rows)
    assert stored.num_top.tolist() == [-1, 0, 3] and stored.width == 3
    assert list(stored.slice(1, 3).rows(0)) == [(r.logprob, ()) for r in rows[1:]]
    assert list(stored.slice(2, 3).rows(3)) == [(rows[2].logprob, rows[2].top)]
    with pytest.raises(ValueError, match="holds fewer"):
        list(stored.slice(1, 3).rows(1))
    many = TokenLogprob(5, -30.0, tuple((100 + j, -1.0 - j) for j in range(MAX_STORED_TOP + 5)))
    assert StoredLogprobs.from_rows([many]).num_top.tolist() == [MAX_STORED_TOP]
    with pytest.raises(ValueError, match="not a float32 value"):
        StoredLogprobs.from_rows([TokenLogprob(5, 0.1, ())])  # 0.1 is no float32 value
    assert stored.problems([0, 2, 3]) == []


def test_scored_match_reuses_kv_only_up_to_the_first_position_it_cannot_serve():
    pool = make_pool()
    cache = RadixCache(pool)
    tokens = (1, 2, 3, 4, 5, 6)
    slots = pool.alloc(6)
    # Stored: positions 1..3 with 2 alternatives, position 4 with none stored, 5 with 0.
    cache.insert(tokens, slots, logprobs=synthetic(tokens, 1, [2, 2, 2, -1, 0]))

    def scored(query, first=1, num_top=0):
        m = cache.match_prefix_with_logprobs(query, None, first=first, num_top=num_top)
        assert m.slots.tolist() == slots[: m.length].tolist() and depth(m.node) == m.length
        want = [synthetic_row(tuple(query[: p + 1]), num_top) for p in range(first, m.length + 1)]
        assert list(m.logprobs.rows(num_top)) == [(r.logprob, r.top) for r in want]
        return m.length

    # The logprob of token 4 is missing: reuse KV 0..2, serve 1..3, compute from position 3.
    assert scored(tokens) == 3
    assert scored(tokens, num_top=2) == 3 and scored(tokens, num_top=3) == 0
    assert scored(tokens[:4]) == 3  # at most len - 1: the last position is computed
    assert scored((1, 2, 3, 9)) == 2  # diverges at 3: the logprob of 9 is computed
    # Positions before `first` are already known (a preempted request): only KV matters.
    assert scored(tokens, first=5) == 5 and scored(tokens, first=6) == 5
    assert scored(tokens, first=4) == 3
    assert cache.match_prefix_with_logprobs((7, 8), None, first=1, num_top=0).length == 0
    # Every match split its edge exactly at its length; the books still balance.
    cache.check_integrity(in_use=0)
    assert cache.match_prefix(tokens).slots.tolist() == slots.tolist()


def test_insert_merges_more_alternatives_into_the_cached_prefix_and_splits_keep_rows():
    pool = make_pool()
    cache = RadixCache(pool)
    tokens = (1, 2, 3, 4, 5)
    a = pool.alloc(5)
    cache.insert(tokens, a, logprobs=synthetic(tokens, 0, [-1, 1, 1, -1, -1]))
    # A request that computed positions 2..4 with 3 alternatives, on the tree's own slots.
    cache.insert(tokens, a, logprobs=synthetic(tokens, 2, [3, 0, 3]))
    got = tree_logprobs(cache)
    assert {p: v[0] for (_, p), v in got.items()} == {(1, 2): 1, (1, 2, 3): 3, (1, 2, 3, 4): 0,
                                                      (1, 2, 3, 4, 5): 3}  # fmt: skip
    for (_, prefix), (k, value, top) in got.items():
        assert (value, top) == (synthetic_row(prefix, k).logprob, synthetic_row(prefix, k).top)
    cache.match_prefix((1, 2, 3, 9))  # splits after 3 tokens: rows go with their tokens
    assert tree_logprobs(cache) == got
    cache.check_integrity(in_use=0)
    with pytest.raises(ValueError, match="position 0"):
        cache.insert((7, 8), pool.alloc(2), logprobs=synthetic((7, 8), 0, [0, 0]))
    with pytest.raises(ValueError, match="3 logprob rows for 2 tokens"):
        cache.insert((7, 8), pool.alloc(2), logprobs=synthetic((7, 8, 9), 0, [-1, 0, 0]))


def test_stored_logprobs_stay_in_their_namespace_and_go_with_eviction():
    pool = make_pool()
    cache = RadixCache(pool)
    tokens = (1, 2, 3)
    cache.insert(tokens, pool.alloc(3), "a", synthetic(tokens, 1, [0, 0]))
    cache.insert(tokens, pool.alloc(3), None)
    assert cache.match_prefix_with_logprobs(tokens, "a", first=1, num_top=0).length == 2
    assert cache.match_prefix_with_logprobs(tokens, None, first=1, num_top=0).length == 0
    assert cache.match_prefix_with_logprobs(tokens, "b", first=1, num_top=0).length == 0
    cache.flush()
    assert tree_logprobs(cache) == {}
    cache.insert(tokens, pool.alloc(3), "a")  # the same tokens again: no stale rows come back
    assert cache.match_prefix_with_logprobs(tokens, "a", first=1, num_top=0).length == 0
    cache.check_integrity(in_use=0)


def test_disabled_cache_scored_match_finds_nothing():
    pool = make_pool(8)
    cache = RadixCache(pool, enabled=False)
    m = cache.match_prefix_with_logprobs((1, 2, 3), None, first=1, num_top=0)
    assert m.length == 0 and len(m.logprobs) == 0


# ---- negative controls: check_integrity must catch corruption ----------------------------


def corrupted_cache() -> tuple[KVPool, RadixCache, Node]:
    pool = make_pool()
    cache = RadixCache(pool)
    a = pool.alloc(4)
    cache.insert([1, 2, 3, 4], a)
    node = cache.insert([1, 2, 5], torch.cat([a[:2], pool.alloc(1)])).node
    cache.lock(node)
    cache.check_integrity(in_use=0)
    return pool, cache, node


def test_integrity_catches_a_slot_freed_behind_the_trees_back():
    pool, cache, node = corrupted_cache()
    pool.free(node.slots[:1])  # steal a slot the tree owns
    with pytest.raises(CacheIntegrityError, match=r"free \d+ \+ cached 5 \+ in use 0"):
        cache.check_integrity(in_use=0)
    with pytest.raises(CacheIntegrityError, match="free in the pool"):
        cache.check_integrity(in_use=-1)


def test_integrity_catches_a_broken_lock_count():
    _, cache, node = corrupted_cache()
    node.parent.lock_ref = 0
    with pytest.raises(CacheIntegrityError, match="children's sum"):
        cache.check_integrity(in_use=0)


def test_integrity_catches_a_negative_lock_and_counter_drift():
    _, cache, node = corrupted_cache()
    node.lock_ref = -1
    with pytest.raises(CacheIntegrityError, match="negative lock"):
        cache.check_integrity(in_use=0)
    _, cache, _ = corrupted_cache()
    cache._num_cached += 1
    with pytest.raises(CacheIntegrityError, match="num_cached_tokens 6 != recount 5"):
        cache.check_integrity(in_use=-1)


def test_integrity_catches_a_slot_owned_twice_and_bad_structure():
    _, cache, node = corrupted_cache()
    sibling = next(c for c in node.parent.children.values() if c is not node)
    node.slots = sibling.slots[:1].clone()
    with pytest.raises(CacheIntegrityError, match="owned by two"):
        cache.check_integrity(in_use=0)
    _, cache, node = corrupted_cache()
    node.key = (9,)
    with pytest.raises(CacheIntegrityError, match="keyed by 5"):
        cache.check_integrity(in_use=0)
    _, cache, node = corrupted_cache()
    node.key, node.slots = (), node.slots[:0]
    with pytest.raises(CacheIntegrityError, match="empty non-root"):
        cache.check_integrity(in_use=1)


def scored_cache() -> tuple[RadixCache, Node]:
    pool = make_pool()
    cache = RadixCache(pool)
    tokens = (1, 2, 3, 4, 5)
    node = cache.insert(tokens, pool.alloc(5), logprobs=synthetic(tokens, 1, [2, 2, 0, 2])).node
    cache.check_integrity(in_use=0)
    return cache, node


def test_integrity_catches_stored_logprobs_out_of_step_with_their_tokens():
    cache, node = scored_cache()
    node.logprobs = node.logprobs.slice(0, 4)  # a split that forgot to cut the rows
    with pytest.raises(CacheIntegrityError, match="for 5 tokens"):
        cache.check_integrity(in_use=0)
    cache, node = scored_cache()
    node.logprobs = StoredLogprobs.cat([synthetic((1,), 0, [1]), node.logprobs.slice(1, 5)])
    with pytest.raises(CacheIntegrityError, match="position 0"):
        cache.check_integrity(in_use=0)
    # Off by one: position 2's row is the row of the token before. Its alternatives are
    # sorted and distinct, but token 3 with that logprob would have to be among them.
    cache, node = scored_cache()
    rows = node.logprobs
    shifted = StoredLogprobs.from_rows([None, None, TokenLogprob(2, -0.25, ((100, -0.5),))])
    node.logprobs = StoredLogprobs.cat([rows.slice(0, 2), shifted.slice(2, 3), rows.slice(3, 5)])
    with pytest.raises(CacheIntegrityError, match="not among them"):
        cache.check_integrity(in_use=0)
    cache, node = scored_cache()
    node.logprobs.top_logprobs[1, 0] = -2.0  # sorted no more
    with pytest.raises(CacheIntegrityError, match="out of order"):
        cache.check_integrity(in_use=0)
    cache, node = scored_cache()
    node.logprobs.top_ids[1, 1] = 2  # the token itself, with a value other than its logprob
    with pytest.raises(CacheIntegrityError, match="differs from its logprob"):
        cache.check_integrity(in_use=0)


def test_integrity_catches_a_wrong_in_use_count():
    pool, cache, _ = corrupted_cache()
    pool.alloc(2)
    cache.check_integrity(in_use=2)
    with pytest.raises(CacheIntegrityError, match="in use 1"):
        cache.check_integrity(in_use=1)


# ---- the state machine against a reference model -----------------------------------------

POOL_SLOTS = 24
NAMESPACES = [None, "a"]
Key = tuple[str | None, tuple[int, ...]]

token_lists = st.lists(st.integers(0, 2), min_size=1, max_size=8)
namespaces = st.sampled_from(NAMESPACES)
picks = st.integers(0, 1_000)
# Alternatives stored per position a caller computed (-1: that logprob was not computed); the
# caller's rows cover the last positions of what it inserts.
computed = st.lists(st.integers(-1, 3), max_size=8)


@dataclass
class Request:
    """A running request: slots[:locked_len] are the tree's (locked through `node`); the rest
    are its own until it inserts them."""

    namespace: str | None
    tokens: tuple[int, ...]
    slots: torch.Tensor
    node: Node
    locked_len: int


class RadixMachine(RuleBasedStateMachine):
    """The reference model is a dict from (namespace, prefix) to the slot of the prefix's last
    token, one to the alternatives stored with its logprob (whose values are a pure function
    of the prefix, as the contract makes real ones), plus the logical time each prefix was last
    touched; it predicts match lengths, scored matches, slots, stored logprobs, inserts and
    duplicates exactly. Eviction choices are read back from the tree and checked:
    only unlocked content, at least the ask (or everything evictable), LRU order, slots freed."""

    cache_class: type[RadixCache] = RadixCache

    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool(POOL_SLOTS)
        self.cache = self.cache_class(self.pool)
        self.model: dict[Key, int] = {}
        self.stored: dict[Key, int] = {}
        self.touched: dict[Key, int] = {}
        self.clock = 0
        self.requests: list[Request] = []

    # -- the model

    def longest(self, ns: str | None, tokens: tuple[int, ...]) -> int:
        n = 0
        while n < len(tokens) and (ns, tokens[: n + 1]) in self.model:
            n += 1
        return n

    def touch(self, ns: str | None, tokens: tuple[int, ...]) -> None:
        self.clock += 1
        for i in range(1, len(tokens) + 1):
            self.touched[(ns, tokens[:i])] = self.clock

    def locked(self) -> set[Key]:
        return {
            (r.namespace, r.tokens[:i]) for r in self.requests for i in range(1, r.locked_len + 1)
        }

    @property
    def in_use(self) -> int:
        return sum(len(r.tokens) - r.locked_len for r in self.requests)

    def expect_match(self, ns: str | None, tokens: tuple[int, ...]) -> int:
        m = self.cache.match_prefix(tokens, ns)
        n = self.longest(ns, tokens)
        assert m.length == n, f"match {tokens} in {ns!r}: cache {m.length}, model {n}"
        assert m.slots.tolist() == [self.model[(ns, tokens[: i + 1])] for i in range(n)]
        self.touch(ns, tokens[:n])
        return m

    def evict(self, num_tokens: int) -> None:
        before = self.cache.num_evictable_tokens
        locked = self.locked()
        freed = self.cache.evict(num_tokens)
        assert freed <= before
        assert freed >= num_tokens or self.cache.num_evictable_tokens == 0, (freed, num_tokens)
        remaining = tree_contents(self.cache)
        removed = set(self.model) - set(remaining)
        assert all(self.model[k] == v for k, v in remaining.items()), "eviction moved slots"
        assert set(remaining) <= set(self.model), "eviction added content"
        assert len(removed) == freed
        self.stored = {k: v for k, v in self.stored.items() if k in remaining}
        assert not removed & locked, f"locked content evicted: {sorted(removed & locked)}"
        freed_slots = torch.tensor([self.model[k] for k in removed], dtype=torch.int64)
        assert not bool(self.pool.is_allocated(freed_slots).any()), "evicted slots not freed"
        if removed:
            # LRU: everything evicted is at least as old as every unlocked leaf left behind.
            leaves = {(ns, p[:-1]) for ns, p in remaining}
            unlocked_leaves = [k for k in remaining if k not in leaves and k not in locked]
            newest_evicted = max(self.touched[k] for k in removed)
            assert all(self.touched[k] >= newest_evicted for k in unlocked_leaves), (
                "eviction is not LRU"
            )
        self.model = remaining

    def make_room(self, n: int) -> bool:
        if self.pool.num_free < n:
            self.evict(n - self.pool.num_free)
        return self.pool.num_free >= n

    def insert(
        self, req_ns: str | None, tokens: tuple[int, ...], slots: torch.Tensor, ks: list[int]
    ):
        ks = list(ks[-len(tokens) :]) if ks else []
        start = len(tokens) - len(ks)
        if start == 0 and ks:
            ks[0] = -1  # position 0 has no logprob
        existing = self.longest(req_ns, tokens)
        expected_dups = [
            s
            for i, s in enumerate(slots[:existing].tolist())
            if s != self.model[(req_ns, tokens[: i + 1])]
        ]
        res = self.cache.insert(tokens, slots, req_ns, synthetic(tokens, start, ks))
        assert (res.num_existing, res.num_cached) == (existing, len(tokens))
        for i, k in enumerate(ks, start):
            key = (req_ns, tokens[: i + 1])
            if k > self.stored.get(key, -1):  # the tree keeps the row with more alternatives
                self.stored[key] = k
        assert res.duplicate_slots.tolist() == expected_dups
        for i in range(existing, len(tokens)):
            self.model[(req_ns, tokens[: i + 1])] = int(slots[i])
        assert res.cached_slots.tolist() == [
            self.model[(req_ns, tokens[: i + 1])] for i in range(len(tokens))
        ]
        self.touch(req_ns, tokens)
        self.pool.free(res.duplicate_slots)
        return res

    # -- rules

    @rule(ns=namespaces, tokens=token_lists)
    def match(self, ns, tokens):
        self.expect_match(ns, tuple(tokens))

    @rule(
        ns=namespaces,
        tokens=token_lists,
        pick=picks,
        first=st.integers(1, 4),
        num_top=st.integers(0, 3),
    )
    def scored_match(self, ns, tokens, pick, first, num_top):
        tokens = tuple(tokens)
        if self.stored and pick % 3:
            # Mostly a query that extends a cached prefix holding a stored logprob.
            ns, prefix = sorted(self.stored, key=repr)[pick % len(self.stored)]
            tokens = prefix + tokens
        held = self.longest(ns, tokens)
        short = first
        while short < held and self.stored.get((ns, tokens[: short + 1]), -1) >= num_top:
            short += 1
        want = max(0, min(len(tokens) - 1, held, short - 1))
        m = self.cache.match_prefix_with_logprobs(tokens, ns, first=first, num_top=num_top)
        assert m.length == want, f"scored match {tokens} from {first} k={num_top} in {ns!r}"
        assert m.slots.tolist() == [self.model[(ns, tokens[: i + 1])] for i in range(want)]
        rows = [synthetic_row(tokens[: p + 1], num_top) for p in range(first, want + 1)]
        assert list(m.logprobs.rows(num_top)) == [(r.logprob, r.top) for r in rows]
        self.touch(ns, tokens[:want])

    @precondition(lambda self: len(self.requests) < 4)
    @rule(ns=namespaces, tokens=token_lists)
    def start_request(self, ns, tokens):
        tokens = tuple(tokens)
        m = self.expect_match(ns, tokens)
        self.cache.lock(m.node)
        self.requests.append(Request(ns, tokens, m.slots, m.node, m.length))
        need = len(tokens) - m.length
        if not self.make_room(need):
            self.requests.pop()
            self.cache.unlock(m.node)
            return
        self.requests[-1].slots = torch.cat([m.slots, self.pool.alloc(need)])

    @precondition(lambda self: self.requests)
    @rule(pick=picks, cut=picks, ks=computed)
    def checkpoint_request(self, pick, cut, ks):
        """Chunked prefill: cache what was computed so far and continue on the tree's slots."""
        req = self.requests[pick % len(self.requests)]
        k = len(req.tokens) if req.locked_len == len(req.tokens) else req.locked_len + 1
        k += cut % (len(req.tokens) - k + 1)
        res = self.insert(req.namespace, req.tokens[:k], req.slots[:k], ks)
        req.slots = torch.cat([res.cached_slots, req.slots[k:]])
        self.cache.lock(res.node)
        self.cache.unlock(req.node)
        req.node, req.locked_len = res.node, k

    @precondition(lambda self: self.requests)
    @rule(pick=picks, ks=computed)
    def finish_request(self, pick, ks):
        req = self.requests.pop(pick % len(self.requests))
        self.insert(req.namespace, req.tokens, req.slots, ks)
        self.cache.unlock(req.node)

    @precondition(lambda self: self.requests)
    @rule(pick=picks)
    def abort_request(self, pick):
        req = self.requests.pop(pick % len(self.requests))
        self.pool.free(req.slots[req.locked_len :])
        self.cache.unlock(req.node)

    @rule(ns=namespaces, tokens=token_lists, ks=computed)
    def insert_fresh(self, ns, tokens, ks):
        """A caller that skipped the match: every cached position comes back as a duplicate."""
        tokens = tuple(tokens)
        if self.make_room(len(tokens)):
            self.insert(ns, tokens, self.pool.alloc(len(tokens)), ks)

    @rule(n=st.integers(0, POOL_SLOTS))
    def evict_some(self, n):
        self.evict(n)

    @rule()
    def flush(self):
        evictable = self.cache.num_evictable_tokens
        before = self.cache.num_cached_tokens
        self.evict(before)
        assert before - self.cache.num_cached_tokens == evictable
        assert self.cache.num_evictable_tokens == 0
        assert set(self.model) == self.locked()

    @invariant()
    def books_balance(self):
        self.cache.check_integrity(self.in_use)
        assert tree_contents(self.cache) == self.model
        want = {}
        for key, k in self.stored.items():
            row = synthetic_row(key[1], k)
            want[key] = (k, row.logprob, row.top)
        assert tree_logprobs(self.cache) == want
        assert self.cache.num_cached_tokens == len(self.model)
        assert self.cache.num_locked_tokens == len(self.locked())

    def teardown(self):
        for req in self.requests:
            self.pool.free(req.slots[req.locked_len :])
            self.cache.unlock(req.node)
        self.requests = []
        self.cache.flush()
        self.cache.check_integrity(in_use=0)
        assert self.pool.num_free == POOL_SLOTS and self.cache.num_cached_tokens == 0


if LONG:
    MACHINE_SETTINGS = settings(max_examples=5_000, stateful_step_count=100, deadline=None)
else:
    MACHINE_SETTINGS = settings(
        max_examples=600, stateful_step_count=50, deadline=None, derandomize=True, database=None
    )


@pytest.mark.slow  # hundreds of stateful runs
def test_radix_cache_state_machine():
    run_state_machine_as_test(RadixMachine, settings=MACHINE_SETTINGS)


# Mutants: realistic bugs the state machine must catch, showing it can fail.


class SplitForgetsLocks(RadixCache):
    def _split(self, node: Node, n: int) -> Node:
        upper = super()._split(node, n)
        upper.lock_ref = 0
        return upper


class LocksDoNothing(RadixCache):
    def lock(self, node: Node) -> None:
        self._path_to_root(node)

    def unlock(self, node: Node) -> None:
        self._path_to_root(node)


class SplitDropsLogprobs(RadixCache):
    """The upper half of a split edge forgets its stored logprobs."""

    def _split(self, node: Node, n: int) -> Node:
        upper = super()._split(node, n)
        upper.logprobs = StoredLogprobs.empty(n)
        return upper


class StoresOnePositionLate(RadixCache):
    """The caller's rows land one position after the tokens they belong to."""

    def insert(self, tokens, slots, namespace=None, logprobs=None):
        if logprobs is not None and len(logprobs) > 1:
            logprobs = StoredLogprobs.cat([StoredLogprobs.empty(1), logprobs.slice(0, -1)])
        return super().insert(tokens, slots, namespace, logprobs)


class MergeKeepsTheTreesRows(RadixCache):
    """Rows for positions already cached are ignored, even where they hold more."""

    @staticmethod
    def _merge_logprobs(nodes, logprobs, covered_from) -> None:
        return None


class MatchLeavesStaleTimes(RadixCache):
    """Matched nodes get the oldest time instead of the newest: only the LRU check sees it."""

    def match_prefix(self, tokens, namespace=None):
        clock = self._clock
        self._clock = -1
        try:
            return super().match_prefix(tokens, namespace)
        finally:
            self._clock = clock


# A crash in the cache's own misuse checks (ValueError from unlock) counts as caught too.
@pytest.mark.parametrize(
    ("mutant", "caught"),
    [
        (SplitForgetsLocks, (AssertionError, CacheIntegrityError, ValueError)),
        (LocksDoNothing, (AssertionError, CacheIntegrityError, ValueError)),
        (MatchLeavesStaleTimes, AssertionError),
        (SplitDropsLogprobs, AssertionError),
        (StoresOnePositionLate, AssertionError),
        (MergeKeepsTheTreesRows, AssertionError),
    ],
)
def test_state_machine_catches_mutants(mutant, caught):
    machine = type(f"{mutant.__name__}Machine", (RadixMachine,), {"cache_class": mutant})
    quick = settings(
        max_examples=300,
        stateful_step_count=50,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        report_multiple_bugs=False,
    )
    with pytest.raises(caught):
        run_state_machine_as_test(machine, settings=quick)
