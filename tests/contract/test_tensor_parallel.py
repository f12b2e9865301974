"""Tensor parallelism on the CPU (gloo, one process per rank): the same bits at every degree.

* TP 1, 2 and 4 give bit-identical logits and KV entries (all KV heads gathered) for the same
  sequences on random:tiny (4 heads, 2 KV heads: TP 4 holds each KV head on two ranks), and
  TP 1 and 3 on the default model (9 heads, 3 KV heads: 1 and 3 are its only degrees).
* The position-invariance property (random prefix hits, partitions and batch-mates against
  one cold prefill, tests/support/invariance_harness.py) holds at TP 2 and TP 4, and across degrees.
* Negative controls: the library's all-reduce SUM at TP 2, and the unchunked reduction at
  TP 1, both change bits; a reduction tree in another order changes bits.
* Bad degrees are refused with one line naming what works.
"""

from __future__ import annotations

import random

import pytest
import torch

from lockstep import LLM, SamplingParams
from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.errors import ConfigError
from lockstep.models.presets import PRESETS
from lockstep.parallel.sharding import CHUNKS, supported_degrees, tree_sum
from tests.support.invariance_harness import compute, mismatches, random_plan, reference

TINY = "random:tiny"


def _llm(model: str | None, tp: int, **options) -> LLM:
    options.setdefault("kv_tokens", 1024)
    return LLM(model, device="cpu", dtype="float32", tp=tp, **options)


@pytest.fixture(scope="module")
def tiny_engines():
    """random:tiny at TP 1, 2 and 4 (7 processes in all)."""
    llms = {}
    try:
        for tp in (1, 2, 4):
            llms[tp] = _llm(TINY, tp, tp_reduction="chunked")
        yield {tp: llm.engine for tp, llm in llms.items()}
    finally:
        for llm in llms.values():
            llm.close()


def _sequences(vocab: int, count: int, max_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, max_len))] for _ in range(count)]


def _assert_same(a, b, what: str) -> None:
    problems = mismatches(a, b)
    assert not problems, f"{what}: " + "; ".join(problems)


def test_degrees_each_model_takes() -> None:
    assert supported_degrees(PRESETS["tiny"].spec) == [1, 2, 4]
    assert supported_degrees(PRESETS["smollm2-135m"].spec) == [1, 3]
    assert supported_degrees(PRESETS["qwen3-8b"].spec) == [1, 2, 4, 8]
    assert supported_degrees(PRESETS["tiny-qwen3-moe"].spec) == [1, 2, 4]
    assert supported_degrees(PRESETS["tiny-qwen3.5"].spec) == [1, 2]  # 2 linear key heads
    assert supported_degrees(PRESETS["tiny-deepseek-v3"].spec) == [1, 2, 4]  # MLA: 4 heads
    assert supported_degrees(PRESETS["deepseek-v3-fp8"].spec) == [1, 2, 4, 8]  # block FP8
    assert supported_degrees(PRESETS["qwen3-8b-fp8-channel"].spec) == [1]  # per-channel FP8


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"tp": 0}, "tp=0 is invalid: expected an integer from 1 to 8"),
        ({"tp": 9}, "tp=9 is invalid: expected an integer from 1 to 8"),
        ({"tp": 2, "overlap_decode": True}, "overlap_decode=True is invalid with tp=2"),
        ({"tp_reduction": "sum"}, "tp_reduction='sum' is invalid: expected one of chunked"),
    ],
)
def test_bad_tp_options_are_refused(options: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match="^" + needle.replace("(", r"\(")):
        EngineConfig(device="cpu", **options)


def test_a_degree_the_model_cannot_take_is_refused_with_what_works() -> None:
    with pytest.raises(ConfigError) as info:
        Engine(EngineConfig(device="cpu", tp=2, kv_tokens=64))  # SmolLM2: 9 heads
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("tp=2 is invalid for SmolLM2")
    assert "does not divide the 9 attention heads" in message
    assert message.endswith("degrees that work: 1, 3")


def test_tree_sum_is_one_fixed_tree() -> None:
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(64, 32, generator=gen) * 10.0**e for e in range(CHUNKS)]
    expected = ((parts[0] + parts[1]) + (parts[2] + parts[3])) + (
        (parts[4] + parts[5]) + (parts[6] + parts[7])
    )
    assert torch.equal(tree_sum(parts), expected)
    with_empty = [None if i == 2 else p for i, p in enumerate(parts)]
    right = (parts[4] + parts[5]) + (parts[6] + parts[7])
    assert torch.equal(tree_sum(with_empty), ((parts[0] + parts[1]) + parts[3]) + right)
    # Control: a left fold of the same partials differs, so the tree's order matters.
    fold = parts[0]
    for p in parts[1:]:
        fold = fold + p
    assert not torch.equal(fold, expected)


def test_tp_1_2_4_give_the_same_logits_and_kv(tiny_engines) -> None:
    vocab = tiny_engines[1].decoder.spec.vocab_size
    for tokens in _sequences(vocab, 4, 48, seed=1):
        ref = reference(tiny_engines[1], tokens)
        for tp in (2, 4):
            _assert_same(ref, reference(tiny_engines[tp], tokens), f"tp={tp} n={len(tokens)}")


@pytest.mark.parametrize("tp", [2, 4])
def test_position_invariance_at_tp(tiny_engines, tp: int) -> None:
    """The property suite's case at TP > 1: random prefix hits, partitions and batch-mates
    equal one cold prefill at this degree and at TP 1."""
    engine, single = tiny_engines[tp], tiny_engines[1]
    for seed in range(12 if tp == 2 else 8):
        rng = random.Random(seed)
        n = rng.randint(1, 40)
        tokens = [rng.randrange(engine.decoder.spec.vocab_size) for _ in range(n)]
        plan = random_plan(rng, n, max_mates=3)
        got = compute(engine, tokens, plan, rng)
        ref = reference(engine, tokens)
        problems = mismatches(ref, got) + mismatches(reference(single, tokens), got)
        assert not problems, f"tp={tp} n={n} {plan.describe()}: " + "; ".join(problems)
        engine.check_integrity()


def test_generation_is_the_same_at_tp_1_and_4(tiny_engines) -> None:
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, logprobs=0, ignore_eos=True)
    outs = {}
    for tp in (1, 4):
        engine = tiny_engines[tp]
        engine.add_request(f"gen-{tp}", [5, 6, 7, 8], params)
        tokens, logprobs = [], []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
                logprobs += [lp.logprob for lp in out.new_logprobs or []]
        outs[tp] = (tokens, logprobs)
    assert len(outs[1][0]) == 12
    assert outs[1] == outs[4]


def test_control_all_reduce_sum_changes_bits(tiny_engines) -> None:
    """The library's SUM over ranks at TP 2 (and the unchunked linear at TP 1) differ from
    the chunked reduction: the property above is not true of any reduction."""
    vocab = tiny_engines[1].decoder.spec.vocab_size
    sequences = _sequences(vocab, 3, 48, seed=2)
    refs = [reference(tiny_engines[1], t) for t in sequences]
    unchunked = _llm(TINY, 1, tp_reduction="ranks")
    summed = _llm(TINY, 2, tp_reduction="all_reduce")
    try:
        for other in (unchunked.engine, summed.engine):
            diffs = [
                mismatches(ref, reference(other, t)) for ref, t in zip(refs, sequences, strict=True)
            ]
            assert any(diffs), f"{other.config.tp_reduction} gave the chunked bits"
    finally:
        summed.close()


@pytest.mark.slow
def test_default_model_tp_1_and_3_give_the_same_bits() -> None:
    """SmolLM2-135M (9 heads, 3 KV heads) takes TP 1 and 3 only: the same bits at both, by
    cold prefill and by a random partition with batch-mates."""
    single = _llm(None, 1, kv_tokens=512, tp_reduction="chunked")
    three = _llm(None, 3, kv_tokens=512)
    try:
        vocab = single.engine.decoder.spec.vocab_size
        for seed, tokens in enumerate(_sequences(vocab, 2, 24, seed=3)):
            ref = reference(single.engine, tokens)
            _assert_same(ref, reference(three.engine, tokens), f"tp=3 n={len(tokens)}")
            rng = random.Random(seed)
            plan = random_plan(rng, len(tokens), max_mates=2)
            got = compute(three.engine, tokens, plan, rng)
            _assert_same(ref, got, f"tp=3 n={len(tokens)} {plan.describe()}")
    finally:
        three.close()
