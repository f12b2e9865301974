"""The memory reservation against what the engine really allocates, on the GPU.

`random:qwen3-8b` at the CUDA defaults (CUDA graphs on, the pool sized from memory): the
startup reservation stays under 4 GiB, the pool takes at least 85% of the memory free after
the weights, and torch's peak allocation over two whole workloads stays inside what was
allocated before the pool + the pool + the reservation (`Engine.memory_bound`,
lockstep/engine/memory.py): 256 x 1k in / 1k out (greedy, `ignore_eos`) and 64 x 8k prompts
scored at every position (prompt logprobs) with one token generated. The first must finish
without a preemption (admission, lockstep/engine/scheduler.py).

Runs only where CUDA is present. So that "inside the bound" cannot pass on a loose bound,
each run's peak must also reach past what was allocated before the pool plus the pool: the
bound is then at most the reservation (under 4 GiB) above the peak.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GIB = 1 << 30


@pytest.fixture(scope="module")
def engine():
    from lockstep.config import EngineConfig
    from lockstep.engine.engine import Engine

    engine = Engine(EngineConfig(model="random:qwen3-8b", device="cuda", dtype="bfloat16"))
    yield engine
    del engine
    torch.cuda.empty_cache()


def _run(engine, prompts, params) -> int:
    """Run the requests to their ends; returns torch's peak allocation over the run."""
    from lockstep.bench.throughput import run_requests

    result = run_requests(engine, prompts, params, progress=False, tag="mem")
    assert result.peak_allocated_bytes is not None
    return result.peak_allocated_bytes


def test_the_reservation_is_small_and_the_pool_takes_the_rest(engine) -> None:
    budget = engine.kv_budget
    assert budget is not None and budget.reserved is not None
    assert budget.reserved.total <= 4 * GIB, budget.describe()
    pool_bytes = engine.pool.num_slots * budget.bytes_per_token
    assert pool_bytes >= 0.85 * budget.available_bytes, budget.describe()


def test_peak_memory_of_the_rl_workload_stays_inside_the_bound(engine) -> None:
    from lockstep.engine.sampling_params import SamplingParams

    rng = random.Random(0)
    vocab = engine.decoder.spec.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(1024)] for _ in range(256)]
    params = [SamplingParams(max_tokens=1024, temperature=0.0, ignore_eos=True)] * 256
    before = engine.scheduler.num_preemptions
    peak = _run(engine, prompts, params)
    bound = engine.memory_bound()
    assert bound["before_pool"] + bound["kv_pool"] < peak <= bound["bound"], (peak, bound)
    assert engine.scheduler.num_preemptions == before
    engine.flush_cache()


def test_peak_memory_of_scoring_long_prompts_stays_inside_the_bound(engine) -> None:
    from lockstep.engine.sampling_params import SamplingParams

    rng = random.Random(1)
    vocab = engine.decoder.spec.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(8192)] for _ in range(64)]
    params = [SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)] * 64
    peak = _run(engine, prompts, params)
    bound = engine.memory_bound()
    assert bound["before_pool"] + bound["kv_pool"] < peak <= bound["bound"], (peak, bound)
    engine.flush_cache()
