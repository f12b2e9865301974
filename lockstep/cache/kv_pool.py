"""The KV pool: token-granular slots of key/value storage, and who holds them.

One slot holds one token's K and V for every layer. Storage is two zero-initialised tensors
of shape [num_layers, num_slots, num_kv_heads, head_dim] on the compute device (on the CPU
in anonymous memory the kernel hands out zeroed as it is first written: a pool takes RAM for
the slots used, which the first-fit order below keeps to a prefix, not for its size);
`k_cache(layer)` and `v_cache(layer)` are views into them, so a slot id indexes the same token
in every layer. A pool without values (`values=False`, multi-head latent attention, whose
values are the first columns of its key rows) holds one tensor, which both views show. The page size the attention kernels use is their own detail: the pool only
hands out slot ids.

A pool asked for routing (`routed_experts=(sparse layers, top_k, dtype)`) also holds
`routed_experts` [num_slots, sparse layers, top_k]: each slot's routed experts, written with
its K/V (lockstep/cache/routed_experts.py); None otherwise.

Contracts
- `alloc(n)` returns n distinct slot ids (int64, on the CPU) or raises `KVPoolExhausted`
  naming the request and what is free; it never returns a partial allocation.
- `free(slots)` returns slots to the pool. Freeing a slot that is not allocated (a double free,
  or an id never handed out) or naming a slot twice in one call raises `ValueError` and changes
  nothing, so an ownership bug surfaces where it happens instead of as two requests sharing KV.
- Allocation order is deterministic: a LIFO free list that starts as 0, 1, 2, ... so the same
  sequence of calls always yields the same ids (useful when debugging; results must not depend
  on which slots are used, and the engine's tests check that they do not).
- Freed slots keep their stale K/V: a slot's contents are meaningful only after its owner
  writes them.
"""

from __future__ import annotations

import math
import mmap

import torch

from lockstep.errors import ConfigError, LockstepError


class KVPoolExhausted(LockstepError):
    """The pool has fewer free slots than requested; the caller may evict or preempt and retry."""

    def __init__(self, requested: int, free: int, total: int) -> None:
        self.requested = requested
        self.free = free
        self.total = total
        super().__init__(f"KV pool exhausted: requested {requested} slots, {free} free of {total}")


class CacheIntegrityError(RuntimeError):
    """An accounting or structural invariant of the pool or the radix cache does not hold.

    This is a bug in Lockstep (a leak or a double ownership), never a user error; the message
    names the quantities that disagree.
    """


class KVPool:
    """Token-granular KV storage for every layer, with an allocator of slot ids."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        spare_slots: int = 0,
        values: bool = True,
        routed_experts: tuple[int, int, torch.dtype] | None = None,
    ) -> None:
        """`spare_slots`: rows of storage past `num_slots` that are never allocated (ids
        num_slots.., `spare_slot`): a scratch row for writes whose values nobody reads.
        `values`: whether V is stored apart from K (False: `v_cache` is `k_cache`).
        `routed_experts`: (sparse layers, top_k, integer dtype) of the routing store, or None
        for none (module docstring)."""
        for name, value in (
            ("num_slots", num_slots),
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"KVPool {name}={value!r} is invalid: expected an integer >= 1")
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.spare_slot = num_slots if spare_slots else None
        shape = (num_layers, num_slots + spare_slots, num_kv_heads, head_dim)
        # CPU pools: the anonymous mappings behind the tensors (`release_memory`).
        self._mappings: list[mmap.mmap] = []
        self._k = self._zeros(shape, dtype)
        self.values = values
        self._v = self._zeros(shape, dtype) if values else self._k
        self.routed_experts: torch.Tensor | None = None
        if routed_experts is not None:
            layers, top_k, id_dtype = routed_experts
            self.routed_experts = self._zeros((num_slots + spare_slots, layers, top_k), id_dtype)
        # A stack of free ids: the top is the end of the used prefix [0, _num_free). It starts
        # reversed so that the first allocations hand out 0, 1, 2, ...
        self._free_stack = torch.arange(num_slots - 1, -1, -1, dtype=torch.int64)
        self._num_free = num_slots
        self._allocated = torch.zeros(num_slots, dtype=torch.bool)

    # ---- storage -------------------------------------------------------------------------

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero tensor; on the CPU one in a private anonymous mapping, whose pages the kernel
        zeroes and makes resident when first touched (page-aligned, so SIMD loads stay
        aligned). torch.zeros would write every byte at start-up: seconds and gigabytes of RSS
        for a server-sized pool that serves one short answer."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=self.device)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.zeros(shape, dtype=dtype)
        memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._mappings.append(memory)
        # The tensor keeps `memory` alive too (torch.frombuffer holds the buffer).
        return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)

    def release_memory(self) -> None:
        """Give the storage's memory back to the device (or the operating system), its
        contents lost; `restore_memory` makes it usable again, all zeros. Slot bookkeeping is
        the caller's: nothing may hold KV across the two (lockstep/engine/memory_occupation.py)."""
        if self._mappings:  # anonymous pages: dropped now, zero-filled when next touched
            for memory in self._mappings:
                memory.madvise(mmap.MADV_DONTNEED)
            return
        for tensor in self._storage():
            tensor.untyped_storage().resize_(0)

    def restore_memory(self) -> None:
        """Undo `release_memory`: the storage again, zeroed (unused rows hold zeros, never
        NaN)."""
        if self._mappings:
            return
        for tensor in self._storage():
            tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
            tensor.zero_()

    def _storage(self) -> list[torch.Tensor]:
        """The distinct tensors the pool holds: K, V (when apart), the routing store."""
        tensors = [self._k, self._v, self.routed_experts]
        return list({id(t): t for t in tensors if t is not None}.values())

    def k_cache(self, layer: int) -> torch.Tensor:
        """Keys of `layer`: a [num_slots, num_kv_heads, head_dim] view, indexed by slot id."""
        return self._k[layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        """Values of `layer`: a [num_slots, num_kv_heads, head_dim] view, indexed by slot id."""
        return self._v[layer]

    # ---- allocation ----------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_allocated(self) -> int:
        return self.num_slots - self._num_free

    def alloc(self, n: int) -> torch.Tensor:
        """Take `n` free slots; int64 ids on the CPU. All or nothing: raises KVPoolExhausted."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"KVPool.alloc n={n!r} is invalid: expected an integer >= 0")
        if n > self._num_free:
            raise KVPoolExhausted(n, self._num_free, self.num_slots)
        top = self._num_free
        # flip() copies, so the ids returned never alias the free stack that later frees overwrite.
        slots = self._free_stack[top - n : top].flip(0)
        self._num_free = top - n
        self._allocated[slots] = True
        return slots

    def free(self, slots: torch.Tensor) -> None:
        """Return allocated slots to the pool; raises ValueError (and changes nothing) on misuse."""
        slots = self._validated(slots, "free")
        n = slots.numel()
        if n == 0:
            return
        held = self._allocated[slots]
        if not bool(held.all()):
            bad = slots[~held]
            raise ValueError(
                f"KVPool.free of {bad.numel()} slot(s) that are not allocated (double free or never "
                f"allocated): {_preview(bad)}"
            )
        if torch.unique(slots).numel() != n:
            raise ValueError(f"KVPool.free names a slot more than once: {_preview(slots)}")
        self._allocated[slots] = False
        # Pushed reversed so that alloc(n) right after free(s) gives back s in the same order.
        self._free_stack[self._num_free : self._num_free + n] = slots.flip(0)
        self._num_free += n

    def is_allocated(self, slots: torch.Tensor) -> torch.Tensor:
        """Bool mask: which of `slots` are currently allocated (held by someone)."""
        return self._allocated[self._validated(slots, "is_allocated")]

    def check_integrity(self) -> None:
        """Verify the free list and the allocated mask agree; raises CacheIntegrityError."""
        free = self._free_stack[: self._num_free]
        num_marked = int(self._allocated.sum())
        problems = []
        if num_marked != self.num_slots - self._num_free:
            problems.append(
                f"allocated mask counts {num_marked} but num_slots - num_free = "
                f"{self.num_slots} - {self._num_free} = {self.num_slots - self._num_free}"
            )
        if torch.unique(free).numel() != free.numel():
            problems.append(f"free list of {free.numel()} ids holds duplicates")
        marked = free[self._allocated[free]]
        if marked.numel():
            problems.append(
                f"{marked.numel()} free-list ids are marked allocated: {_preview(marked)}"
            )
        if problems:
            raise CacheIntegrityError("KVPool: " + "; ".join(problems))

    def _validated(self, slots: torch.Tensor, op: str) -> torch.Tensor:
        if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.dim() != 1:
            raise ValueError(
                f"KVPool.{op} expects a 1-D int64 tensor of slot ids, got "
                f"{type(slots).__name__} {getattr(slots, 'dtype', '')} "
                f"{tuple(getattr(slots, 'shape', ()))}"
            )
        if slots.device.type != "cpu":
            raise ValueError(f"KVPool.{op} expects slot ids on the CPU, got {slots.device}")
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.num_slots):
            raise ValueError(
                f"KVPool.{op}: slot ids must lie in [0, {self.num_slots}), got min "
                f"{int(slots.min())} max {int(slots.max())}"
            )
        return slots

    # ---- sizing --------------------------------------------------------------------------

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one slot takes: K and V, every layer."""
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    @staticmethod
    def slots_for_memory(
        memory_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """How many slots fit in `memory_bytes` (rounded down; 0 if not even one fits)."""
        if memory_bytes < 0:
            raise ValueError(f"memory_bytes={memory_bytes!r} is invalid: expected >= 0")
        return int(memory_bytes) // KVPool.bytes_per_token(
            num_layers, num_kv_heads, head_dim, dtype
        )

    def __repr__(self) -> str:
        return (
            f"KVPool(num_slots={self.num_slots}, free={self._num_free}, layers={self.num_layers}, "
            f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, "
            f"device={self.device})"
        )


def _preview(slots: torch.Tensor, limit: int = 8) -> str:
    ids = slots[:limit].tolist()
    more = f" ... ({slots.numel()} in all)" if slots.numel() > limit else ""
    return f"{ids}{more}"
