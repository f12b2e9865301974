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
- Stored logprobs (`stored_logprobs.py`): beside the slot of each cached position p, a node
  may hold the logprob of key token p given the tokens before it (read from the logits of
  position p-1) and its top alternatives, wherever some request computed them: prompt
  positions of requests that asked for prompt logprobs, and sampled tokens. Like the KV, it is
  a pure function of the token path 0..p, so it is keyed by the path and travels with it:
  split with the edge, evicted with the node, never shared across namespaces. Position 0 has
  none. Positions whose logprob was never computed store nothing; `insert` adds what the
  caller computed and never discards what the tree holds.

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

Logprobs in `insert(tokens, slots, logprobs=...)` are the rows the caller computed for the last
len(logprobs) positions of exactly these tokens. New positions take them as they are; on the
cached prefix each position keeps whichever row holds more alternatives (by the contract the
values agree). `check_integrity` checks every stored row against its token where alternatives
exist (`StoredLogprobs.problems`).

Scored match (`match_prefix_with_logprobs`), for a request that must return the logprob of
every position from `first` on: the logprob of token M comes from the logits of position M-1,
so reusing the KV of positions 0..M-1 and computing from M is exact only if positions first..M
are served from the tree. The match is the largest such M (at most len(tokens)-1, so at least
one position is computed):

    tokens       t0  t1  t2  t3  t4  t5 | t6  t7        the tree holds t0..t5 (L = 6)
    stored lp     -  y   y   y   y   y  |               first = 1: every one of 1..5 stored
    KV reused    [t0 .. t4]  M = 5      | computed from position 5 (its logits give lp of t6)
    from tree    lp 1..5

A position whose row holds fewer alternatives than asked (or none) ends the match before it,
so a match never serves fewer alternatives than asked; the returned rows are copies, safe to
read after later splits and evictions.

Linear-attention states (hybrid models, `state_aligned=True`): beside the KV, a node may hold
snapshots of the linear layers' state after some of its positions (`LinearSnapshot`, taken at
chunk boundaries; `states` maps an offset 1..len(key) in the node to the snapshot after that
many of its tokens). Like the KV they are pure functions of the token path: split with the
edge, evicted with the node, never shared across namespaces. A match can only resume where a
snapshot exists (or at 0), so it is cut back to the last snapshot at or below the matched
length and returns that snapshot; the positions after it are recomputed (same bits, by the
contract). Snapshots are counted (`num_states`, `state_bytes`). Those lent by the cache's
`LinearSnapshotPool` (`snapshots`; lockstep/cache/linear_snapshots.py) are the tree's from
`insert` on, whether it attaches them or not: one whose position already has a snapshot, or
any given to a disabled cache, goes back to the pool at once, and an evicted node gives its
own back. `evict_for_snapshots` evicts unlocked leaves, least recently used first, until the
pool has a free slot (locked paths keep theirs: then nothing is evicted).

    tokens      t0 ............ t63 | t64 ....... t127 | t128 .. t150
    snapshots                    S64 ^             S128 ^
    a match of 150 tokens resumes at 128 with S128 (cached_tokens = 128)

Cost: match and insert compare tokens with tuple slices (C speed), so a 32k-token prompt costs
one Python step per tree node on its path, not per token. Eviction scans the tree's leaves.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from lockstep.cache.kv_pool import CacheIntegrityError, KVPool
from lockstep.cache.stored_logprobs import StoredLogprobs

if TYPE_CHECKING:
    from lockstep.cache.linear_snapshots import LinearSnapshotPool

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
        "logprobs",
        "parent",
        "children",
        "lock_ref",
        "last_access",
        "node_id",
        "namespace",
        "states",
    )

    def __init__(
        self,
        key: tuple[int, ...],
        slots: torch.Tensor,
        logprobs: StoredLogprobs,
        parent: Node | None,
        namespace: str | None,
        node_id: int,
        last_access: int,
    ) -> None:
        self.key = key
        self.slots = slots
        self.logprobs = logprobs  # one row per key token: its stored logprob, if any
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.lock_ref = 0
        self.last_access = last_access
        self.node_id = node_id
        self.namespace = namespace
        self.states: dict[int, Any] = {}  # offset in key (1..len) -> LinearSnapshot

    def __repr__(self) -> str:
        head = list(self.key[:4]) + (["..."] if len(self.key) > 4 else [])
        return (
            f"Node(id={self.node_id}, ns={self.namespace!r}, key={head}, len={len(self.key)}, "
            f"lock={self.lock_ref}, t={self.last_access}, children={len(self.children)})"
        )


class PrefixMatch(NamedTuple):
    """The longest cached prefix of a query (for a scored match: the longest usable one)."""

    length: int  # tokens matched
    slots: torch.Tensor  # int64 [length]: the tree's slots for tokens[:length]
    node: Node  # ends exactly at tokens[:length] (a root when length == 0)
    # Scored match only: a copy of the stored logprobs of positions first..length, cut to the
    # alternatives asked for (empty when length < first). None from `match_prefix`.
    logprobs: StoredLogprobs | None = None
    # state_aligned caches: the linear-attention snapshot after tokens[:length] (None at 0).
    state: Any = None


class InsertResult(NamedTuple):
    """What `insert` did; see the module docstring for who owns which slots afterwards."""

    num_existing: int  # leading tokens that were already cached (the tree kept its own slots)
    num_cached: int  # leading tokens the tree holds now: len(tokens), or 0 when disabled
    node: Node  # ends exactly at tokens[:num_cached]
    cached_slots: torch.Tensor  # int64 [num_cached]: the tree's slots for tokens[:num_cached]
    duplicate_slots: torch.Tensor  # int64: caller slots in [0, num_existing) to free now


class RadixCache:
    """Prefix cache over a `KVPool`; see the module docstring for the contracts."""

    def __init__(
        self,
        pool: KVPool,
        enabled: bool = True,
        state_aligned: bool = False,
        snapshots: LinearSnapshotPool | None = None,
    ) -> None:
        self.pool = pool
        self.enabled = enabled
        self.state_aligned = state_aligned
        self.snapshots = snapshots
        self._num_states = 0
        self._state_bytes = 0
        self.num_evicted_states = 0  # snapshots given back to their pool by eviction, ever
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
    def num_states(self) -> int:
        """Linear-attention snapshots the tree holds."""
        return self._num_states

    @property
    def state_bytes(self) -> int:
        """Bytes of the snapshots the tree holds."""
        return self._state_bytes

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
        root, path = self._descend(key, namespace)
        length, state = self._state_floor(path, sum(n for _, n in path))
        node, length, nodes = self._cut(root, path, length)
        return PrefixMatch(length, _cat([n.slots for n in nodes]), node, None, state)

    def match_prefix_with_logprobs(
        self, tokens: Sequence[int], namespace: str | None, *, first: int, num_top: int
    ) -> PrefixMatch:
        """The longest prefix whose KV a request may reuse when it must return the logprob
        (with `num_top` alternatives) of every position from `first` (>= 1) on: the largest
        M <= len(tokens) - 1 such that the tree holds tokens[:M] and every position first..M
        has a stored logprob with at least `num_top` alternatives (module docstring, "Scored
        match"). The result's `logprobs` are those of positions first..M; `node` ends at M.
        Marks the nodes of tokens[:M] recently used and splits an edge only at M.
        """
        if first < 1 or num_top < 0:
            raise ValueError(f"match_prefix_with_logprobs: first={first}, num_top={num_top}")
        if not self.enabled:
            return PrefixMatch(0, _no_slots(), self._default_root, StoredLogprobs.empty(0))
        key = _as_key(tokens)
        root, path = self._descend(key, namespace)
        # The first position at or after `first` that the tree cannot serve.
        short, at = None, 0
        for node, n in path:
            if at + n > first:
                offset = node.logprobs.first_short(max(first - at, 0), num_top)
                if offset < n:
                    short = at + offset
                    break
            at += n
        held = at if short is None else sum(n for _, n in path)
        if short is None:
            short = max(held, first)
        length = max(0, min(len(key) - 1, held, short - 1))
        length, state = self._state_floor(path, length)
        logprobs = self._stored(path, first, length + 1, num_top)
        node, length, nodes = self._cut(root, path, length)
        return PrefixMatch(length, _cat([n.slots for n in nodes]), node, logprobs, state)

    def insert(
        self,
        tokens: Sequence[int],
        slots: torch.Tensor,
        namespace: str | None = None,
        logprobs: StoredLogprobs | None = None,
        states: dict[int, Any] | None = None,
    ) -> InsertResult:
        """Cache `tokens` whose KV lives in `slots` (one per token; int64 on the CPU), and
        `logprobs`, the stored logprobs of the last len(logprobs) positions of `tokens` (the
        ones the caller computed; None: none), and `states`, linear-attention snapshots by
        position (1..len(tokens)); a position that already has one keeps it, and the caller's
        goes back to its pool (the tree takes every snapshot it is given).

        The tree keeps its own slots for the prefix already cached and takes `slots` for the
        rest; the caller frees `duplicate_slots`. On the cached prefix, a position takes the
        caller's logprob row where it holds more alternatives than the tree's. Raises
        ValueError, before taking anything, if a slot to take is already owned by the tree,
        not allocated, or named twice, or if `logprobs` do not fit `tokens`.
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
        if logprobs is None:
            logprobs = StoredLogprobs.empty(0)
        covered_from = len(key) - len(logprobs)
        if covered_from < 0:
            raise ValueError(
                f"RadixCache.insert: {len(logprobs)} logprob rows for {len(key)} tokens"
            )
        if covered_from == 0 and len(logprobs) and int(logprobs.num_top[0]) != -1:
            raise ValueError("RadixCache.insert: a logprob for position 0, which has none")
        if not self.enabled:
            for snap in (states or {}).values():
                snap.release()
            return InsertResult(0, 0, self._default_root, _no_slots(), _no_slots())
        root, path = self._descend(key, namespace)
        node, num_existing, nodes = self._cut(root, path, sum(n for _, n in path))
        existing = _cat([n.slots for n in nodes])
        theirs = slots[:num_existing]
        duplicates = theirs[theirs != existing]
        if duplicates.numel() and bool(self._owned[duplicates].any()):
            raise ValueError(
                "RadixCache.insert: the caller's slots for the cached prefix include slots the "
                f"tree owns at other positions: {duplicates[self._owned[duplicates]].tolist()[:8]}"
            )
        new = slots[num_existing:]
        if new.numel():
            if bool(self._owned[new].any()):
                raise ValueError(
                    "RadixCache.insert: slots to cache are already owned by the tree: "
                    f"{new[self._owned[new]].tolist()[:8]}"
                )
            if not bool(self.pool.is_allocated(new).all()):
                raise ValueError("RadixCache.insert: slots to cache include slots free in the pool")
            if torch.unique(new).numel() != new.numel():
                raise ValueError("RadixCache.insert: slots to cache name a slot more than once")
        self._merge_logprobs(nodes, logprobs, covered_from)
        if new.numel() == 0:
            self._add_states(nodes, states or {})
            return InsertResult(num_existing, len(key), node, existing, duplicates)
        if covered_from <= num_existing:
            leaf_logprobs = logprobs.slice(num_existing - covered_from, len(logprobs))
        else:
            leaf_logprobs = StoredLogprobs.cat(
                [StoredLogprobs.empty(covered_from - num_existing), logprobs]
            )
        # clone(): the caller's tensor is often a view of its slot table, which it will reuse.
        leaf = Node(
            key[num_existing:],
            new.clone(),
            leaf_logprobs,
            node,
            node.namespace,
            self._new_node_id(),
            self._clock,
        )
        node.children[leaf.key[0]] = leaf
        self._owned[new] = True
        self._num_cached += new.numel()
        self._add_states([*nodes, leaf], states or {})
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
        return self._evict_until(lambda freed: freed >= num_tokens)

    def _evict_until(self, enough: Callable[[int], bool]) -> int:
        """Evict unlocked leaves LRU first until enough(slots freed so far) holds."""
        heap = [
            (n.last_access, n.node_id, n)
            for n in self._nodes()
            if n.parent is not None and not n.children and n.lock_ref == 0
        ]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while heap and not enough(num_freed):
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            leaf.parent = None  # detached: lock() on this handle now raises
            freed.append(leaf.slots)
            num_freed += len(leaf.key)
            self._num_states -= len(leaf.states)
            self.num_evicted_states += len(leaf.states)
            self._state_bytes -= sum(snap.nbytes for snap in leaf.states.values())
            for snap in leaf.states.values():
                snap.release()
            leaf.states = {}
            # A parent is touched whenever a child is, so it is never older than the leaf just
            # popped: pushing it keeps the eviction order LRU.
            if not parent.children and parent.lock_ref == 0 and parent.parent is not None:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        if not freed:
            return 0
        slots = torch.cat(freed)
        self._owned[slots] = False
        self._num_cached -= num_freed
        self.pool.free(slots)
        self._drop_empty_namespaces()
        return num_freed

    def evict_for_snapshots(self, n: int = 1) -> int:
        """Evict unlocked leaves (their KV and snapshots), LRU first, until the snapshot pool
        has `n` free slots; nothing when no unlocked node holds one of its snapshots (evicting
        could not free a slot). Returns the KV slots freed."""
        snapshots = self.snapshots
        if snapshots is None or snapshots.num_free >= n:
            return 0
        if not any(
            node.lock_ref == 0 and any(s.pool is snapshots for s in node.states.values())
            for node in self._nodes()
        ):
            return 0
        freed = self._evict_until(lambda _: snapshots.num_free >= n)
        self._drop_empty_namespaces()
        return freed

    def pooled_snapshots(self) -> list[Any]:
        """The tree's snapshots lent by `snapshots` (for the pool's integrity check)."""
        return [s for n in self._nodes() for s in n.states.values() if s.pool is self.snapshots]

    def flush(self) -> int:
        """Evict everything unlocked (POST /flush_cache); returns the slots freed."""
        return self.evict(self.num_evictable_tokens)

    # ---- integrity -----------------------------------------------------------------------

    def check_integrity(self, in_use: int) -> None:
        """Verify the books balance and the tree is well formed, stored logprobs included
        (one row per key token, none at position 0, each row consistent with its token:
        `StoredLogprobs.problems`); raises CacheIntegrityError.

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
        cached = locked = num_states = state_bytes = 0
        all_slots: list[torch.Tensor] = []
        scored: list[Node] = []
        depth = {id(root): 0 for root in self._roots.values()}
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
            for child in n.children.values():
                depth[id(child)] = depth.get(id(n), 0) + len(child.key)
            if n.parent is None:
                continue
            if not n.key:
                problems.append(f"empty non-root node: {n!r}")
            start = depth.get(id(n), 0) - len(n.key)
            for offset, snap in n.states.items():
                if not 1 <= offset <= len(n.key) or snap.position != start + offset:
                    problems.append(f"snapshot for position {snap.position} at offset {offset} "
                                    f"of a node starting at {start}: {n!r}")  # fmt: skip
            num_states += len(n.states)
            state_bytes += sum(snap.nbytes for snap in n.states.values())
            if n.slots.dtype != torch.int64 or n.slots.shape != (len(n.key),):
                problems.append(
                    f"node holds slots {n.slots.dtype} {tuple(n.slots.shape)} for "
                    f"{len(n.key)} tokens: {n!r}"
                )
            if not isinstance(n.logprobs, StoredLogprobs) or len(n.logprobs) != len(n.key):
                problems.append(f"node holds stored logprobs {n.logprobs!r} for {len(n.key)} "
                                f"tokens: {n!r}")  # fmt: skip
            else:
                if n.parent.parent is None and int(n.logprobs.num_top[0]) != -1:
                    problems.append(f"a logprob stored for position 0: {n!r}")
                scored.append(n)
            cached += len(n.key)
            locked += len(n.key) if n.lock_ref > 0 else 0
            all_slots.append(n.slots)
        if cached != self._num_cached:
            problems.append(f"num_cached_tokens {self._num_cached} != recount {cached}")
        if locked != self._num_locked:
            problems.append(f"num_locked_tokens {self._num_locked} != recount {locked}")
        if (num_states, state_bytes) != (self._num_states, self._state_bytes):
            problems.append(f"snapshots {self._num_states} ({self._state_bytes} bytes) != "
                            f"recount {num_states} ({state_bytes} bytes)")  # fmt: skip
        if num_states and not self.state_aligned:
            problems.append(f"{num_states} snapshots in a cache that is not state_aligned")
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
        problems += _logprob_problems(scored)
        if problems:
            raise CacheIntegrityError("RadixCache: " + "; ".join(problems))

    # ---- internals -----------------------------------------------------------------------

    def _root(self, namespace: str | None) -> Node:
        root = self._roots.get(namespace)
        if root is None:
            root = Node(
                (), _no_slots(), StoredLogprobs.empty(0), None, namespace, self._new_node_id(),
                self._clock,
            )  # fmt: skip
            self._roots[namespace] = root
        return root

    def _new_node_id(self) -> int:
        self._next_node_id += 1
        return self._next_node_id

    def _descend(
        self, key: tuple[int, ...], namespace: str | None
    ) -> tuple[Node, list[tuple[Node, int]]]:
        """Follow `key` down from its namespace root without changing anything. Returns the
        root and the path: each node with how many of its key tokens match (all but maybe
        the last node's)."""
        root = self._root(namespace)
        node, pos = root, 0
        path: list[tuple[Node, int]] = []
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common_prefix_len(child.key, key, pos)
            path.append((child, n))
            if n < len(child.key):
                break
            pos += n
            node = child
        return root, path

    def _cut(
        self, root: Node, path: list[tuple[Node, int]], length: int
    ) -> tuple[Node, int, list[Node]]:
        """Take the first `length` tokens of a `_descend` path: split the edge where they end
        inside one and touch every node on the way. Returns (end node, length, nodes)."""
        self._clock += 1
        root.last_access = self._clock
        node, pos = root, 0
        nodes: list[Node] = []
        for child, n in path:
            if pos == length:
                break
            take = min(n, length - pos)
            if take < len(child.key):
                child = self._split(child, take)
            child.last_access = self._clock
            nodes.append(child)
            pos += take
            node = child
        return node, pos, nodes

    def _state_floor(self, path: list[tuple[Node, int]], length: int) -> tuple[int, Any]:
        """In a state_aligned cache, the last position <= length holding a snapshot along a
        `_descend` path, and that snapshot ((0, None) if none); else (length, None)."""
        if not self.state_aligned:
            return length, None
        best: tuple[int, Any] = (0, None)
        at = 0
        for node, n in path:
            for offset, snap in node.states.items():
                if offset <= n and at + offset <= length and at + offset > best[0]:
                    best = (at + offset, snap)
            at += n
        return best

    def _add_states(self, nodes: list[Node], states: dict[int, Any]) -> None:
        """Attach snapshots by position to the nodes of an insert's path (root excluded,
        in order), where the position has none yet; give the others back to their pool."""
        if not states:
            return
        taken = set()
        at = 0
        for node in nodes if self.state_aligned else []:
            for position, snap in states.items():
                offset = position - at
                if 1 <= offset <= len(node.key) and offset not in node.states:
                    node.states[offset] = snap
                    taken.add(position)
                    self._num_states += 1
                    self._state_bytes += snap.nbytes
            at += len(node.key)
        for position, snap in states.items():
            if position not in taken:
                snap.release()

    @staticmethod
    def _stored(path: list[tuple[Node, int]], start: int, end: int, num_top: int) -> StoredLogprobs:
        """Copy of the stored logprobs of positions start..end-1 along a `_descend` path (which
        must hold them), cut to `num_top` alternative columns."""
        parts, at = [], 0
        for node, n in path:
            lo, hi = max(start, at), min(end, at + n)
            if lo < hi:
                parts.append(node.logprobs.slice(lo - at, hi - at, num_top))
            at += n
        return StoredLogprobs.cat(parts) if parts else StoredLogprobs.empty(0, num_top)

    @staticmethod
    def _merge_logprobs(nodes: list[Node], logprobs: StoredLogprobs, covered_from: int) -> None:
        """Give the cached nodes along an insert's path the caller's rows where they hold
        more (positions covered_from.. of the path)."""
        at = 0
        for node in nodes:
            lo = max(covered_from, at)
            hi = at + len(node.key)
            if lo < hi:
                rows = logprobs.slice(lo - covered_from, hi - covered_from)
                node.logprobs = node.logprobs.merged(rows, lo - at)
            at = hi

    def _split(self, node: Node, n: int) -> Node:
        """Cut `node`'s edge after n tokens. The new node is the upper half, so existing handles
        to `node` still end at the same prefix; the upper half inherits the lock count because
        every lock that passes through `node` passes through it too."""
        parent = node.parent
        assert parent is not None and 0 < n < len(node.key)
        upper = Node(
            node.key[:n],
            node.slots[:n].clone(),
            node.logprobs.slice(0, n),
            parent,
            node.namespace,
            self._new_node_id(),
            node.last_access,
        )
        upper.lock_ref = node.lock_ref
        upper.states = {o: snap for o, snap in node.states.items() if o <= n}
        node.states = {o - n: snap for o, snap in node.states.items() if o > n}
        upper.children[node.key[n]] = node
        parent.children[node.key[0]] = upper
        node.key = node.key[n:]
        node.slots = node.slots[n:].clone()
        node.logprobs = node.logprobs.slice(n, len(node.logprobs))
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


def _logprob_problems(nodes: list[Node]) -> list[str]:
    """Every node's stored logprobs checked against its tokens, in one vectorized pass over
    all of them; on a failure, the first node at fault and its own findings."""
    if not nodes or not StoredLogprobs.cat([n.logprobs for n in nodes]).problems(
        [t for n in nodes for t in n.key]
    ):
        return []
    for n in nodes:
        found = n.logprobs.problems(n.key)
        if found:
            return [f"stored logprobs of {n!r}: " + "; ".join(found)]
    return ["stored logprobs: a problem in the whole that no single node shows"]


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
