"""What the tensor- and expert-parallel suites share (tests/contract/test_moe_parallel.py,
test_fp8_parallel.py): CPU engines of a folder at a degree, random token sequences, the
sequences two engines disagree on, and the property suite's case at a degree."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lockstep import LLM
from tests.support.invariance_harness import compute, mismatches, random_plan, reference

# The engines a degree suite compares: TP 1 under the chunked reduction (the bits every degree
# must give), TP 1's default reduction (the control), TP 2 and EP 2.
DEGREES: dict[Any, tuple[int, dict[str, Any]]] = {
    1: (1, {"tp_reduction": "chunked"}),
    "default": (1, {}),
    2: (2, {}),
    "ep2": (2, {"ep": 2}),
}


def llm_at(folder: Path, tp: int, **options: Any) -> LLM:
    """An `LLM` of `folder` on the CPU in float32 at degree `tp` (a 1,024-token pool)."""
    options.setdefault("kv_tokens", 1024)
    return LLM(str(folder), device="cpu", dtype="float32", tp=tp, **options)


@contextmanager
def engines_at(folder: Path, names: tuple[Any, ...] = tuple(DEGREES)) -> Iterator[dict]:
    """The engines of `folder` at each of `names` (keys of DEGREES), closed afterwards."""
    llms: dict[Any, LLM] = {}
    try:
        for name in names:
            tp, options = DEGREES[name]
            llms[name] = llm_at(folder, tp, **options)
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
