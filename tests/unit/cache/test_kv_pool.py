"""KVPool: allocation, freeing, misuse errors, storage layout and sizing helpers."""

from __future__ import annotations

import pytest
import torch

from lockstep.cache import CacheIntegrityError, KVPool, KVPoolExhausted
from lockstep.errors import ConfigError, LockstepError


def make_pool(num_slots: int = 16) -> KVPool:
    return KVPool(
        num_slots, num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu"
    )


def ids(t: torch.Tensor) -> list[int]:
    return t.tolist()


def test_storage_shapes_views_and_zero_init():
    pool = make_pool(8)
    k, v = pool.k_cache(1), pool.v_cache(1)
    assert k.shape == v.shape == (8, 2, 4)
    assert k.dtype == torch.float32 and bool((k == 0).all()) and bool((v == 0).all())
    # Views: writing a slot through the layer view is visible on the next call, and layers
    # and K/V are separate storage.
    k[5] = 1.0
    assert bool((pool.k_cache(1)[5] == 1).all())
    assert bool((pool.k_cache(0)[5] == 0).all()) and bool((pool.v_cache(1)[5] == 0).all())


def test_alloc_is_deterministic_lowest_first_and_reuses_freed_in_order():
    pool = make_pool(16)
    a = pool.alloc(4)
    assert a.dtype == torch.int64 and a.device.type == "cpu"
    assert ids(a) == [0, 1, 2, 3]
    b = pool.alloc(3)
    assert ids(b) == [4, 5, 6]
    pool.free(a)
    assert pool.num_free == 16 - 3
    assert ids(pool.alloc(4)) == [0, 1, 2, 3]  # freed ids come back in the order freed
    assert pool.num_allocated == 7
    # Same calls, same ids, on a fresh pool.
    pool2 = make_pool(16)
    pool2.alloc(4), pool2.alloc(3)
    assert ids(pool2.alloc(2)) == ids(pool.alloc(2))


def test_alloc_zero_and_free_empty_are_noops():
    pool = make_pool(4)
    assert pool.alloc(0).numel() == 0
    pool.free(torch.empty(0, dtype=torch.int64))
    assert pool.num_free == 4
    pool.check_integrity()


def test_returned_ids_do_not_alias_the_free_list():
    pool = make_pool(8)
    a = pool.alloc(3)
    pool.free(a)
    b = pool.alloc(2)
    assert ids(a) == [0, 1, 2]  # a later alloc must not rewrite an earlier result
    assert ids(b) == [0, 1]


def test_exhaustion_names_requested_and_free_and_changes_nothing():
    pool = make_pool(8)
    pool.alloc(6)
    with pytest.raises(KVPoolExhausted, match=r"requested 3 slots, 2 free of 8") as err:
        pool.alloc(3)
    assert isinstance(err.value, LockstepError)
    assert (err.value.requested, err.value.free, err.value.total) == (3, 2, 8)
    assert pool.num_free == 2
    assert ids(pool.alloc(2)) == [6, 7]
    with pytest.raises(KVPoolExhausted):
        pool.alloc(1)


def test_double_free_raises_and_changes_nothing():
    pool = make_pool(8)
    a = pool.alloc(4)
    pool.free(a[:2])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(a)  # a[0], a[1] already freed
    assert pool.num_free == 6  # the valid half was not freed either
    assert bool(pool.is_allocated(a[2:]).all())
    pool.check_integrity()


def test_free_of_never_allocated_or_repeated_or_bad_ids_raises():
    pool = make_pool(8)
    a = pool.alloc(2)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(torch.tensor([5]))
    with pytest.raises(ValueError, match="more than once"):
        pool.free(torch.tensor([a[0].item(), a[0].item()]))
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        pool.free(torch.tensor([8]))
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        pool.free(torch.tensor([-1]))
    with pytest.raises(ValueError, match="int64"):
        pool.free(a.to(torch.int32))
    with pytest.raises(ValueError, match="int64"):
        pool.free(a.tolist())  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        pool.alloc(-1)
    assert pool.num_free == 6
    pool.check_integrity()


def test_check_integrity_catches_a_corrupted_free_list():
    pool = make_pool(8)
    pool.alloc(3)
    pool.check_integrity()
    pool._free_stack[0] = 0  # an allocated id now also sits on the free list
    with pytest.raises(CacheIntegrityError, match="marked allocated"):
        pool.check_integrity()
    pool = make_pool(8)
    pool.alloc(3)
    pool._num_free += 1  # the counter drifts from the mask
    with pytest.raises(CacheIntegrityError, match="allocated mask counts 3"):
        pool.check_integrity()


def test_invalid_construction_names_the_option():
    with pytest.raises(ConfigError, match="num_slots=0"):
        KVPool(0, 1, 1, 1, torch.float32, "cpu")
    with pytest.raises(ConfigError, match="head_dim=-2"):
        KVPool(4, 1, 1, -2, torch.float32, "cpu")


def test_sizing_helpers():
    assert KVPool.bytes_per_token(30, 3, 64, torch.bfloat16) == 2 * 30 * 3 * 64 * 2
    assert KVPool.bytes_per_token(2, 1, 8, torch.float32) == 128
    assert KVPool.slots_for_memory(1000, 2, 1, 8, torch.float32) == 7
    assert KVPool.slots_for_memory(127, 2, 1, 8, torch.float32) == 0
    with pytest.raises(ValueError):
        KVPool.slots_for_memory(-1, 2, 1, 8, torch.float32)
    # The pool actually uses what the helper promises.
    pool = KVPool(5, 2, 1, 8, torch.float32, "cpu")
    used = sum(t.numel() * t.element_size() for t in (pool._k, pool._v))
    assert used == 5 * KVPool.bytes_per_token(2, 1, 8, torch.float32)


def _resident_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_released_memory_goes_back_and_comes_back_zeroed() -> None:
    """`release_memory` hands a written CPU pool's pages back (resident memory falls by about
    the pool's size) and `restore_memory` leaves it usable, all zeros; the control: a written
    pool that was not released still holds what was written."""
    pool = KVPool(4096, 4, 8, 64, torch.float32, "cpu")  # 2 x 32 MiB
    kept = KVPool(16, 1, 1, 4, torch.float32, "cpu")
    for p in (pool, kept):
        p._k.fill_(1.0)
        p._v.fill_(1.0)
    before = _resident_kib()
    pool.release_memory()
    assert before - _resident_kib() > 48 * 1024
    pool.restore_memory()
    assert not pool._k.any() and not pool._v.any()
    assert pool.k_cache(3).shape == (4096, 8, 64)
    assert kept._k.all() and kept._v.all()
