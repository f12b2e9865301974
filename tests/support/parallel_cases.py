"""What the tensor- and expert-parallel suites share (tests/contract/test_moe_parallel.py,
test_fp8_parallel.py, test_hybrid_parallel.py): CPU engines of a folder at a degree, random
token sequences, the sequences two engines disagree on, and the property suite's case at a
degree: through the decoder (`check_property_cases`) or, for hybrid models, whose states at
tp > 1 live in the engine's pools, through the engine's requests (`check_request_cases`)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lockstep import LLM, SamplingParams
from tests.support.invariance_harness import (
    compute,
    generation_scoring_mismatches,
    mismatches,
    random_plan,
    reference,
)

# The engines a degree suite compares: TP 1 under the chunked reduction (the bits every degree
# must give), TP 1's default reduction (the control), TP 2, EP 2 and TP 4.
DEGREES: dict[Any, tuple[int, dict[str, Any]]] = {
    1: (1, {"tp_reduction": "chunked"}),
    "default": (1, {}),
    2: (2, {}),
    "ep2": (2, {"ep": 2}),
    4: (4, {}),
}


def llm_at(folder: Path, tp: int, **options: Any) -> LLM:
    """An `LLM` of `folder` on the CPU in float32 at degree `tp` (a 1,024-token pool)."""
    options.setdefault("kv_tokens", 1024)
    return LLM(str(folder), device="cpu", dtype="float32", tp=tp, **options)


@contextmanager
def engines_at(
    folder: Path, names: tuple[Any, ...] = (1, "default", 2, "ep2"), **common: Any
) -> Iterator[dict]:
    """The engines of `folder` at each of `names` (keys of DEGREES), each with the options
    `common` too, closed afterwards."""
    llms: dict[Any, LLM] = {}
    try:
        for name in names:
            tp, options = DEGREES[name]
            llms[name] = llm_at(folder, tp, **options, **common)
        yield {name: llm.engine for name, llm in llms.items()}
    finally:
        for llm in llms.values():
            llm.close()


def random_sequences(count: int, max_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300) for _ in range(rng.randint(1, max_len))] for _ in range(count)]


def differing(engine: Any, other: Any, seqs: list[list[int]]) -> list[int]:
    """The sequences whose cold-prefill logits or KV differ between two engines."""
    return [
        i
        for i, tokens in enumerate(seqs)
        if mismatches(reference(engine, tokens), reference(other, tokens))
    ]


def check_property_cases(engine: Any, single: Any, seeds: range) -> None:
    """The property suite's case at a degree: random prefix hits, partitions and batch-mates
    equal one cold prefill, at that degree (`engine`) and at TP 1 (`single`)."""
    for seed in seeds:
        rng = random.Random(seed)
        n = rng.randint(1, 40)
        tokens = [rng.randrange(300) for _ in range(n)]
        plan = random_plan(rng, n, max_mates=3)
        got = compute(engine, tokens, plan, rng)
        problems = mismatches(reference(engine, tokens), got)
        problems += mismatches(reference(single, tokens), got)
        assert not problems, f"n={n} {plan.describe()}: " + "; ".join(problems)
        engine.check_integrity()


def _outputs(engine: Any, prompts: list[list[int]], params: SamplingParams) -> list[tuple]:
    """Each prompt's generated tokens and logprobs, the prompts queued together."""
    llm = LLM.__new__(LLM)  # around `engine`, without loading the model again
    llm.engine, llm.tokenizer, llm._counter = engine, engine.tokenizer, 0
    return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]


def check_request_cases(engine: Any, single: Any, seed: int) -> None:
    """The property suite's case through the engine's requests (the scheduler, the pools and
    the radix cache of `engine`, at its degree): prompts sharing a random stem, generated
    side by side (batch-mates; chunked prefill where `engine`'s max_batch_tokens is small),
    then again (prefix hits, resumed from the cache's snapshots), each equal to the same
    prompt generated alone on a cold cache by `single` (TP 1); then decode equal to
    rescoring. The second round must hit the cache, or it would prove nothing about hits."""
    rng = random.Random(seed)
    stem = [rng.randrange(300) for _ in range(rng.randint(33, 90))]
    prompts = [stem[: rng.randint(1, len(stem))] + [rng.randrange(300) for _ in
               range(rng.randint(1, 30))] for _ in range(4)]  # fmt: skip
    params = SamplingParams(temperature=0.9, seed=seed, max_tokens=8, logprobs=0,
                            ignore_eos=True)  # fmt: skip
    alone = []
    for prompt in prompts:
        single.flush_cache()
        alone += _outputs(single, [prompt], params)
    engine.flush_cache()
    cached = engine.stats()["cached_tokens_total"]
    for round_ in ("cold", "hits"):
        got = _outputs(engine, prompts, params)
        bad = [i for i, (a, b) in enumerate(zip(alone, got, strict=True)) if a != b]
        assert not bad, f"seed={seed} {round_}: prompts {bad} differ from TP 1 alone"
    assert engine.stats()["cached_tokens_total"] > cached, "no prefix hit"
    assert generation_scoring_mismatches(engine, prompts, params) == []
    engine.check_integrity()
