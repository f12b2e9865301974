"""The hybrid property suite with `gdn_kernel="chunked"` on the CPU (the torch chunked form,
lockstep/ops/chunked_delta.py, through the real engine and tiny Qwen3.5): random schedules
with batch-mates, radix resumes at and between chunk boundaries with tails of 1..40 tokens,
every prefill chunk size, decode against rescoring, preemption: every position's logits, K/V,
final linear state and snapshot bits equal one cold prefill. Against transformers within 1e-4.
Negative controls: reference mode, and the chunked layers' rule replaced by chunks counted from each
step's first row, fail the same checks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.engine.sampling_params import SamplingParams
from lockstep.errors import ConfigError
from lockstep.models.linear_attention import CHUNK
from tests.support.invariance_harness import (
    Plan,
    check_every_chunk_size,
    compute,
    differ_alone,
    generation_scoring_mismatches,
    mismatches,
    random_plan,
    reference,
)
from tests.support.tiny_hf import save_tiny

HYBRID = "random:tiny-qwen3.5"
VOCAB = 512
_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _engine(model: str = HYBRID, mode: str = "deterministic", **options) -> Engine:
    options.setdefault("kv_tokens", 4096)
    options.setdefault("gdn_kernel", "chunked" if mode == "deterministic" else "recurrent")
    return Engine(EngineConfig(model=model, mode=mode, device="cpu", dtype="float32", **options))


@pytest.fixture(scope="module")
def chunked() -> Engine:
    return _engine()


def test_the_option_reaches_the_layers_and_is_refused_in_reference_mode(chunked: Engine) -> None:
    """The engine's state layout runs the chunked rule, whose bits differ from the recurrent
    kernel's (both the same math); reference mode with it is refused, naming the option."""
    assert chunked.decoder.linear_layout.kernel == "chunked"
    tokens = [random.Random(1).randrange(VOCAB) for _ in range(2 * CHUNK + 5)]
    recurrent = _engine(gdn_kernel="recurrent")
    ours, theirs = reference(chunked, tokens).logits, reference(recurrent, tokens).logits
    assert not torch.equal(ours, theirs)
    assert (ours - theirs).abs().max() < 1e-4
    with pytest.raises(ConfigError, match="gdn_kernel='chunked' is invalid with mode='reference'"):
        EngineConfig(model=HYBRID, mode="reference", gdn_kernel="chunked")
    with pytest.raises(ConfigError, match="gdn_kernel='tiles' is invalid"):
        EngineConfig(model=HYBRID, gdn_kernel="tiles")


def test_matches_transformers_prefill(tmp_path: Path) -> None:
    """A tiny Qwen3.5 saved by transformers: 150-token prefill logits within 1e-4."""
    model = save_tiny("qwen3_5", tmp_path)
    engine = _engine(str(tmp_path))
    tokens = [random.Random(3).randrange(300) for _ in range(150)]
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0]
    got = engine.decoder.logits_for_sequence(tokens)
    assert (got - want).abs().max() < 1e-4, float((got - want).abs().max())


def _check_case(engine: Engine, seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 3 * CHUNK + 20)
    tokens = [rng.randrange(VOCAB) for _ in range(n)]
    plan = random_plan(rng, n, 3)
    plan.donor_step = 48
    problems = mismatches(reference(engine, tokens), compute(engine, tokens, plan, rng))
    assert not problems, f"n={n} {plan.describe()}: " + "; ".join(problems)
    engine.check_integrity()


@settings(max_examples=12, **_SETTINGS)
@given(seed=st.integers(0, 2**32 - 1))
def test_any_schedule_with_batch_mates_matches_cold_prefill(chunked: Engine, seed: int) -> None:
    _check_case(chunked, seed)


def test_radix_resumes_at_and_between_chunk_boundaries(chunked: Engine) -> None:
    """Prefix hits at, just before and just after each of three boundaries and between them
    (the resume recomputes from the last kept boundary), each with an uncached tail of 1..40
    tokens beside a batch-mate: every position equal to a cold prefill. (test_hybrid.py runs
    every length 1..3C with the recurrent kernel.)"""
    rng = random.Random(11)
    stem = [rng.randrange(VOCAB) for _ in range(3 * CHUNK)]
    lengths = sorted({p for b in (CHUNK, 2 * CHUNK, 3 * CHUNK) for p in (b - 1, b, b + 1)}
                     | {1, 5, CHUNK // 2, CHUNK + 13, 2 * CHUNK + 20})  # fmt: skip
    for prefix in [p for p in lengths if p <= 3 * CHUNK]:
        tail = 1 + (prefix * 7) % 40
        tokens = stem[:prefix] + [rng.randrange(VOCAB) for _ in range(tail)]
        plan = Plan(prefix, [tail], [[rng.randint(1, 9)]], donor_step=CHUNK)
        problems = mismatches(reference(chunked, tokens), compute(chunked, tokens, plan, rng))
        assert not problems, f"prefix={prefix} tail={tail}: " + "; ".join(problems)
        chunked.flush_cache()
    chunked.check_integrity()


def test_every_chunk_size_from_one_to_the_whole_prompt(chunked: Engine) -> None:
    check_every_chunk_size(chunked, VOCAB, CHUNK)


def test_decode_equals_rescoring(chunked: Engine) -> None:
    rng = random.Random(2)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, CHUNK - 3, 2 * CHUNK - 1)]
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=12, temperature=temperature, seed=11, ignore_eos=True)
        assert generation_scoring_mismatches(chunked, prompts, params) == [], temperature
    chunked.check_integrity()


@settings(max_examples=4, **_SETTINGS)
@given(seed=st.integers(0, 2**32 - 1))
def test_preemption_and_batch_mates_match_alone(seed: int) -> None:
    """Whole requests through the scheduler under small budgets and a KV pool that forces
    eviction and preemption: each request's tokens and logprobs equal it alone."""
    rng = random.Random(seed)
    stem = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 2 * CHUNK))]
    requests = {}
    for i in range(rng.randint(3, 6)):
        prompt = stem[: rng.randint(1, len(stem))]
        prompt += [rng.randrange(VOCAB) for _ in range(rng.randint(0, 30))]
        params = SamplingParams(max_tokens=rng.randint(1, 16), temperature=rng.choice([0.0, 1.0]),
                                seed=i, ignore_eos=True)  # fmt: skip
        requests[f"r{i}"] = (prompt, params)
    largest = max(len(p) + params.max_tokens for p, params in requests.values())
    max_batch_tokens = rng.randint(8, 96)
    engine = _engine(
        kv_tokens=largest + rng.randint(0, 40), output_reserve=rng.choice([0.0, 0.5, 1.0]),
        max_batch_tokens=max_batch_tokens, chunk_size=rng.randint(1, max_batch_tokens),
        max_running=rng.randint(2, min(8, max_batch_tokens)), debug_checks=True,
    )  # fmt: skip
    differing = differ_alone(engine, requests)
    assert not differing, f"{differing} differ when scheduled together"
    engine.check_integrity()


def _failures(engine: Engine) -> int:
    failures = 0
    for seed in range(8):
        rng = random.Random(seed)
        n = rng.randint(CHUNK // 2, 2 * CHUNK)
        tokens = [rng.randrange(VOCAB) for _ in range(n)]
        plan = random_plan(rng, n, max_mates=2)
        failures += bool(mismatches(reference(engine, tokens), compute(engine, tokens, plan, rng)))
    return failures


def test_negative_control_reference_mode_and_chunk_relative_tiles_fail() -> None:
    """Reference mode fails the property; so does the chunked engine with its rule's chunks
    counted from each step's first row (transformers' chunked form, which ignores the open
    rows): the suite sees where the chunks sit."""
    assert _failures(_engine(mode="reference")) > 0
    from lockstep.ops.cpu_deterministic import CpuDeterministicOps
    from lockstep.ops.torch_stock import stock_gated_delta_rule

    class ChunkRelative(CpuDeterministicOps):
        def chunked_delta_rule(self, q, k, v, g, beta, state, open_k, open_v, open_g,
                               open_beta, start):  # fmt: skip
            out, final = stock_gated_delta_rule(q, k, v, g, beta, state, open_k.shape[0])
            state.copy_(final)
            end = start + q.shape[0]
            return out, [(end, final.clone())] if end % open_k.shape[0] == 0 else []

    engine = _engine()
    engine.decoder.ops = ChunkRelative()
    assert _failures(engine) > 0, "chunk-relative tiles passed: the check is blind"
