"""Mixture-of-experts models under tensor and expert parallelism over NCCL, one GPU per rank:
the CPU suite's checks (tests/contract/test_moe_parallel.py) on CUDA in bf16.

* `random:tiny-qwen3-moe` and `random:tiny-deepseek-v3` (MLA, grouped routing, an ungated
  shared expert) at TP 2 and EP 2 give TP 1's chunked bits (TP 1 without CUDA graphs, which
  the chunked experts' host reads refuse), logits and every KV head; at TP 4 and EP 4 too
  where four GPUs are visible.
* The property suite (random prefix hits, partitions, batch-mates) at TP 2 and EP 2.
* Controls: TP 2 under "ranks", reference mode at TP 2, and EP 2 under "all_reduce" (NCCL's SUM
  of each rank's own combination) differ from TP 1.

Needs two CUDA devices (four for the degree-4 case); on fewer it skips, naming the count.
Run: `pytest -q tests/gpu/test_gpu_moe_parallel.py` on a 2-, 4- or 8-GPU host.
"""

from __future__ import annotations

import random

import pytest
import torch

from lockstep import LLM
from tests.support.invariance_harness import compute, mismatches, random_plan, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2,
        reason=f"needs 2 CUDA devices, {torch.cuda.device_count()} visible",
    ),
]

MODELS = ("random:tiny-qwen3-moe", "random:tiny-deepseek-v3")


def _llm(model: str, tp: int, **options) -> LLM:
    options.setdefault("kv_tokens", 4096)
    return LLM(model, device="cuda", dtype="bfloat16", tp=tp, **options)


def _sequences(vocab: int, count: int, max_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, max_len))] for _ in range(count)]


def _differing(engine, other, sequences) -> list[int]:
    return [
        i
        for i, tokens in enumerate(sequences)
        if mismatches(reference(engine, tokens), reference(other, tokens))
    ]


@pytest.fixture(scope="module", params=MODELS)
def engines(request):
    model = request.param
    llms = {}
    try:
        llms[1] = _llm(model, 1, tp_reduction="chunked", cuda_graphs=False)
        llms[2] = _llm(model, 2)
        llms["ep2"] = _llm(model, 2, ep=2)
        yield {name: llm.engine for name, llm in llms.items()}
    finally:
        for llm in llms.values():
            llm.close()


def test_tp_2_and_ep_2_give_the_bits_of_tp_1(engines) -> None:
    vocab = engines[1].decoder.spec.vocab_size
    sequences = _sequences(vocab, 4, 200, seed=1)
    for degree in (2, "ep2"):
        assert _differing(engines[1], engines[degree], sequences) == [], degree


@pytest.mark.parametrize("degree", [2, "ep2"])
def test_position_invariance(engines, degree) -> None:
    engine, single = engines[degree], engines[1]
    vocab = engine.decoder.spec.vocab_size
    for seed in range(8):
        rng = random.Random(seed)
        n = rng.randint(1, 300)
        tokens = [rng.randrange(vocab) for _ in range(n)]
        plan = random_plan(rng, n, max_mates=4)
        got = compute(engine, tokens, plan, rng)
        problems = mismatches(reference(engine, tokens), got)
        problems += mismatches(reference(single, tokens), got)
        assert not problems, f"n={n} {plan.describe()}: " + "; ".join(problems)
        engine.check_integrity()


def test_controls_change_bits(engines) -> None:
    model = engines[1].config.model
    vocab = engines[1].decoder.spec.vocab_size
    sequences = _sequences(vocab, 3, 200, seed=2)
    for options in ({"tp_reduction": "ranks"}, {"mode": "reference"},
                    {"ep": 2, "tp_reduction": "all_reduce"}):  # fmt: skip
        llm = _llm(model, 2, **options)
        try:
            assert _differing(engines[1], llm.engine, sequences), f"{options} gave TP 1's bits"
        finally:
            llm.close()


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA devices")
@pytest.mark.parametrize("model", MODELS)
def test_degree_4_gives_the_bits_of_tp_1(model: str) -> None:
    single = _llm(model, 1, tp_reduction="chunked", cuda_graphs=False)
    vocab = single.engine.decoder.spec.vocab_size
    sequences = _sequences(vocab, 3, 200, seed=3)
    for options in ({}, {"ep": 4}):
        four = _llm(model, 4, **options)
        try:
            assert _differing(single.engine, four.engine, sequences) == [], options
        finally:
            four.close()


def test_tp_1_chunked_with_cuda_graphs_is_refused_in_one_line() -> None:
    from lockstep.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        _llm("random:tiny-qwen3-moe", 1, tp_reduction="chunked")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("tp_reduction='chunked' is invalid with CUDA graphs for ")
