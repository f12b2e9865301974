"""A hybrid model under overload on the CPU: 300 requests at once against small budgets.

random:tiny-qwen3.5 with a KV pool of 512 tokens, 8 running requests at most and a snapshot
pool of 8 (a boundary kept every 64 tokens and at prompt ends): admission must make requests
wait, the KV pool must evict and preempt, and the snapshot pool must fill, evict with the tree
and refuse to keep boundaries when every slot is held. Prompts branch from six shared stems at
every length, so hits resume from kept snapshots at many points. Nothing may fail or allocate
past a budget, every request must equal the same request alone on a cold cache bit for bit,
and every pool must be free at the end. Negative controls: a snapshot pool that lends a slot
the tree still holds (instead of refusing) makes requests differ; with no snapshots the hits
are gone.
"""

from __future__ import annotations

import random

import pytest

from lockstep.cache.linear_snapshots import LinearSnapshotPool
from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.engine.sampling_params import SamplingParams
from lockstep.models.linear_attention import LinearSnapshot
from tests.support.invariance_harness import Requests, generate

VOCAB = 512  # random:tiny-qwen3.5
MAX_RUNNING = 8
SNAPSHOTS = 8


# One torch thread for tiny shapes (tests/conftest.py): bits do not depend on the count.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


CPU = {"model": "random:tiny-qwen3.5", "device": "cpu", "dtype": "float32"}


def _engine(snapshots: int = SNAPSHOTS, debug_checks: bool = True, model: dict = CPU) -> Engine:
    return Engine(EngineConfig(
        **model, kv_tokens=512, output_reserve=0.0,
        max_running=MAX_RUNNING, max_batch_tokens=96, chunk_size=48,
        linear_snapshots=snapshots, linear_snapshot_interval=64, debug_checks=debug_checks,
    ))  # fmt: skip


def _requests(n: int) -> Requests:
    rng = random.Random(41)
    stems = [[rng.randrange(VOCAB) for _ in range(160)] for _ in range(6)]
    requests = {}
    for i in range(n):
        prompt = stems[i % 6][: rng.randint(1, 160)]
        prompt += [rng.randrange(VOCAB) for _ in range(rng.randint(0, 24))]
        params = SamplingParams(max_tokens=rng.randint(1, 6), temperature=rng.choice([0.0, 1.0]),
                                seed=i, ignore_eos=True)  # fmt: skip
        requests[f"r{i}"] = (prompt, params)
    return requests


def _run_together(engine: Engine, requests: Requests) -> tuple[dict, dict[str, int], dict]:
    """Every request queued at once, stepped to the end: outputs, each one's cached tokens,
    and what the budgets went through (most waiting, fewest free snapshot slots)."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    got = {rid: ([], []) for rid in requests}
    cached: dict[str, int] = {}
    seen = {"most_waiting": 0, "most_running": 0, "fewest_free_snapshots": SNAPSHOTS}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(out.new_token_logprobs)
            cached[out.request_id] = out.cached_tokens
        stats = engine.stats()
        seen["most_waiting"] = max(seen["most_waiting"], stats["num_waiting"])
        seen["most_running"] = max(seen["most_running"], stats["num_running"])
        seen["fewest_free_snapshots"] = min(
            seen["fewest_free_snapshots"], stats["state_snapshots_free"]
        )
    return got, cached, seen


def _differ_alone(engine: Engine, requests: Requests, together: dict) -> list[str]:
    differing = []
    for rid, request in requests.items():
        engine.flush_cache()
        if generate(engine, {rid: request})[rid] != together[rid]:
            differing.append(rid)
    return differing


def test_300_requests_under_small_budgets_equal_each_alone_and_free_every_pool() -> None:
    check_300_requests_under_small_budgets(CPU)


def check_300_requests_under_small_budgets(model: dict) -> None:
    """The overload run on `model` (EngineConfig's model, device and dtype): every request
    completes, equals itself alone, and every pool is free at the end (tests/gpu runs it on
    the GPU)."""
    engine = _engine(model=model)
    requests = _requests(300)
    together, cached, seen = _run_together(engine, requests)
    stats = engine.stats()
    # Overload: requests waited, the running cap held, KV was evicted and requests preempted,
    # the snapshot pool filled and some boundaries found no slot.
    assert seen["most_waiting"] > 100 and seen["most_running"] == MAX_RUNNING
    assert stats["num_preemptions"] > 0
    assert seen["fewest_free_snapshots"] == 0 and stats["state_snapshots_not_kept"] > 0
    assert stats["state_snapshots_evicted"] > SNAPSHOTS  # the pool turned over, with the tree
    assert stats["state_snapshot_slots"] == SNAPSHOTS
    # Every request completed, hits resumed from kept snapshots (multiples of the chunk).
    for rid, (_, params) in requests.items():
        assert len(together[rid][0]) == params.max_tokens, rid
    hits = [c for c in cached.values() if c > 0]
    assert len(hits) > 100 and all(c % 32 == 0 for c in hits)
    engine.check_integrity()
    assert stats["kv_in_use"] == 0 and engine.state_pool.num_free == MAX_RUNNING
    assert stats["kv_free"] + stats["kv_cached"] == stats["kv_total"]
    assert stats["state_snapshots_free"] + stats["state_snapshots"] == SNAPSHOTS

    differing = _differ_alone(engine, requests, together)
    assert not differing, f"{differing[:8]} differ from the same request alone"
    engine.flush_cache()
    engine.check_integrity()
    stats = engine.stats()
    assert stats["kv_free"] == stats["kv_total"] and stats["state_snapshots"] == 0
    assert stats["state_snapshots_free"] == SNAPSHOTS and engine.state_pool.num_free == MAX_RUNNING


class _OvercommittingPool(LinearSnapshotPool):
    """The bug the budget rules out: when every slot is lent, lend the oldest one again (the
    tree may still hold it) instead of refusing."""

    def acquire(self, position: int) -> LinearSnapshot | None:
        snap = super().acquire(position)
        if snap is None:
            self._next = (getattr(self, "_next", -1) + 1) % self.num_slots
            slot = self._next
            snap = LinearSnapshot(position, self.conv[slot], self.recurrent[slot], None, -1)
        return snap


def test_negative_control_a_pool_that_lends_held_slots_changes_outputs(monkeypatch) -> None:
    monkeypatch.setattr("lockstep.engine.engine.LinearSnapshotPool", _OvercommittingPool)
    engine = _engine(debug_checks=False)
    requests = _requests(120)
    together, _, _ = _run_together(engine, requests)
    assert _differ_alone(engine, requests, together), "an overwritten snapshot went unseen"


def test_negative_control_without_snapshots_no_hit_resumes() -> None:
    """With no snapshot slots every hit resumes at 0: the hit-rate assertion above fails."""
    engine = _engine(snapshots=0)
    _, cached, seen = _run_together(engine, _requests(60))
    assert all(c == 0 for c in cached.values()) and seen["most_waiting"] > 0
    engine.check_integrity()
