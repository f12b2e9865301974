"""Continuous batching with chunked prefill, prefix reuse and preemption by recomputation.

Each step the scheduler fills a token budget (`max_batch_tokens`):
  1. running requests: first one token for each of those decoding (oldest first), then up to
     `chunk_size` more prompt tokens for each of those still prefilling (oldest first);
  2. then waiting requests, preferring the longest cached prefix (ties: oldest first), while
     fewer than `max_running` run and the budget, the KV pool and admission allow.
Two bounds shrink the budget: a step in which a streamed request decodes (`Request.streams`:
its client reads tokens as they come) carries at most `mixed_step.rows(keys)` prompt rows
beside its decodes (lockstep/engine/step_budget.py: it costs at most about `factor`
decode-only steps, so new prompts do not stall running streams; requests answered whole only
see their total time, which the largest steps serve best), and at most `prompt_logprob_rows`
rows of a step compute prompt logprobs or verify speculative drafts (their logits are the
step's largest workspace: lockstep/engine/memory.py). Any chunking gives the same bits (the
contract).

Admission finishes what it starts: a waiting request is admitted only while the pool (free and
evictable slots) can carry it and every running request to their ends, counting for each the
prompt it has still to compute and `output_reserve` of the output it may still generate
(`max_tokens` less what it has, at most OUTPUT_RESERVE_CLIP), a slot a step, and that each
frees what it holds when it ends (lockstep/engine/admission.py). With the default share, 1.0, a
request whose max_tokens is not above the clip is never preempted; one alone in the pool is
always admitted. When the pool runs dry anyway (a smaller share, or outputs past the clip) it
first evicts unlocked radix leaves (LRU), then preempts the newest running requests: their
computed KV goes into the radix cache, where readmission finds it unless it was evicted first,
and they wait again. Position invariance makes the recomputation bit-identical, so preemption
never changes an output.

A request that still owes prompt logprobs matches with `match_prefix_with_logprobs`: it reuses
the KV of positions 0..M-1 only where the cache also holds the logprobs of positions up to M,
which it takes at admission; it computes from position M, whose logits give the next one.
`cached_tokens` is M, the positions whose KV it reused.

Slot ownership (see `Request`): the radix cache owns `slots[:prefix_len]` (locked through
`prefix_node`), the request owns the rest. `in_use` = sum of requests' own slots, and
`free + cached + in_use == total` is checked by `check_integrity`.

Hybrid models: a running request also owns its linear-attention working state
(`Request.linear_state`, at `num_computed` between steps), made at admission from the
snapshot the prefix match resumed at (the match is cut back to one: RadixCache,
`state_aligned`). For each planned chunk the scheduler reserves snapshot slots for the
boundaries it crosses that the cache keeps (`SnapshotPolicy`, lockstep/cache/linear_snapshots.py),
evicting unlocked radix leaves when the pool is empty; a boundary that finds no slot is not
kept (`snapshots_not_kept`), nothing is allocated. The step fills the reserved snapshots, they
go to the radix cache with the KV (`cache_prefix`), and release gives back whatever the
request still holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lockstep.cache.kv_pool import CacheIntegrityError, KVPool
from lockstep.cache.linear_snapshots import SnapshotPolicy
from lockstep.cache.radix import PrefixMatch, RadixCache
from lockstep.engine.admission import Need, PoolProjection
from lockstep.engine.request import Request, Status
from lockstep.engine.speculative import Speculator
from lockstep.engine.step_budget import MixedStepBudget

# How many of the oldest waiting requests admission looks at when it prefers cache hits;
# bounded so a long queue costs O(window) prefix matches per step and nobody starves.
ADMISSION_WINDOW = 64
# The most output tokens of one request that admission reserves KV for (as SGLang clips its
# estimate): a request that may run to the whole context does not hold a context's worth of
# pool from the start.
OUTPUT_RESERVE_CLIP = 4096


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute positions start..end-1 of `request` this step. A verify chunk
    (lockstep/engine/speculative.py) ends with `draft`: the tokens of positions
    end-len(draft)..end-1, which are guesses, not the request's tokens yet."""

    request: Request
    start: int
    end: int
    draft: tuple[int, ...] = ()

    @property
    def completes_prompt(self) -> bool:
        """This chunk computes the last prompt position (again, after a preemption)."""
        return self.start < len(self.request.prompt_ids) <= self.end


class Scheduler:
    def __init__(
        self,
        pool: KVPool,
        radix: RadixCache,
        *,
        max_batch_tokens: int,
        chunk_size: int,
        max_running: int,
        new_linear_state: Callable[[Any], Any] | None = None,
        snapshot_policy: SnapshotPolicy | None = None,
        output_reserve: float = 0.0,
        prompt_logprob_rows: int | None = None,
        mixed_step: MixedStepBudget | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        """`new_linear_state(snapshot or None)`: a working state resumed from a radix
        snapshot (hybrid models; None for models without linear attention) that captures the
        boundaries reserved in its `keep`; `snapshot_policy`: which boundaries those are, in
        slots of `radix.snapshots`. `output_reserve`: the share of running requests' remaining
        outputs admission keeps room for (0: none); `prompt_logprob_rows`: the most
        prompt-logprob rows a step computes (None: no bound); `mixed_step`: the row budget of
        a step with decodes (None: `max_batch_tokens`); `speculator`: drafts verified beside
        decoding requests' tokens (None: no speculation). See the module docstring."""
        self.speculator = speculator
        self.output_reserve = output_reserve
        self.prompt_logprob_rows = prompt_logprob_rows
        self.mixed_step = mixed_step
        self.new_linear_state = new_linear_state
        self.snapshot_policy = snapshot_policy
        self.snapshots_not_kept = 0  # boundaries the policy asked for that found no free slot
        self.pool = pool
        self.radix = radix
        self.max_batch_tokens = max_batch_tokens
        self.chunk_size = chunk_size
        self.max_running = max_running
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ----------------------------------------------------------------- queue management
    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def in_use(self) -> int:
        return sum(r.num_owned_slots for r in self.running)

    def check_integrity(self) -> None:
        self.radix.check_integrity(in_use=self.in_use)
        if self.new_linear_state is None:
            return
        for r in self.running:
            state = r.linear_state
            if state is None or state.position != r.num_computed:
                where = None if state is None else state.position
                raise CacheIntegrityError(
                    f"{r.request_id}: linear state at {where}, num_computed {r.num_computed}"
                )
        idle = [r.request_id for r in self.waiting if r.linear_state is not None]
        if idle:
            raise CacheIntegrityError(f"waiting requests hold linear states: {idle[:8]}")
        snapshots = self.radix.snapshots
        if snapshots is not None:
            held = self.radix.pooled_snapshots()
            for r in self.running:
                state = r.linear_state
                held += [*(state.keep or {}).values(), *state.captured.values()]
            snapshots.check_integrity(held)

    # ----------------------------------------------------------------- planning
    def schedule(self, admit: bool = True, may_preempt: bool = True) -> list[ScheduledChunk]:
        """Plan the next step and count its positions as computed: each planned request's
        `num_computed` becomes its chunk's end (the caller launches the plan at once). The
        scheduler is the only place `num_computed` moves forward. `admit` False: running
        requests only. `may_preempt` False (a step launched ahead, whose requests may have a
        token pending): a running request whose rows find no slot waits for a later step
        instead of preempting another."""
        plan = self._plan(admit, may_preempt)
        for chunk in plan:
            chunk.request.num_computed = chunk.end
        return plan

    def _plan(self, admit: bool, may_preempt: bool = True) -> list[ScheduledChunk]:
        # Decodes first, so that prompts never take their rows; each group oldest first.
        running = sorted(self.running, key=lambda r: (not _decoding(r), r.arrival))
        budget = self.max_batch_tokens
        decoding = [r for r in running if _decoding(r)]
        if self.mixed_step is not None and any(r.streams for r in decoding):
            keys = sum(r.num_computed + 1 for r in decoding)
            budget = min(budget, len(decoding) + self.mixed_step.rows(keys))
        logprob_rows = self.prompt_logprob_rows
        plan: list[ScheduledChunk] = []
        # The running requests' slots are reserved one by one (evicting or preempting where
        # short) and taken from the pool in one call at the end, without a pool call per
        # decoding request. The plan and the preemptions are those of one allocation per
        # request; the slot ids differ where a reservation freed slots mid-loop (outputs never
        # depend on slot ids: the contract).
        owed = 0
        # Drafts only take slots no running request needs this step, so speculation never
        # evicts or preempts (and a full pool simply decodes one token at a time).
        spare = 0
        if self.speculator is not None:
            need = sum(min(r.num_tokens - r.num_computed, self.chunk_size) for r in running)
            spare = self.pool.num_free - need
        for request in running:
            if budget == 0:
                break
            if request.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = min(request.num_tokens - request.num_computed, self.chunk_size, budget)
            n, rows = _cap_logprob_rows(request, request.num_computed, n, logprob_rows)
            if n == 0:
                continue
            draft: tuple[int, ...] = ()
            if self.speculator is not None and spare > 0 and budget > 1 and _decoding(request):
                # Draft rows need logits beside the sampling row, as prompt-logprob rows do:
                # they share that bound (the step's logits workspace, lockstep/engine/memory.py).
                limit = min(spare, budget - 1, logprob_rows if logprob_rows is not None else spare)
                draft = self.speculator.propose(request, limit) if limit > 0 else ()
                spare -= len(draft)
                n += len(draft)
                if logprob_rows is not None:
                    logprob_rows -= len(draft)
            if not self._reserve(owed + n, keep=request, planned=plan, may_preempt=may_preempt):
                if may_preempt:
                    self._preempt(request)
                continue
            start = request.num_computed
            plan.append(ScheduledChunk(request, start, start + n, draft))
            if draft and request.linear_state is not None:
                request.linear_state.begin_verify()  # rolled back in discard_unverified
            owed += n
            budget -= n
            if logprob_rows is not None:
                logprob_rows -= rows
        if owed:
            ids = self.pool.alloc(owed).tolist()
            at = 0
            for chunk in plan:
                n = chunk.end - chunk.start
                chunk.request.slots.extend(ids[at : at + n])
                at += n
        admit = admit and bool(self.waiting) and len(self.running) < self.max_running
        projection = self._projection() if admit else None
        while admit and budget > 0 and self.waiting and len(self.running) < self.max_running:
            assert projection is not None
            admitted = self._admit_one(budget, plan, projection, logprob_rows)
            if admitted is None:
                break
            chunk, rows = admitted
            plan.append(chunk)
            budget -= chunk.end - chunk.start
            projection.add(self._need(chunk.request))
            if logprob_rows is not None:
                logprob_rows -= rows
        self._reserve_snapshots(plan)
        return plan

    def _need(self, request: Request, held: int | None = None) -> Need:
        """What admission expects `request` to need beyond the `held` slots it has (default:
        its slot table): the prompt it has still to compute, then `output_reserve` of the rest
        of its output budget (at most OUTPUT_RESERVE_CLIP tokens), one slot a step, ending
        after its prefill steps and those (lockstep/engine/admission.py)."""
        # A verify chunk's draft slots are given back when the step completes.
        held = min(len(request.slots), request.num_tokens) if held is None else held
        prompt = len(request.prompt_ids)
        # A request ends with prompt + max_tokens - 1 positions computed, one more when a
        # decode step launched ahead computes past its end.
        end = prompt + request.params.max_tokens
        prompt_left = max(0, prompt - held)
        output_left = min(max(0, end - max(held, prompt)), OUTPUT_RESERVE_CLIP)
        output_left = math.ceil(self.output_reserve * output_left)
        prefill_steps = -(-prompt_left // self.chunk_size)
        return Need(prompt_left, output_left, prefill_steps + output_left, held)

    def _projection(self) -> PoolProjection:
        return PoolProjection([self._need(r) for r in self.running])

    def _room(self) -> int:
        """Slots the pool could give now: free, and held by the radix cache but evictable."""
        return self.pool.num_free + self.radix.num_evictable_tokens

    def would_admit(self) -> bool:
        """Whether the next schedule may admit a waiting request, estimated from the oldest
        one's need without a cache hit (a step launched ahead admits nothing: a request that
        only a cache hit lets in waits until the estimate holds)."""
        if not self.waiting or len(self.running) >= self.max_running:
            return False
        if not self.running or self.output_reserve == 0:
            return True
        need = self._need(self.waiting[0], held=0)
        return self._projection().peak_with(need) <= self._room()

    def _reserve_snapshots(self, plan: list[ScheduledChunk]) -> None:
        """Reserve a snapshot slot for each boundary the plan crosses that the policy keeps,
        evicting unlocked radix leaves for one when the pool is empty; without a slot the
        boundary is not kept (never an allocation). A chunk that keeps a boundary past the
        prompt gives back the end-of-text snapshot (`SnapshotPolicy.latest`) its request
        captured in an earlier step and not yet cached: the new one replaces it."""
        pool, policy = self.radix.snapshots, self.snapshot_policy
        if pool is None or policy is None or not self.radix.enabled:
            return
        for chunk in plan:
            request, state = chunk.request, chunk.request.linear_state
            prompt_len = len(request.prompt_ids)
            wanted = policy.kept(prompt_len, chunk.start, chunk.end)
            latest = policy.latest(prompt_len, chunk.start, chunk.end)
            newest = 0
            for position in wanted if latest is None else [*wanted, latest]:
                if pool.num_free == 0:
                    self.radix.evict_for_snapshots(1)
                snap = pool.acquire(position)
                if snap is None:
                    self.snapshots_not_kept += 1
                else:
                    state.keep[position] = snap
                    newest = position
            if newest > prompt_len:
                for position in [p for p in state.captured if not policy.fixed(prompt_len, p)]:
                    state.captured.pop(position).release()

    def _admit_one(
        self,
        budget: int,
        plan: list[ScheduledChunk],
        projection: PoolProjection,
        logprob_rows: int | None,
    ) -> tuple[ScheduledChunk, int] | None:
        """Admit the best waiting request with its first chunk and the prompt-logprob rows
        that chunk computes, or None when it does not fit (the step budget, the logprob rows,
        the pool, or admission's room beside the running requests' `projection`)."""
        best, match = None, None
        for request in self.waiting[:ADMISSION_WINDOW]:
            candidate = self._match(request)
            if match is None or candidate.length > match.length:
                best, match = request, candidate
        assert best is not None and match is not None
        n = min(best.num_tokens - match.length, self.chunk_size, budget)
        n, rows = _cap_logprob_rows(best, match.length, n, logprob_rows)
        if n == 0:
            return None
        self.radix.lock(match.node)
        if self.running and self.output_reserve > 0:
            need = self._need(best, held=match.length)
            if projection.peak_with(need) > self._room():
                self.radix.unlock(match.node)
                return None
        best.prefix_node = match.node
        best.slots.clear()
        best.slots.extend(match.slots.tolist())
        best.prefix_len = best.num_computed = match.length
        if not self._reserve(n, keep=best, planned=plan, may_preempt=False):
            self.radix.unlock(match.node)
            best.slots.clear()
            best.prefix_node, best.prefix_len, best.num_computed = None, 0, 0
            return None
        if self.new_linear_state is not None:
            best.linear_state = self.new_linear_state(match.state)
        if best.cached_tokens < 0:
            best.cached_tokens = match.length
        if match.logprobs is not None:
            best.take_cached_logprobs(match.logprobs)
        self.waiting.remove(best)
        best.status = Status.RUNNING
        self.running.append(best)
        return self._allocate(best, n), rows

    def _match(self, request: Request) -> PrefixMatch:
        # At least one token must be computed to produce logits. A request still owing prompt
        # logprobs reuses KV only where the cache also holds the logprobs it owes.
        if request.owes_prompt_logprobs:
            return self.radix.match_prefix_with_logprobs(
                request.prompt_ids,
                request.namespace,
                first=request.prompt_logprobs_next,
                num_top=request.params.prompt_logprobs or 0,
            )
        return self.radix.match_prefix(request.all_ids[: request.num_tokens - 1], request.namespace)

    def _reserve(
        self, n: int, keep: Request, planned: list[ScheduledChunk], may_preempt: bool = True
    ) -> bool:
        """Make n slots free: evict cached leaves, then (if allowed) preempt the newest running
        requests other than `keep` that are not part of this step's plan yet."""
        if self.pool.num_free < n:
            self.radix.evict(n - self.pool.num_free)
        if self.pool.num_free >= n or not may_preempt:
            return self.pool.num_free >= n
        # Only when preempting: a set of the plan so far (building it for every request made
        # each step quadratic in the batch).
        planned_ids = {id(c.request) for c in planned}
        while self.pool.num_free < n:
            victims = [r for r in self.running if r is not keep and id(r) not in planned_ids]
            if not victims:
                return False
            self._preempt(max(victims, key=lambda r: r.arrival))
            if self.pool.num_free < n:
                self.radix.evict(n - self.pool.num_free)
        return self.pool.num_free >= n

    def _allocate(self, request: Request, n: int) -> ScheduledChunk:
        start = request.num_computed
        request.slots.extend(self.pool.alloc(n).tolist())
        return ScheduledChunk(request, start, start + n)

    # ----------------------------------------------------------------- releasing KV
    def discard_unverified(self, request: Request) -> None:
        """After a verify chunk: give back the slots of positions past the kept tokens, whose
        KV was computed from rejected drafts (or after the request's last token), and count
        only the kept positions as computed; a hybrid model's linear state becomes the state
        after the kept positions (`LinearState.end_verify`). Runs before anything caches the
        request's prefix, so the radix cache never holds a rejected token."""
        keep = request.num_tokens - 1  # the last token's KV is computed by the next step
        assert request.pending == 0 and keep >= request.prefix_len, request.request_id
        extra = request.slots.ids[keep:]
        if extra:
            self.pool.free(torch.tensor(extra, dtype=torch.int64))
            request.slots.truncate(keep)
        request.num_computed = keep
        if request.linear_state is not None:
            request.linear_state.end_verify(keep)

    def cache_prefix(self, request: Request) -> None:
        """Hand the request's computed KV, and the logprobs it knows for those positions, to
        the radix cache (so others can reuse them) and keep it locked for the request. Where
        the tree already held the same tokens, the request's duplicate slots are freed and it
        adopts the tree's: by the contract their bits agree."""
        upto = request.num_computed
        state = request.linear_state
        states = state.take_captured() if state is not None else None
        if not self.radix.enabled or upto <= request.prefix_len:
            for snap in (states or {}).values():
                snap.release()
            return
        result = self.radix.insert(
            request.all_ids[:upto],
            torch.tensor(request.slots.ids[:upto], dtype=torch.int64),
            request.namespace,
            request.computed_logprobs(request.prefix_len, upto),
            states,
        )
        if result.duplicate_slots.numel():
            self.pool.free(result.duplicate_slots)
        self.radix.lock(result.node)
        self.radix.unlock(request.prefix_node)
        request.slots.replace_prefix(result.cached_slots.tolist())
        request.prefix_node = result.node
        request.prefix_len = upto

    def _release(self, request: Request, keep_in_cache: bool) -> None:
        if keep_in_cache:
            self.cache_prefix(request)
        own = request.slots.ids[request.prefix_len :]
        if own:
            self.pool.free(torch.tensor(own, dtype=torch.int64))
        if request.prefix_node is not None:
            self.radix.unlock(request.prefix_node)
        request.slots.clear()
        request.prefix_len, request.prefix_node = 0, None
        request.num_computed = 0
        if request.linear_state is not None:
            request.linear_state.release()
        request.linear_state = None

    def _preempt(self, request: Request) -> None:
        # Overlapped decode never schedules ahead where preemption could happen: a pending
        # token would be dropped.
        assert request.pending == 0, f"{request.request_id}: preempted with a pending token"
        self._release(request, keep_in_cache=True)
        self.running.remove(request)
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(request)
        self.waiting.sort(key=lambda r: r.arrival)

    def retract_all(self) -> int:
        """Preempt every running request, newest first (a paused server's `retract`): each
        waits again with its KV in the radix cache. Returns how many were running."""
        running = sorted(self.running, key=lambda r: r.arrival, reverse=True)
        for request in running:
            self._preempt(request)
        return len(running)

    def finish(self, request: Request) -> None:
        """A finished request's KV stays in the cache (unlocked, evictable)."""
        self._release(request, keep_in_cache=True)
        self.running.remove(request)
        request.status = Status.FINISHED

    def abort(self, request: Request) -> None:
        """Free the request's own slots at once (its cached prefix stays, unlocked)."""
        if request.status is Status.RUNNING:
            self._release(request, keep_in_cache=False)
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = Status.FINISHED


def _decoding(request: Request) -> bool:
    """One token to compute, past the prompt: a decode row (not a prompt or a recomputation)."""
    return request.num_tokens - request.num_computed == 1 and request.num_computed >= len(
        request.prompt_ids
    )


def _cap_logprob_rows(
    request: Request, start: int, n: int, rows_left: int | None
) -> tuple[int, int]:
    """Shorten a chunk of `n` positions from `start` so that the prompt-logprob rows it
    computes (positions p, prompt_logprobs_next - 1 <= p < prompt length - 1) are at most
    `rows_left` (None: no bound); returns the chunk's length and those rows."""
    if request.prompt_logprobs is None:
        return n, 0
    first = max(start, request.prompt_logprobs_next - 1)
    last = len(request.prompt_ids) - 1
    rows = max(0, min(start + n, last) - first)
    if rows_left is not None and rows > rows_left:
        n, rows = first + rows_left - start, rows_left
    return n, rows
