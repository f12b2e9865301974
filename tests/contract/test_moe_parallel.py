"""Mixture-of-experts models under tensor parallelism on the CPU (gloo, one process per rank):
the same bits at every degree (lockstep/parallel/experts.py).

On a tiny Qwen3-MoE folder written by transformers (8 experts of width 40, top 2; dense and
sparse layers):

* TP 2 and TP 4 give TP 1's bits (the chunked reduction) for logits and every KV head.
* The property suite at TP 2: random prefix hits, partitions and batch-mates equal one cold
  prefill, at TP 2 and at TP 1; generated logprobs equal the rescored ones.
* Negative controls: TP 2 under the "ranks" reduction, TP 1's default one-call experts and
  fast mode at TP 2 each give other bits.
* A worker killed mid-run ends the engine with the one-line `TensorParallelError`.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from lockstep import LLM, SamplingParams
from lockstep.parallel.group import TensorParallelError
from tests.support.invariance_harness import (
    compute,
    generation_scoring_mismatches,
    mismatches,
    random_plan,
    reference,
)
from tests.support.tiny_hf import save_tiny


def _llm(folder: Path, tp: int, **options) -> LLM:
    options.setdefault("kv_tokens", 1024)
    return LLM(str(folder), device="cpu", dtype="float32", tp=tp, **options)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3_moe")
    save_tiny("qwen3_moe", folder)
    return folder


@pytest.fixture(scope="module")
def engines(moe_folder: Path):
    """The Qwen3-MoE folder at TP 1 (chunked) and TP 2: 3 processes."""
    llms = {}
    try:
        llms[1] = _llm(moe_folder, 1, tp_reduction="chunked")
        llms[2] = _llm(moe_folder, 2)
        yield {name: llm.engine for name, llm in llms.items()}
    finally:
        for llm in llms.values():
            llm.close()


def _sequences(count: int, max_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300) for _ in range(rng.randint(1, max_len))] for _ in range(count)]


def _differing(engine, other, sequences) -> list[int]:
    """The sequences whose cold-prefill logits or KV differ between two engines."""
    return [
        i
        for i, tokens in enumerate(sequences)
        if mismatches(reference(engine, tokens), reference(other, tokens))
    ]


def test_tp_2_gives_the_logits_and_kv_of_tp_1(engines) -> None:
    sequences = _sequences(4, 48, seed=1)
    assert engines[2].decoder.spec.moe is not None
    assert _differing(engines[1], engines[2], sequences) == []


def test_position_invariance_at_tp_2(engines) -> None:
    """The property suite's case at TP 2: random prefix hits, partitions and batch-mates
    equal one cold prefill at TP 2 and at TP 1."""
    engine, single = engines[2], engines[1]
    for seed in range(8):
        rng = random.Random(seed)
        n = rng.randint(1, 40)
        tokens = [rng.randrange(300) for _ in range(n)]
        plan = random_plan(rng, n, max_mates=3)
        got = compute(engine, tokens, plan, rng)
        problems = mismatches(reference(engine, tokens), got)
        problems += mismatches(reference(single, tokens), got)
        assert not problems, f"n={n} {plan.describe()}: " + "; ".join(problems)
        engine.check_integrity()


def test_decode_equals_rescoring_at_tp_2(engines) -> None:
    params = SamplingParams(temperature=0.9, seed=7, max_tokens=10, logprobs=0, ignore_eos=True)
    prompts = _sequences(3, 12, seed=4)
    assert generation_scoring_mismatches(engines[2], prompts, params) == []
    engines[2].check_integrity()


def test_tp_4_gives_the_bits_of_tp_1(engines, moe_folder: Path) -> None:
    four = _llm(moe_folder, 4)
    try:
        assert _differing(engines[1], four.engine, _sequences(2, 32, seed=5)) == []
    finally:
        four.close()


def test_controls_other_reductions_and_fast_mode_change_bits(engines, moe_folder: Path) -> None:
    """The chunked rule is what makes the degrees agree: TP 2 under "ranks" (one partial per
    rank), TP 1's default one-call experts and fast mode at TP 2 each differ from TP 1."""
    sequences = _sequences(3, 48, seed=2)
    controls = {
        "tp=2 ranks": lambda: _llm(moe_folder, 2, tp_reduction="ranks"),
        "tp=1 default": lambda: _llm(moe_folder, 1),
        "tp=2 fast": lambda: _llm(moe_folder, 2, mode="fast"),
    }
    for name, make in controls.items():
        llm = make()
        try:
            assert _differing(engines[1], llm.engine, sequences), f"{name} gave the TP 1 bits"
        finally:
            llm.close()


def test_a_killed_rank_ends_the_engine_with_one_line(moe_folder: Path) -> None:
    llm = _llm(moe_folder, 2)
    try:
        engine = llm.engine
        params = SamplingParams(max_tokens=50, ignore_eos=True)
        engine.add_request("r", [1, 2, 3], params)
        engine.step()
        (pid,) = engine.workers.pids
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TensorParallelError) as info:
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - start < 10
        message = str(info.value)
        assert "\n" not in message
        assert f"rank 1 (pid {pid}) exited with status -9" in message
    finally:
        llm.close()
