"""The contract with logits processing: requests with penalties, logit_bias, min_tokens,
bad_words and structured outputs, mixed with plain requests in random batches under random
scheduler budgets, each get the tokens and logprobs they get alone. The negative control runs
the same check in reference mode and requires a difference."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.engine.sampling_params import SamplingParams
from lockstep.engine.structured_output import StructuredOutput
from tests.support.invariance_harness import differ_alone

VOCAB = 512  # random:tiny
SPECS = [
    StructuredOutput.json_schema(
        {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["n"],
            "additionalProperties": False,
        }
    ),
    StructuredOutput.regex(r"[a-c]{2,6}(-[0-9]{1,3})?"),
    StructuredOutput.choice(["alpha", "beta", "gamma"]),
    StructuredOutput.grammar('root ::= "(" [xy]* ")"'),
]


def _params(rng: random.Random, i: int) -> SamplingParams:
    kw: dict = {
        "max_tokens": rng.randint(1, 16),
        "temperature": rng.choice([0.0, 1.0, 0.7]),
        "seed": i,
        "logprobs": rng.choice([None, 0]),
    }
    kind = rng.choice(["plain", "penalties", "bias", "grammar", "all"])
    if kind in ("penalties", "all"):
        kw |= {
            "presence_penalty": rng.uniform(-2, 2),
            "frequency_penalty": rng.uniform(-2, 2),
            "repetition_penalty": rng.uniform(0.5, 2),
        }
    if kind in ("bias", "all"):
        kw |= {
            "logit_bias": {rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(3)},
            "min_tokens": rng.randint(0, kw["max_tokens"]),
            "bad_words": ("ab", "Q"),
        }
    if kind in ("grammar", "all"):
        kw["structured_output"] = rng.choice(SPECS)
    if kind != "grammar" and "structured_output" not in kw:
        kw["ignore_eos"] = rng.random() < 0.5
    return SamplingParams(**kw)


def _mismatches(seed: int, mode: str) -> list[str]:
    rng = random.Random(seed)
    stem = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
    requests = {}
    for i in range(rng.randint(4, 10)):
        prompt = stem[: rng.randint(1, len(stem))] + [rng.randrange(VOCAB) for _ in range(8)]
        requests[f"r{i}"] = (prompt, _params(rng, i))
    budget = rng.randint(8, 96)
    engine = Engine(
        EngineConfig(
            model="random:tiny", mode=mode, device="cpu", dtype="float32", kv_tokens=2048,
            max_batch_tokens=budget, chunk_size=rng.randint(1, budget),
            max_running=rng.randint(2, min(10, budget)),
        )
    )  # fmt: skip

    return [f"{rid} {requests[rid][1]}" for rid in differ_alone(engine, requests)]


@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(seed=st.integers(0, 2**32 - 1))
def test_processed_requests_in_random_batches_match_alone(seed: int) -> None:
    problems = _mismatches(seed, "deterministic")
    assert not problems, "differ when batched: " + "; ".join(problems)


def test_negative_control_reference_mode_differs() -> None:
    """The same check in reference mode (plain torch float32, whose rows change with the batch)
    finds a request whose tokens or logprobs differ: the comparison is not blind."""
    assert any(_mismatches(seed, "reference") for seed in range(4))
