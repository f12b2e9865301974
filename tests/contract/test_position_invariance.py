"""The property suite: position invariance, proven on random cases (docs/design.md, "The contract").

Each case draws a token sequence and a random way of computing it (a prefix-cache hit of any
length, any partition into forward passes including one-token decode steps, random batch-mates
in every pass at random row offsets) and compares every position's logits and K/V entries
bitwise with one cold full prefill. Further tests cover decode versus teacher-forced scoring,
prefix hits at every offset, and a restart in a second process. The negative control runs the
same property in reference mode (plain torch, float32) and requires it to fail. The tiny
mixture-of-experts preset runs the same suite, with a control in which only its MoE op is
the stock one.

Case counts: LOCKSTEP_LONG_TESTS=1 multiplies them (thousands of cases).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.engine.sampling_params import SamplingParams
from tests.support.invariance_harness import (
    compute,
    differ_alone,
    mismatches,
    random_plan,
    reference,
)

LONG = os.environ.get("LOCKSTEP_LONG_TESTS") == "1"
TINY_CASES = 2000 if LONG else 200
DEFAULT_CASES = 400 if LONG else 40
MOE_CASES = 400 if LONG else 40
MOE = "random:tiny-qwen3-moe"

_SETTINGS = dict(
    deadline=None,
    derandomize=not LONG,  # CI runs the same cases every time; the long mode explores
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)


def _engine(model: str, mode: str = "deterministic", **options) -> Engine:
    options.setdefault("kv_tokens", 4096)
    return Engine(EngineConfig(model=model, mode=mode, device="cpu", dtype="float32", **options))


@pytest.fixture(scope="module")
def tiny() -> Engine:
    return _engine("random:tiny")


@pytest.fixture(scope="module")
def default_model() -> Engine:
    return _engine(None)


@pytest.fixture(scope="module")
def moe() -> Engine:
    return _engine(MOE)


def _check_case(engine: Engine, seed: int, max_len: int, max_mates: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, max_len)
    tokens = [rng.randrange(engine.decoder.spec.vocab_size) for _ in range(n)]
    plan = random_plan(rng, n, max_mates)
    ref = reference(engine, tokens)
    got = compute(engine, tokens, plan, rng)
    problems = mismatches(ref, got)
    assert not problems, f"n={n} {plan.describe()}: " + "; ".join(problems)
    engine.check_integrity()


@settings(max_examples=TINY_CASES, **_SETTINGS)
@given(seed=st.integers(0, 2**32 - 1))
def test_any_schedule_matches_cold_prefill_tiny(tiny: Engine, seed: int) -> None:
    _check_case(tiny, seed, max_len=160, max_mates=4)


@settings(max_examples=DEFAULT_CASES, **_SETTINGS)
@given(seed=st.integers(0, 2**32 - 1))
def test_any_schedule_matches_cold_prefill_default_model(default_model: Engine, seed: int) -> None:
    _check_case(default_model, seed, max_len=48, max_mates=2)


@settings(max_examples=MOE_CASES, **_SETTINGS)
@given(seed=st.integers(0, 2**32 - 1))
def test_any_schedule_matches_cold_prefill_moe(moe: Engine, seed: int) -> None:
    """Batch-mates load the experts differently in every pass; a token's bits stay."""
    _check_case(moe, seed, max_len=100, max_mates=4)


@pytest.mark.parametrize("model", ["random:tiny-qwen2", "random:tiny-qwen3"])
def test_other_families_keep_the_contract(model: str) -> None:
    engine = _engine(model)
    for seed in range(15):
        _check_case(engine, seed, max_len=100, max_mates=3)


def _prefix_hit_at_every_offset(engine: Engine, n: int) -> None:
    rng = random.Random(7)
    tokens = [rng.randrange(engine.decoder.spec.vocab_size) for _ in range(n)]
    ref = reference(engine, tokens)
    from tests.support.invariance_harness import Plan

    for prefix in range(1, n):
        rest = n - prefix
        got = compute(engine, tokens, Plan(prefix, [rest], [[rng.randint(1, 9)]]), rng)
        problems = mismatches(ref, got)
        assert not problems, f"prefix={prefix}: " + "; ".join(problems)
        engine.flush_cache()
    engine.check_integrity()


def test_prefix_hit_at_every_offset(tiny: Engine) -> None:
    """Cache hits of every length 1..n-1 (so every offset modulo the key block and split)."""
    _prefix_hit_at_every_offset(tiny, 150)


def test_prefix_hit_at_every_offset_moe(moe: Engine) -> None:
    _prefix_hit_at_every_offset(moe, 80)  # every offset modulo the CPU's 32-key block, twice


def _generation_logprobs_equal_scoring(engine: Engine) -> None:
    from lockstep.engine.llm import LLM

    llm = LLM.__new__(LLM)  # reuse the module's engine instead of loading the model again
    llm.engine, llm.tokenizer, llm._counter = engine, engine.tokenizer, 0
    prompts = ["The quick brown fox", "def fibonacci(n):", "Paris is the capital of"]
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=20, temperature=temperature, seed=11, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        scores = llm.score([o.prompt_token_ids + o.token_ids for o in outs], use_tqdm=False)
        for out, score in zip(outs, scores, strict=True):
            tail = score.logprobs[len(out.prompt_token_ids) :]
            assert tail == out.logprobs, (temperature, out.text)
    engine.check_integrity()


def test_generation_logprobs_equal_scoring(default_model: Engine) -> None:
    """Decode one token at a time vs a prefill of the whole text: the logprob each generated
    token got equals, bit for bit, its teacher-forced score, greedy and sampled."""
    _generation_logprobs_equal_scoring(default_model)


def test_generation_logprobs_equal_scoring_moe(moe: Engine) -> None:
    _generation_logprobs_equal_scoring(moe)


def test_negative_control_reference_mode_decode_differs_from_scoring() -> None:
    """The decode-vs-scoring comparison above can fail: in reference mode (float32 torch GEMM, whose
    rows change with M) one-token decode steps and a whole-text prefill disagree."""
    from lockstep.engine.llm import LLM

    llm = LLM(None, mode="reference", device="cpu", dtype="float32", kv_tokens=4096)
    prompts = ["The quick brown fox", "def fibonacci(n):", "Paris is the capital of"]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    scores = llm.score([o.prompt_token_ids + o.token_ids for o in outs], use_tqdm=False)
    differs = sum(
        score.logprobs[len(out.prompt_token_ids) :] != out.logprobs
        for out, score in zip(outs, scores, strict=True)
    )
    assert differs > 0, "reference mode agreed with scoring everywhere: the comparison is blind"


_RESTART_SCRIPT = """
import json, random, sys, torch
sys.path.insert(0, sys.argv[1])
from tests.support.invariance_harness import reference
from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
e = Engine(EngineConfig(model="random:tiny", device="cpu", dtype="float32", kv_tokens=512))
rng = random.Random(5)
tokens = [rng.randrange(e.decoder.spec.vocab_size) for _ in range(64)]
print(json.dumps(reference(e, tokens).logits.view(torch.int32).flatten().tolist()[:4096]))
tokens[0] = (tokens[0] + 1) % e.decoder.spec.vocab_size  # the control: another first token
print(json.dumps(reference(e, tokens).logits.view(torch.int32).flatten().tolist()[:4096]))
"""


def test_restart_in_a_second_process(tiny: Engine) -> None:
    """A fresh process (new engine, new extension load, new allocations) gives the same bits."""
    here = os.path.join(os.path.dirname(__file__), "..", "..")  # the repository root
    out = subprocess.run(
        [sys.executable, "-c", _RESTART_SCRIPT, here],
        capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    theirs, perturbed = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    rng = random.Random(5)
    tokens = [rng.randrange(tiny.decoder.spec.vocab_size) for _ in range(64)]
    ours = reference(tiny, tokens).logits.view(torch.int32).flatten().tolist()[:4096]
    assert ours == theirs
    assert ours != perturbed, "the comparison did not see a changed input: it is blind"


def _batch_invariance_failures(engine: Engine, stop_at_first: bool = False) -> int:
    """How many of 12 random wide-batch schedules miss the cold prefill's bits (a negative
    control's count); `stop_at_first`: stop counting at the first (a quicker control)."""
    failures = 0
    for seed in range(12):
        rng = random.Random(seed)
        n = rng.randint(4, 32)
        tokens = [rng.randrange(engine.decoder.spec.vocab_size) for _ in range(n)]
        ref = reference(engine, tokens)
        plan = random_plan(rng, n, max_mates=3, allow_prefix=False)
        plan.mates_per_step = [[rng.randint(4, 24) for _ in range(3)] for _ in plan.chunks]
        got = compute(engine, tokens, plan, rng)
        failures += bool(mismatches(ref, got))
        if failures and stop_at_first:
            break
    return failures


def test_negative_control_reference_mode_breaks_batch_invariance() -> None:
    """The same property in reference mode (plain torch, float32) must fail: the suite can fail."""
    failures = _batch_invariance_failures(_engine(None, mode="reference"))
    assert failures > 0, "reference mode kept batch invariance on every case: the check is blind"


def test_negative_control_moe_reference_mode_and_stock_moe_break_batch_invariance() -> None:
    """On the MoE preset the property fails in reference mode, and also when everything is
    deterministic but the MoE op (transformers' loop of torch GEMMs over each expert's
    tokens): the suite sees the experts' arithmetic, not only attention's and the dense
    linears'."""
    assert _batch_invariance_failures(_engine(MOE, mode="reference")) > 0
    from lockstep.ops.cpu_deterministic import CpuDeterministicOps
    from lockstep.ops.cpu_stock import CpuStockOps

    class StockMoe(CpuDeterministicOps):
        def moe(self, x, layer):
            return CpuStockOps.moe(CpuStockOps(), x, layer)  # det weights: K is already 16-aligned

    engine = _engine(MOE)
    engine.decoder.ops = StockMoe()
    assert _batch_invariance_failures(engine) > 0, "stock MoE passed: the check is blind"


@settings(max_examples=40 if LONG else 8, **_SETTINGS)
@given(seed=st.integers(0, 2**32 - 1))
def test_engine_schedules_with_preemption_match_alone(seed: int) -> None:
    """Whole requests through the real scheduler under random budgets (chunk size, step token
    budget, running cap, a KV pool small enough to evict and preempt): every request's tokens
    and logprobs equal those of the same request alone on a cold cache."""
    rng = random.Random(seed)
    vocab = 512  # random:tiny
    stem = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
    requests = {}
    for i in range(rng.randint(4, 12)):
        prompt = stem[: rng.randint(1, len(stem))]
        prompt += [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
        params = SamplingParams(max_tokens=rng.randint(1, 20), temperature=rng.choice([0.0, 1.0]),
                                seed=i, ignore_eos=True)  # fmt: skip
        requests[f"r{i}"] = (prompt, params)
    # A pool barely larger than the largest request: the batch must evict and preempt.
    largest = max(len(p) + params.max_tokens for p, params in requests.values())
    max_batch_tokens = rng.randint(8, 96)
    engine = _engine(
        "random:tiny",
        kv_tokens=largest + rng.randint(0, 40),
        output_reserve=rng.choice([0.0, 0.5, 1.0]),
        max_batch_tokens=max_batch_tokens,
        chunk_size=rng.randint(1, max_batch_tokens),
        max_running=rng.randint(2, min(12, max_batch_tokens)),
        debug_checks=True,
    )
    assert engine.decoder.spec.vocab_size == vocab

    differing = differ_alone(engine, requests)
    assert not differing, f"{differing} differ when scheduled together"
    engine.check_integrity()
