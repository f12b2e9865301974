"""The property suite on the GPU for Gemma 3 (random:gemma3-4b: bfloat16, Triton kernels, CUDA
graphs on): sliding-window layers of 1,024 keys, five to each global layer, head_dim 256.

Runs only where CUDA is present; CI runs the same properties on a tiny Gemma 3 folder on the
CPU (test_gemma3.py) and the sliding-window attention kernels under the interpreter
(test_ops_triton.py). Prompts cross the window (1,024), the key block (64) and the split (512),
so tails of radix hits and decode steps straddle the window's edge on every path. The
negative control requires reference mode (cuBLAS, SDPA) to break the same harness.
`LOCKSTEP_GPU_CASES` sets the number of random schedules (default 40).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from tests.support.invariance_harness import (
    Plan,
    compute,
    generate,
    mismatches,
    random_plan,
    reference,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MODEL = "random:gemma3-4b"
WINDOW = 1024
CASES = int(os.environ.get("LOCKSTEP_GPU_CASES", "40"))


def _engine(mode: str = "deterministic", **options):
    from lockstep.config import EngineConfig
    from lockstep.engine.engine import Engine

    settings = {"kv_tokens": 65536, "max_model_len": 4096, "max_running": 64} | options
    return Engine(EngineConfig(model=MODEL, mode=mode, device="cuda", dtype="bfloat16",
                               **settings))  # fmt: skip


@pytest.fixture(scope="module")
def engine():
    e = _engine()
    assert e.runner.graphs is not None
    yield e
    del e
    torch.cuda.empty_cache()


def _tokens(engine, n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(engine.decoder.spec.vocab_size) for _ in range(n)]


def test_random_schedules_match_cold_prefill(engine) -> None:
    for seed in range(CASES):
        rng = random.Random(seed)
        n = rng.randint(1, 2 * WINDOW + 300)
        tokens = _tokens(engine, n, rng)
        plan = random_plan(rng, n, max_mates=4)
        problems = mismatches(reference(engine, tokens), compute(engine, tokens, plan, rng))
        assert not problems, f"seed={seed} n={n} {plan.describe()}: " + "; ".join(problems)
    engine.check_integrity()


def test_radix_hits_whose_tail_straddles_the_window_edge(engine) -> None:
    """Hits ending around the window (1,024), the key block and the split, each followed by
    a tail that reaches back across the window's lower edge into the cached keys."""
    rng = random.Random(3)
    n = 2 * WINDOW + 200
    tokens = _tokens(engine, n, rng)
    ref = reference(engine, tokens)
    offsets = sorted({o + d for o in (64, 512, WINDOW, WINDOW + 512, 2 * WINDOW)
                      for d in (-1, 0, 1)} | {1, 700})  # fmt: skip
    for prefix in offsets:
        tail = min(n - prefix, rng.choice([1, 7, 100, WINDOW - 1, WINDOW + 1]))
        chunks = [tail] + ([n - prefix - tail] if n - prefix - tail else [])
        plan = Plan(prefix, chunks, [[rng.randint(1, 40)] for _ in chunks])
        problems = mismatches(ref, compute(engine, tokens, plan, rng))
        assert not problems, f"prefix={prefix} tail={tail}: " + "; ".join(problems)
        engine.flush_cache()
    engine.check_integrity()


def test_decoded_among_batch_mates_with_graphs_equals_alone(engine) -> None:
    """Requests decoded together (graph replays of padded decode batches, mixed prefill and
    decode steps) give the bits each gives alone; prompts shorter and longer than the window."""
    from lockstep.engine.sampling_params import SamplingParams

    rng = random.Random(5)
    requests = {
        f"r{i}": (
            _tokens(engine, rng.randint(20, 2 * WINDOW), rng),
            SamplingParams(
                max_tokens=48, temperature=0.0 if i % 2 else 1.0, seed=i, ignore_eos=True
            ),
        )
        for i in range(24)
    }
    together = generate(engine, requests)
    assert engine.runner.graphs.num_graphs > 0
    for rid in ("r0", "r1", "r2", "r23"):
        engine.flush_cache()
        assert generate(engine, {rid: requests[rid]})[rid] == together[rid], rid
    engine.check_integrity()


def test_generation_logprobs_equal_scoring_across_the_window(engine) -> None:
    """Decode tiles (graph replays) against prefill tiles: generation from prompts around the
    window scores to the same logprob bits."""
    from lockstep.engine.llm import LLM
    from lockstep.engine.sampling_params import SamplingParams

    llm = LLM.__new__(LLM)
    llm.engine, llm.tokenizer, llm._counter = engine, engine.tokenizer, 0
    rng = random.Random(7)
    prompts = [_tokens(engine, n, rng) for n in (5, WINDOW - 10, WINDOW + 600)]
    params = SamplingParams(max_tokens=64, temperature=1.0, seed=5, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    scores = llm.score([o.prompt_token_ids + o.token_ids for o in outs], use_tqdm=False)
    for out, score in zip(outs, scores, strict=True):
        assert score.logprobs[len(out.prompt_token_ids) :] == out.logprobs


def test_cuda_graph_decode_equals_eager(engine) -> None:
    from lockstep.engine.sampling_params import SamplingParams

    rng = random.Random(9)
    requests = {
        f"r{i}": (_tokens(engine, rng.randint(1, WINDOW + 300), rng),
                  SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True))
        for i in range(11)  # padded to the 16-row graph bucket
    }  # fmt: skip
    engine.flush_cache()
    with_graphs = generate(engine, requests)
    eager = _engine(cuda_graphs=False)
    assert generate(eager, requests) == with_graphs
    del eager
    torch.cuda.empty_cache()


def test_negative_control_reference_mode_breaks_batch_invariance() -> None:
    engine = _engine(mode="reference", cuda_graphs=False)
    failures = 0
    for seed in range(8):
        rng = random.Random(seed)
        n = rng.randint(WINDOW, WINDOW + 300)
        tokens = _tokens(engine, n, rng)
        # Eight chunks at random cuts, each step with mates: a random plan may go token by
        # token (over a thousand steps of a 4B model), which the control does not need.
        cuts = sorted(rng.sample(range(1, n), 7))
        chunks = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
        plan = Plan(0, chunks, [[rng.randint(8, 64) for _ in range(4)] for _ in chunks])
        failures += bool(mismatches(reference(engine, tokens), compute(engine, tokens, plan, rng)))
    assert failures > 0
    del engine
    torch.cuda.empty_cache()
