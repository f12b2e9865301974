"""The Scheduler on its own (lockstep/engine/scheduler.py), driven by a fake runner on the CPU:
admission order, chunking under the token budget, preemption and recomputation, what goes into
the radix cache, and `check_integrity` (free + cached + in use == total) after every step.

The fake runner stands in for `ModelRunner` + `Engine._complete`: a step "computes" each
planned chunk, and a chunk that reaches a request's last token appends the next one, a pure
function of the tokens so far (what position invariance promises of the real model), so a
preempted request that recomputes must end with the tokens it would have had alone.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from lockstep.cache.kv_pool import KVPool
from lockstep.cache.radix import RadixCache
from lockstep.engine.outputs import TokenLogprob
from lockstep.engine.request import Request, Status
from lockstep.engine.sampling_params import SamplingParams
from lockstep.engine.scheduler import ScheduledChunk, Scheduler


def next_token(ids: list[int]) -> int:
    """The fake model: the next token depends on the tokens before it only."""
    return (sum(i * (p + 1) for p, i in enumerate(ids)) * 7919 + len(ids)) % 1000


def make_scheduler(
    slots: int, max_batch_tokens: int = 64, chunk_size: int = 16, max_running: int = 8
) -> Scheduler:
    pool = KVPool(slots, 1, 1, 2, torch.float32, "cpu")
    return Scheduler(
        pool, RadixCache(pool), max_batch_tokens=max_batch_tokens, chunk_size=chunk_size,
        max_running=max_running,
    )  # fmt: skip


_arrivals = itertools.count()


def make_request(prompt: list[int], max_tokens: int = 4, name: str = "") -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    arrival = next(_arrivals)
    return Request(name or f"r{arrival}", list(prompt), params, seed=0, arrival=arrival)


def step(scheduler: Scheduler) -> list[ScheduledChunk]:
    """One engine step with the fake runner; the scheduler's accounting is checked after it."""
    plan = scheduler.schedule()
    for chunk in plan:
        request = chunk.request
        assert len(request.slots) == chunk.end, (request.request_id, chunk)
        if chunk.end != request.num_tokens:
            continue  # a prompt chunk that does not reach the last token: no logits used
        token = next_token(request.all_ids)
        request.output_ids.append(token)
        request.output_logprobs.append(TokenLogprob(token, -1.0))
        if chunk.completes_prompt:
            scheduler.cache_prefix(request)  # as Engine._on_prefill_done
        if len(request.output_ids) >= request.params.max_tokens:
            scheduler.finish(request)
    scheduler.check_integrity()
    return plan


def run(scheduler: Scheduler, limit: int = 500) -> list[list[ScheduledChunk]]:
    plans = []
    while scheduler.has_work():
        plans.append(step(scheduler))
        assert len(plans) < limit, "the scheduler stopped making progress"
    return plans


def alone(prompt: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(next_token(ids))
    return ids[len(prompt) :]


def test_chunks_fill_the_token_budget_decode_first_then_prefill() -> None:
    """A 40-token prompt beside a decoding request, budget 10, chunks of 8: each step the
    decode takes its one token, then the prefill takes min(chunk, what is left of the budget);
    no step plans more than the budget; the prompt's chunks are contiguous."""
    scheduler = make_scheduler(slots=256, max_batch_tokens=10, chunk_size=8)
    short = make_request([1, 2, 3], max_tokens=30)
    scheduler.add(short)
    step(scheduler)  # the short prompt, whole
    long = make_request(list(range(10, 50)), max_tokens=2)
    scheduler.add(long)
    starts = []
    while long.status is not Status.FINISHED:
        plan = step(scheduler)
        assert sum(c.end - c.start for c in plan) <= 10
        by_request = {c.request.request_id: c for c in plan}
        if short.status is Status.RUNNING or short.request_id in by_request:
            assert by_request[short.request_id].end - by_request[short.request_id].start == 1
        if long.request_id in by_request:
            c = by_request[long.request_id]
            starts.append((c.start, c.end))
            assert c.end - c.start <= 8
    assert starts[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(starts))
    assert starts[:5] == [(0, 8), (8, 16), (16, 24), (24, 32), (32, 40)]
    run(scheduler)
    assert long.output_ids == alone(long.prompt_ids, 2)


def test_admission_prefers_the_longest_cached_prefix_then_the_oldest() -> None:
    """Waiting requests are admitted longest cached prefix first (ties: the oldest), one per
    step here (max_running 1)."""
    scheduler = make_scheduler(slots=256, max_running=1)
    shared = list(range(100, 130))
    warm = make_request(shared, max_tokens=1)
    scheduler.add(warm)
    run(scheduler)
    cold_old = make_request(list(range(500, 520)), max_tokens=1, name="cold_old")
    cold_new = make_request(list(range(600, 620)), max_tokens=1, name="cold_new")
    hit = make_request([*shared, 7, 8, 9], max_tokens=1, name="hit")
    for r in (cold_old, cold_new, hit):
        scheduler.add(r)
    order = []
    while scheduler.has_work():
        waiting = {r.request_id for r in scheduler.waiting}
        order += [c.request.request_id for c in step(scheduler) if c.request.request_id in waiting]
    assert order == ["hit", "cold_old", "cold_new"]
    assert hit.cached_tokens == len(shared) and cold_old.cached_tokens == 0


def test_a_cache_hit_computes_only_the_uncached_tail() -> None:
    """A second request with the first one's prompt as its prefix starts at the cached length;
    a request with the same prompt keeps one token to compute (logits need a row)."""
    scheduler = make_scheduler(slots=256)
    prompt = list(range(1, 25))
    first = make_request(prompt, max_tokens=3)
    scheduler.add(first)
    run(scheduler)
    assert scheduler.radix.num_cached_tokens >= len(prompt)
    again = make_request(prompt, max_tokens=3)
    longer = make_request([*prompt, 99, 98], max_tokens=3)
    scheduler.add(again)
    scheduler.add(longer)
    plan = step(scheduler)
    starts = {c.request.request_id: c.start for c in plan}
    assert starts[again.request_id] == len(prompt) - 1
    assert starts[longer.request_id] == len(prompt)
    run(scheduler)
    for r in (first, again, longer):
        assert r.output_ids == alone(r.prompt_ids, 3), r.request_id


def test_finished_requests_leave_their_kv_in_the_cache_unlocked() -> None:
    """After every request finished: nothing in use, the prompts and outputs cached and
    evictable (unlocked), and an eviction frees them all."""
    scheduler = make_scheduler(slots=256)
    requests = [make_request(list(range(s, s + 20)), max_tokens=5) for s in (0, 300, 600)]
    for r in requests:
        scheduler.add(r)
    run(scheduler)
    assert scheduler.in_use == 0 and scheduler.radix.num_locked_tokens == 0
    cached = scheduler.radix.num_cached_tokens
    # Each request's prompt and all but its last output token were computed and cached.
    assert cached == sum(len(r.prompt_ids) + len(r.output_ids) - 1 for r in requests)
    assert scheduler.radix.evict(cached) == cached
    assert scheduler.pool.num_free == 256
    scheduler.check_integrity()


@pytest.mark.parametrize("slots", [48, 64, 96])
def test_preemption_recomputes_and_gives_the_tokens_of_a_run_alone(slots: int) -> None:
    """Eight requests whose KV does not fit the pool at once: the newest running ones are
    preempted (their KV goes to the cache, they wait again) and recompute; every request ends
    with the tokens it gets alone, the pool is whole after each step, and nothing leaks."""
    scheduler = make_scheduler(slots=slots, max_batch_tokens=32, chunk_size=8)
    requests = [
        make_request([i * 50 + j for j in range(10 + 2 * i)], max_tokens=12) for i in range(8)
    ]
    for r in requests:
        scheduler.add(r)
    run(scheduler)
    assert scheduler.num_preemptions > 0
    assert sum(r.num_preemptions for r in requests) == scheduler.num_preemptions
    preempted = [r for r in requests if r.num_preemptions]
    # The newest are the victims: the oldest request is never preempted.
    assert requests[0].num_preemptions == 0 and preempted
    for r in requests:
        assert r.status is Status.FINISHED
        assert r.output_ids == alone(r.prompt_ids, 12), r.request_id
    assert scheduler.in_use == 0 and scheduler.radix.num_locked_tokens == 0


def test_the_newest_running_request_is_preempted_first() -> None:
    """Three prompts fill the pool exactly and the cache holds nothing evictable: the oldest
    request's next token preempts the newest one (not the middle one), which waits again."""
    scheduler = make_scheduler(slots=30, max_batch_tokens=64, chunk_size=64, max_running=3)
    a, b, c = (make_request(list(range(s, s + 10)), max_tokens=5) for s in (0, 100, 200))
    for r in (a, b, c):
        scheduler.add(r)
    step(scheduler)
    assert scheduler.pool.num_free == 0 and scheduler.radix.num_evictable_tokens == 0
    plan = step(scheduler)
    assert [ch.request for ch in plan] == [a, b]
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (0, 0, 1)
    assert c.status is Status.WAITING and scheduler.waiting == [c]
    run(scheduler)
    for r in (a, b, c):
        assert r.output_ids == alone(r.prompt_ids, 5)


def test_a_preempted_request_resumes_from_its_cached_kv() -> None:
    """Preemption hands the victim's computed KV to the radix cache (unlocked, so the pool can
    evict what it must); admitted again, the victim matches what is left of it, its prompt
    here, and computes only the rest, with the tokens it gets alone."""
    scheduler = make_scheduler(slots=50, max_batch_tokens=64, chunk_size=64, max_running=2)
    old = make_request(list(range(0, 20)), max_tokens=7, name="old")
    new = make_request(list(range(100, 120)), max_tokens=10, name="new")
    scheduler.add(old)
    scheduler.add(new)
    step(scheduler)  # both prompts: 40 of 50 slots
    while new.num_preemptions == 0:
        assert old.status is Status.RUNNING
        step(scheduler)
    assert new.status is Status.WAITING and new.num_computed == 0 and not new.slots
    assert scheduler.radix.match_prefix(new.all_ids).length >= len(new.prompt_ids)
    readmitted = None
    while scheduler.has_work():
        waiting = new.status is Status.WAITING
        for chunk in step(scheduler):
            if chunk.request is new and waiting:
                readmitted = chunk
    assert readmitted is not None and readmitted.start >= len(new.prompt_ids)
    assert new.cached_tokens == 0  # the first admission's hit, not the readmission's
    assert new.output_ids == alone(new.prompt_ids, 10)
    assert old.output_ids == alone(old.prompt_ids, 7)


def test_abort_frees_a_running_requests_own_slots() -> None:
    scheduler = make_scheduler(slots=128)
    r = make_request(list(range(40)), max_tokens=50)
    scheduler.add(r)
    step(scheduler)
    step(scheduler)
    assert scheduler.in_use > 0
    scheduler.abort(r)
    assert r.status is Status.FINISHED and not scheduler.has_work()
    assert scheduler.in_use == 0 and scheduler.radix.num_locked_tokens == 0
    scheduler.check_integrity()


def recomputed_rows(plans: list[list[ScheduledChunk]], requests: list[Request]) -> int:
    """Positions computed beyond each request's own (prompt + all but its last output token):
    what preemption made the run compute twice."""
    computed = sum(c.end - c.start for plan in plans for c in plan)
    return computed - sum(len(r.prompt_ids) + len(r.output_ids) - 1 for r in requests)


@pytest.mark.parametrize("reserve", [1.0, 0.0])
def test_admission_finishes_what_it_starts(reserve: float) -> None:
    """Twelve requests of 20 prompt + 30 output tokens, at most 4 of whose 50 slots fit the
    pool at once. Reserving their whole outputs (1.0), admission holds the rest back: no
    preemption, nothing computed twice, every request's tokens those of a run alone. The
    control (0: admitted on the first chunk's slots alone) preempts and recomputes."""
    scheduler = make_scheduler(slots=210, max_batch_tokens=64, chunk_size=16, max_running=12)
    scheduler.output_reserve = reserve
    requests = [make_request([i * 40 + j for j in range(20)], max_tokens=30) for i in range(12)]
    for r in requests:
        scheduler.add(r)
    plans = run(scheduler)
    for r in requests:
        assert r.output_ids == alone(r.prompt_ids, 30), r.request_id
    assert scheduler.in_use == 0 and scheduler.radix.num_locked_tokens == 0
    if reserve == 1.0:
        assert scheduler.num_preemptions == 0 and recomputed_rows(plans, requests) == 0
        assert max(len({c.request.request_id for c in p}) for p in plans) == 4
    else:
        assert scheduler.num_preemptions > 0 and recomputed_rows(plans, requests) > 0


def test_a_request_alone_is_admitted_whatever_it_reserves() -> None:
    """A request that needs the whole pool runs when nothing else does (no deadlock), and one
    that arrives beside it waits until it finishes."""
    scheduler = make_scheduler(slots=60, max_batch_tokens=64, chunk_size=64, max_running=4)
    scheduler.output_reserve = 1.0
    big = make_request(list(range(30)), max_tokens=30, name="big")
    # Beside it to the end, the small one would need 40 of the 30 slots left: it waits.
    small = make_request(list(range(100, 110)), max_tokens=30, name="small")
    scheduler.add(big)
    scheduler.add(small)
    plan = step(scheduler)
    assert [c.request for c in plan] == [big] and small.status is Status.WAITING
    assert not scheduler.would_admit()
    run(scheduler)
    assert scheduler.num_preemptions == 0
    assert small.output_ids == alone(small.prompt_ids, 30)


def test_prompt_logprob_rows_per_step_are_bounded() -> None:
    """Scoring requests (prompt logprobs owed for every position) beside a decoding one: no
    step computes more than `prompt_logprob_rows` prompt-logprob rows, the decode is never
    held back, and every prompt position is scored once."""
    scheduler = make_scheduler(slots=512, max_batch_tokens=64, chunk_size=64, max_running=8)
    scheduler.prompt_logprob_rows = 10
    decoding = make_request([1, 2, 3], max_tokens=40, name="decoding")
    scheduler.add(decoding)
    step(scheduler)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    scored = [
        Request(f"scored{s}", [s + j for j in range(45)], params, seed=0, arrival=next(_arrivals))
        for s in (200, 300)
    ]
    for r in scored:
        r.prompt_logprobs = [None]
        scheduler.add(r)
    while any(r.status is not Status.FINISHED for r in scored):
        plan = scheduler.schedule()
        rows = 0
        for chunk in plan:
            r = chunk.request
            if r.prompt_logprobs is None:
                continue
            first = max(chunk.start, r.prompt_logprobs_next - 1)
            positions = range(first, min(chunk.end, len(r.prompt_ids) - 1))
            rows += len(positions)
            for p in positions:
                r.prompt_logprobs.append(TokenLogprob(r.prompt_ids[p + 1], -1.0))
            if positions:
                r.prompt_logprobs_next = positions[-1] + 2
        assert rows <= 10
        if decoding.status is Status.RUNNING:
            assert decoding in [c.request for c in plan]
        _complete(scheduler, plan)
    for r in scored:
        assert len(r.prompt_logprobs) == len(r.prompt_ids)
        assert [t.token_id for t in r.prompt_logprobs[1:]] == r.prompt_ids[1:]


def _complete(scheduler: Scheduler, plan: list[ScheduledChunk]) -> None:
    """`step`'s token handling for a plan made outside it."""
    for chunk in plan:
        request = chunk.request
        if chunk.end != request.num_tokens:
            continue
        token = next_token(request.all_ids)
        request.output_ids.append(token)
        request.output_logprobs.append(TokenLogprob(token, -1.0))
        if chunk.completes_prompt:
            scheduler.cache_prefix(request)
        if len(request.output_ids) >= request.params.max_tokens:
            scheduler.finish(request)
    scheduler.check_integrity()


@pytest.mark.parametrize("streams", [True, False])
def test_a_step_with_streamed_decodes_carries_at_most_the_mixed_budget(streams: bool) -> None:
    """With a mixed-step budget of 8 prompt rows (lockstep/engine/step_budget.py), a long
    prompt arriving beside four streamed decoding requests is cut into chunks that keep every
    such step within 4 + 8 rows, decodes first. Beside requests answered whole (not
    streamed), or alone, it takes whole chunks."""
    from lockstep.engine.step_budget import RIDGE_FLOP_PER_BYTE, MixedStepBudget

    # Prompt rows = RIDGE x (factor - 1) x (W + KV) / F: W = 8 F / RIDGE, KV 0 bytes a key: 8
    # prompt rows beside the 4 decodes.
    flops = RIDGE_FLOP_PER_BYTE * 100
    budget = MixedStepBudget(weight_bytes=800, flops_per_row=flops, kv_bytes_per_key=0, factor=2)
    assert budget.rows(10_000) == 8
    scheduler = make_scheduler(slots=512, max_batch_tokens=64, chunk_size=64, max_running=8)
    scheduler.mixed_step = budget
    decoders = [make_request([s, s + 1], max_tokens=30) for s in (1, 5, 9, 13)]
    for r in decoders:
        r.streams = streams
        scheduler.add(r)
    step(scheduler)
    long = make_request(list(range(100, 160)), max_tokens=2, name="long")
    scheduler.add(long)
    sizes = []
    while long.status is not Status.FINISHED:
        plan = step(scheduler)
        decodes = [c for c in plan if c.request is not long]
        assert len(decodes) == sum(r.status is Status.RUNNING or r in [c.request for c in plan]
                                   for r in decoders)  # fmt: skip
        sizes.append(sum(c.end - c.start for c in plan))
    assert max(sizes) <= 12 if streams else max(sizes) == 4 + 60
    run(scheduler)
    alone_scheduler = make_scheduler(slots=512, max_batch_tokens=64, chunk_size=64)
    alone_scheduler.mixed_step = budget
    again = make_request(list(range(100, 160)), max_tokens=2)
    alone_scheduler.add(again)
    assert step(alone_scheduler)[0].end == 60  # no decodes: the whole budget
    assert long.output_ids == alone(long.prompt_ids, 2)


@pytest.mark.parametrize("short_output", [4, 30])
def test_admission_counts_that_running_requests_release_their_slots_when_they_end(
    short_output: int,
) -> None:
    """Pool of 100 slots. A long request (10 prompt + 60 output) and a short one (10 + 4)
    run; a third (10 + 30) arrives. By the sum of final sizes it never fits beside both (70 +
    14 + 40 = 124 > 100); by the pool's future it fits at once: the short one ends after 4
    steps, and at the newcomer's end it and the long one hold about 40 + 43. No preemption,
    every request the tokens of a run alone. The control: a short request as long as the
    newcomer (10 + 30) still holds its 40 then, and the newcomer waits."""
    scheduler = make_scheduler(slots=100, max_batch_tokens=64, chunk_size=16, max_running=8)
    scheduler.output_reserve = 1.0
    long = make_request([1] * 10, max_tokens=60, name="long")
    short = make_request([2] * 10, max_tokens=short_output, name="short")
    for r in (long, short):
        scheduler.add(r)
    step(scheduler)
    newcomer = make_request([3] * 10, max_tokens=30, name="newcomer")
    scheduler.add(newcomer)
    plan = step(scheduler)
    admitted = newcomer in [c.request for c in plan]
    assert admitted == (short_output == 4)
    run(scheduler)
    assert scheduler.num_preemptions == 0
    for r in (long, short, newcomer):
        assert r.output_ids == alone(r.prompt_ids, r.params.max_tokens), r.request_id


def test_the_ridge_is_the_cards() -> None:
    """The H100 reads at 3.03 TB/s where the H200 reads at 4.27 with the same matrix rate, so
    its mixed steps carry more prompt rows per byte read; an unmeasured card takes the H200's."""
    from lockstep.engine.step_budget import (
        RIDGE_FLOP_PER_BYTE,
        MixedStepBudget,
        ridge_flop_per_byte,
    )

    assert ridge_flop_per_byte("NVIDIA H100 80GB HBM3") == 128
    assert ridge_flop_per_byte("NVIDIA H200") == 80 == RIDGE_FLOP_PER_BYTE
    assert ridge_flop_per_byte("NVIDIA L40S") == RIDGE_FLOP_PER_BYTE
    h100 = MixedStepBudget(1000, 100, 0, factor=2, ridge=128)
    h200 = MixedStepBudget(1000, 100, 0, factor=2, ridge=80)
    assert (h100.rows(0), h200.rows(0)) == (1280, 800)
