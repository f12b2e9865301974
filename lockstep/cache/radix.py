"""Radix prefix cache: a radix tree over token ids whose nodes own KV slots.

Sharing KV by prefix is exact in Lockstep because the KV written for position t is a pure
function of tokens 0..t (docs/design.md, "The contract"); this module only has to keep the books.

Contracts
- Token-granular: a node whose key holds L tokens owns exactly L slots of the `KVPool`; slot i
  holds the KV of key[i]. Children are keyed by their first token; no non-root node is empty.
- Namespaces: each namespace (None, a cache salt, an adapter name) has its own root, so equal
  tokens in different namespaces never share KV. Roots own no slots and are never evicted; an
  empty, unlocked namespace root is dropped by the next `evict`/`flush`.
- Locks: `lock(node)` adds one to the lock count of `node` and of every ancestor up to its root;
  a node with a lock count above zero is never evicted. Lock a node for as long as a request
  reads its slots, and unlock the very node you locked.
- Node handles: `match_prefix` and `insert` return the node that ends exactly at the prefix.
  When a later match or insert splits an edge, the upper half is a new node and the existing
  object keeps the lower half, so a handle always ends at the same prefix. An unlocked handle
  may be evicted by the next `evict`/`flush`; locking it afterwards raises ValueError.
- Eviction frees whole unlocked leaves, least recently used first; recency is a logical clock
  bumped by every match and insert (ties broken by node creation order), never wall time, so
  the same calls evict the same entries.
- Disabled (`enabled=False`): match finds nothing and insert takes nothing, through the same
  calls and result types, so the engine has one code path.

Ownership in `insert(tokens, slots)`:

    tokens        t0  t1  t2  t3 | t4  t5  t6        already in the tree: t0..t3
    tree's slots  s0  s1  s2  s3 |                   num_existing = 4
    your slots    a0  a1  a2  a3 | a4  a5  a6
                  <- compared -> | <- the tree takes them (num_cached = 7)
    a_i == s_i  the same id (your prefix came from match_prefix): nothing to do
    a_i != s_i  duplicate KV: listed in InsertResult.duplicate_slots, you free them now
    disabled    num_existing = num_cached = 0: the tree takes nothing, you keep every slot

After insert you own exactly `duplicate_slots` and `slots[num_cached:]`; the tree's slots for
tokens[:num_cached] are `InsertResult.cached_slots`. A finished request frees both parts it
owns and unlocks its old node; an unfinished one (chunked prefill) frees `duplicate_slots`,
continues on `cached_slots + slots[num_cached:]`, locks the new node and unlocks the old.

Cost: match and insert compare tokens with tuple slices (C speed), so a 32k-token prompt costs
one Python step per tree node on its path, not per token. Eviction scans the tree's leaves.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from lockstep.cache.kv_pool import CacheIntegrityError, KVPool

__all__ = ["CacheIntegrityError", "InsertResult", "Node", "PrefixMatch", "RadixCache"]

# Tokens compared per slice while looking for the first mismatch inside an edge.
_COMPARE_CHUNK = 64


def _no_slots() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


class Node:
    """One edge of the radix tree and the slots of its tokens.

    Callers treat nodes as opaque handles (for `lock`/`unlock`); the fields are read-only
    outside this module.
    """

    __slots__ = (
        "key",
        "slots",
        "parent",
        "children",
        "lock_ref",
        "last_access",
        "node_id",
        "namespace",
    )

    def __init__(
        self,
        key: tuple[int, ...],
        slots: torch.Tensor,
        parent: Node | None,
        namespace: str | None,
        node_id: int,
        last_access: int,
    ) -> None:
        self.key = key
        self.slots = slots
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.lock_ref = 0
        self.last_access = last_access
        self.node_id = node_id
        self.namespace = namespace

    def __repr__(self) -> str:
        head = list(self.key[:4]) + (["..."] if len(self.key) > 4 else [])
        return (
            f"Node(id={self.node_id}, ns={self.namespace!r}, key={head}, len={len(self.key)}, "
            f"lock={self.lock_ref}, t={self.last_access}, children={len(self.children)})"
        )


class PrefixMatch(NamedTuple):
    """The longest cached prefix of a query."""

    length: int  # tokens matched
    slots: torch.Tensor  # int64 [length]: the tree's slots for tokens[:length]
    node: Node  # ends exactly at tokens[:length] (a root when length == 0)


class InsertResult(NamedTuple):
    """What `insert` did; see the module docstring for who owns which slots afterwards."""

    num_existing: int  # leading tokens that were already cached (the tree kept its own slots)
    num_cached: int  # leading tokens the tree holds now: len(tokens), or 0 when disabled
    node: Node  # ends exactly at tokens[:num_cached]
    cached_slots: torch.Tensor  # int64 [num_cached]: the tree's slots for tokens[:num_cached]
    duplicate_slots: torch.Tensor  # int64: caller slots in [0, num_existing) to free now


class RadixCache:
    """Prefix cache over a `KVPool`; see the module docstring for the contracts."""

    def __init__(self, pool: KVPool, enabled: bool = True) -> None:
        self.pool = pool
        self.enabled = enabled
        self._clock = 0
        self._next_node_id = 0
        self._roots: dict[str | None, Node] = {}
        self._default_root = self._root(None)
        # Which pool slots the tree owns: catches a caller handing the tree one of its own
        # slots, in O(len) per call.
        self._owned = torch.zeros(pool.num_slots, dtype=torch.bool)
        self._num_cached = 0
        self._num_locked = 0

    # ---- counters ------------------------------------------------------------------------

    @property
    def num_cached_tokens(self) -> int:
        """Slots the tree owns."""
        return self._num_cached

    @property
    def num_locked_tokens(self) -> int:
        """Slots in nodes with a lock count above zero (not evictable)."""
        return self._num_locked

    @property
    def num_evictable_tokens(self) -> int:
        """Slots that repeated eviction could free: those of unlocked nodes."""
        return self._num_cached - self._num_locked

    # ---- lookups and inserts -------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int], namespace: str | None = None) -> PrefixMatch:
        """Longest cached prefix of `tokens` in `namespace`; marks its nodes recently used.

        Splits an edge when the match ends inside it, so that `node` ends exactly there.
        """
        if not self.enabled:
            return PrefixMatch(0, _no_slots(), self._default_root)
        key = _as_key(tokens)
        node, length, parts = self._walk(key, namespace)
        return PrefixMatch(length, _cat(parts), node)

    def insert(
        self, tokens: Sequence[int], slots: torch.Tensor, namespace: str | None = None
    ) -> InsertResult:
        """Cache `tokens` whose KV lives in `slots` (one per token; int64 on the CPU).

        The tree keeps its own slots for the prefix already cached and takes `slots` for the
        rest; the caller frees `duplicate_slots`. Raises ValueError, before taking anything,
        if a slot to take is already owned by the tree, not allocated, or named twice.
        """
        key = _as_key(tokens)
        if (
            not isinstance(slots, torch.Tensor)
            or slots.dtype != torch.int64
            or slots.shape != (len(key),)
            or slots.device.type != "cpu"
        ):
            raise ValueError(
                f"RadixCache.insert expects slots as a CPU int64 tensor of shape ({len(key)},), "
                f"got {type(slots).__name__} {getattr(slots, 'dtype', '')} "
                f"{tuple(getattr(slots, 'shape', ()))} {getattr(slots, 'device', '')}"
            )
        if not self.enabled:
            return InsertResult(0, 0, self._default_root, _no_slots(), _no_slots())
        node, num_existing, parts = self._walk(key, namespace)
        existing = _cat(parts)
        theirs = slots[:num_existing]
        duplicates = theirs[theirs != existing]
        if duplicates.numel() and bool(self._owned[duplicates].any()):
            raise ValueError(
                "RadixCache.insert: the caller's slots for the cached prefix include slots the "
                f"tree owns at other positions: {duplicates[self._owned[duplicates]].tolist()[:8]}"
            )
        new = slots[num_existing:]
        if new.numel() == 0:
            return InsertResult(num_existing, len(key), node, existing, duplicates)
        if bool(self._owned[new].any()):
            raise ValueError(
                "RadixCache.insert: slots to cache are already owned by the tree: "
                f"{new[self._owned[new]].tolist()[:8]}"
            )
        if not bool(self.pool.is_allocated(new).all()):
            raise ValueError("RadixCache.insert: slots to cache include slots free in the pool")
        if torch.unique(new).numel() != new.numel():
            raise ValueError("RadixCache.insert: slots to cache name a slot more than once")
        # clone(): the caller's tensor is often a view of its slot table, which it will reuse.
        leaf = Node(
            key[num_existing:],
            new.clone(),
            node,
            node.namespace,
            self._new_node_id(),
            self._clock,
        )
        node.children[leaf.key[0]] = leaf
        self._owned[new] = True
        self._num_cached += new.numel()
        return InsertResult(num_existing, len(key), leaf, torch.cat([existing, new]), duplicates)

    # ---- locks ---------------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        """Protect `node` and its ancestors from eviction until the matching `unlock`."""
        for n in self._path_to_root(node):
            if n.lock_ref == 0:
                self._num_locked += len(n.key)
            n.lock_ref += 1

    def unlock(self, node: Node) -> None:
        """Undo one `lock(node)`; raises ValueError (changing nothing) if it was not locked."""
        path = self._path_to_root(node)
        for n in path:
            if n.lock_ref <= 0:
                raise ValueError(f"RadixCache.unlock of a node that is not locked: {n!r}")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._num_locked -= len(n.key)

    # ---- eviction ------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, least recently used first, until `num_tokens` slots are freed
        or nothing is evictable. Returns the slots freed (whole nodes: may exceed the ask)."""
        self._drop_empty_namespaces()
        if num_tokens <= 0 or self.num_evictable_tokens == 0:
            return 0
        heap = [
            (n.last_access, n.node_id, n)
            for n in self._nodes()
            if n.parent is not None and not n.children and n.lock_ref == 0
        ]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while heap and num_freed < num_tokens:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            leaf.parent = None  # detached: lock() on this handle now raises
            freed.append(leaf.slots)
            num_freed += len(leaf.key)
            # A parent is touched whenever a child is, so it is never older than the leaf just
            # popped: pushing it keeps the eviction order LRU.
            if not parent.children and parent.lock_ref == 0 and parent.parent is not None:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        slots = torch.cat(freed)
        self._owned[slots] = False
        self._num_cached -= num_freed
        self.pool.free(slots)
        self._drop_empty_namespaces()
        return num_freed

    def flush(self) -> int:
        """Evict everything unlocked (POST /flush_cache); returns the slots freed."""
        return self.evict(self.num_evictable_tokens)

    # ---- integrity -----------------------------------------------------------------------

    def check_integrity(self, in_use: int) -> None:
        """Verify the books balance and the tree is well formed; raises CacheIntegrityError.

        `in_use` is the number of pool slots held outside the tree (by running requests).
        """
        self.pool.check_integrity()
        problems: list[str] = []
        total = self.pool.num_free + self._num_cached + in_use
        if total != self.pool.num_slots:
            problems.append(
                f"free {self.pool.num_free} + cached {self._num_cached} + in use {in_use} = "
                f"{total} != num_slots {self.pool.num_slots}"
            )
        cached = locked = 0
        all_slots: list[torch.Tensor] = []
        for ns, root in self._roots.items():
            if root.key or root.slots.numel() or root.parent is not None or root.namespace != ns:
                problems.append(f"root of namespace {ns!r} is malformed: {root!r}")
        for n in self._nodes():
            if n.lock_ref < 0:
                problems.append(f"negative lock count: {n!r}")
            child_locks = sum(c.lock_ref for c in n.children.values())
            if n.lock_ref < child_locks:
                problems.append(f"lock count {n.lock_ref} < children's sum {child_locks}: {n!r}")
            for first, child in n.children.items():
                if child.parent is not n:
                    problems.append(f"child's parent link is wrong: {child!r}")
                if not child.key or child.key[0] != first:
                    problems.append(f"child keyed by {first} has key starting {child.key[:1]}")
                if child.namespace != n.namespace:
                    problems.append(f"child in namespace {child.namespace!r} under {n!r}")
            if n.parent is None:
                continue
            if not n.key:
                problems.append(f"empty non-root node: {n!r}")
            if n.slots.dtype != torch.int64 or n.slots.shape != (len(n.key),):
                problems.append(
                    f"node holds slots {n.slots.dtype} {tuple(n.slots.shape)} for "
                    f"{len(n.key)} tokens: {n!r}"
                )
            cached += len(n.key)
            locked += len(n.key) if n.lock_ref > 0 else 0
            all_slots.append(n.slots)
        if cached != self._num_cached:
            problems.append(f"num_cached_tokens {self._num_cached} != recount {cached}")
        if locked != self._num_locked:
            problems.append(f"num_locked_tokens {self._num_locked} != recount {locked}")
        slots = torch.cat(all_slots) if all_slots else _no_slots()
        if slots.numel():
            distinct = torch.unique(slots).numel()
            if distinct != slots.numel():
                problems.append(f"{slots.numel() - distinct} slot(s) owned by two tree positions")
            if int(slots.min()) < 0 or int(slots.max()) >= self.pool.num_slots:
                problems.append("tree holds slot ids outside the pool")
            else:
                free_in_pool = slots[~self.pool.is_allocated(slots)]
                if free_in_pool.numel():
                    problems.append(
                        f"{free_in_pool.numel()} tree slot(s) are free in the pool: "
                        f"{free_in_pool.tolist()[:8]}"
                    )
                if not bool(self._owned[slots].all()):
                    problems.append("tree slots missing from the ownership mask")
        num_marked = int(self._owned.sum())
        if num_marked != slots.numel():
            problems.append(f"ownership mask marks {num_marked}, tree holds {slots.numel()}")
        if problems:
            raise CacheIntegrityError("RadixCache: " + "; ".join(problems))

    # ---- internals -----------------------------------------------------------------------

    def _root(self, namespace: str | None) -> Node:
        root = self._roots.get(namespace)
        if root is None:
            root = Node((), _no_slots(), None, namespace, self._new_node_id(), self._clock)
            self._roots[namespace] = root
        return root

    def _new_node_id(self) -> int:
        self._next_node_id += 1
        return self._next_node_id

    def _walk(
        self, key: tuple[int, ...], namespace: str | None
    ) -> tuple[Node, int, list[torch.Tensor]]:
        """Follow `key` down from its namespace root, splitting the last edge where the match
        ends inside it; touch every node on the way. Returns (end node, length, slot parts)."""
        self._clock += 1
        node = self._root(namespace)
        node.last_access = self._clock
        pos = 0
        parts: list[torch.Tensor] = []
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common_prefix_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = self._clock
            parts.append(child.slots)
            pos += n
            node = child
        return node, pos, parts

    def _split(self, node: Node, n: int) -> Node:
        """Cut `node`'s edge after n tokens. The new node is the upper half, so existing handles
        to `node` still end at the same prefix; the upper half inherits the lock count because
        every lock that passes through `node` passes through it too."""
        parent = node.parent
        assert parent is not None and 0 < n < len(node.key)
        upper = Node(
            node.key[:n],
            node.slots[:n].clone(),
            parent,
            node.namespace,
            self._new_node_id(),
            node.last_access,
        )
        upper.lock_ref = node.lock_ref
        upper.children[node.key[n]] = node
        parent.children[node.key[0]] = upper
        node.key = node.key[n:]
        node.slots = node.slots[n:].clone()
        node.parent = upper
        return upper

    def _path_to_root(self, node: Node) -> list[Node]:
        """`node` and its ancestors; raises ValueError if `node` is no longer in the tree."""
        path = [node]
        while node.parent is not None:
            if node.parent.children.get(node.key[0]) is not node:
                raise ValueError(f"node is no longer in the cache (evicted?): {path[0]!r}")
            node = node.parent
            path.append(node)
        if self._roots.get(node.namespace) is not node:
            raise ValueError(f"node is no longer in the cache (evicted?): {path[0]!r}")
        return path

    def _nodes(self) -> Iterator[Node]:
        """Every node, roots included, in a deterministic order."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _drop_empty_namespaces(self) -> None:
        for ns in [ns for ns in self._roots if ns is not None]:
            root = self._roots[ns]
            if not root.children and root.lock_ref == 0:
                del self._roots[ns]

    def __repr__(self) -> str:
        return (
            f"RadixCache(enabled={self.enabled}, cached={self._num_cached}, "
            f"locked={self._num_locked}, namespaces={len(self._roots)}, pool={self.pool!r})"
        )


def _as_key(tokens: Sequence[int]) -> tuple[int, ...]:
    if isinstance(tokens, torch.Tensor):
        return tuple(tokens.tolist())
    return tuple(tokens)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else _no_slots()


def _common_prefix_len(edge: tuple[int, ...], key: tuple[int, ...], start: int) -> int:
    """Length of the common prefix of `edge` and key[start:], comparing slices at C speed."""
    limit = min(len(edge), len(key) - start)
    if key[start : start + limit] == edge[:limit]:
        return limit
    i = 0
    while i < limit:
        j = min(i + _COMPARE_CHUNK, limit)
        if key[start + i : start + j] != edge[i:j]:
            break
        i = j
    while edge[i] == key[start + i]:
        i += 1
    return i
