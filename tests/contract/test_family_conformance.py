"""What every family must show, one row per tiny folder written by transformers
(tests/support/tiny_hf.py): logits and greedy generation within 1e-4 of transformers in
float32; the position-invariance contract (any schedule of batch-mates, radix hits and chunks
gives a cold prefill's bits, decode gives scoring's); and the negative control, reference mode
failing the same suite. A row with a sliding window also shows the window is what matches:
the same weights served without it miss transformers past the window.

Rows: Mistral without a window (v0.2 and later), Mistral v0.1's window on every layer, and
Ministral's windowed layers around a full one (lockstep/models/families/mistral.py); Phi-3's
fused projections with LongRoPE on part of each head, and with a window
(lockstep/models/families/phi3.py); Gemma 3's windowed layers around a global one
(its own suite, tests/contract/test_gemma3.py, covers what only Gemma 3 has). A new family adds its row here, and its writer to tiny_hf.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.engine.llm import LLM
from lockstep.engine.sampling_params import SamplingParams
from tests.support.invariance_harness import compute, mismatches, random_plan, reference
from tests.support.tiny_hf import check_serve_passes_every_scenario, save_tiny

VOCAB = 300  # tiny_hf's vocabulary
WINDOW = 8  # the windowed rows' sliding_window: shorter than the prompts below


@dataclass(frozen=True)
class Row:
    """A tiny folder: tiny_hf's `family` writer with config `overrides`; `window` the sliding
    window of the folder's first layer (None: full attention) and `unwindowed` the config
    keys that serve the same weights without it (the window control)."""

    name: str
    family: str
    overrides: dict[str, Any] = field(default_factory=dict)
    window: int | None = None
    unwindowed: dict[str, Any] = field(default_factory=lambda: {"sliding_window": None})

    def write(self, family: str, folder: Path, **keys: Any) -> Any:
        return save_tiny(family, folder, **{**self.overrides, **keys})


_PLAIN_ROPE = {"rope_type": "default", "rope_theta": 1e4}
ROWS = (
    Row("mistral", "mistral"),
    Row("mistral-window", "mistral", {"sliding_window": WINDOW}, WINDOW),
    Row("ministral", "ministral", window=WINDOW),
    Row("phi3", "phi3"),  # LongRoPE over half of each head, original context 128
    Row("phi3-window", "phi3", {"sliding_window": WINDOW, "rope_parameters": _PLAIN_ROPE}, WINDOW),
    # Gemma 3 needs a window: a window longer than every prompt serves it unwindowed.
    Row("gemma3", "gemma3", window=WINDOW, unwindowed={"sliding_window": 4096}),
)
WINDOWED = tuple(row for row in ROWS if row.window is not None)

_SETTINGS = dict(
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)

# One torch thread for tiny shapes (tests/conftest.py): bits do not depend on the count.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _engine(model: Path, mode: str = "deterministic") -> Engine:
    config = EngineConfig(model=str(model), mode=mode, device="cpu", kv_tokens=2048,
                          dtype="float32")  # fmt: skip
    return Engine(config)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory):
    """Each row's folder and transformers model, written once per module."""
    cache: dict[str, tuple[Path, Any]] = {}

    def write(row: Row) -> tuple[Path, Any]:
        if row.name not in cache:
            folder = tmp_path_factory.mktemp(row.name)
            cache[row.name] = folder, row.write(row.family, folder)
        return cache[row.name]

    return write


@pytest.fixture(scope="module", params=ROWS, ids=lambda row: row.name)
def served(request, written) -> tuple[Row, Any, Engine]:
    """A row, its transformers model and a deterministic CPU engine on its folder."""
    folder, model = written(request.param)
    return request.param, model, _engine(folder)


def _llm(engine: Engine) -> LLM:
    llm = LLM.__new__(LLM)  # the module's engine, without loading the model again
    llm.engine, llm.tokenizer, llm._counter = engine, engine.tokenizer, 0
    return llm


def _schedule_mismatches(engine: Engine, rng: random.Random, n: int, max_mates: int) -> str:
    """A random prompt of `n` tokens computed under a random plan (batch-mates, a radix hit,
    chunks): its mismatches with one cold full prefill, "" when every bit agrees."""
    tokens = [rng.randrange(VOCAB) for _ in range(n)]
    plan = random_plan(rng, n, max_mates=max_mates)
    problems = mismatches(reference(engine, tokens), compute(engine, tokens, plan, rng))
    return f"n={n} {plan.describe()}: " + "; ".join(problems) if problems else ""


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


@pytest.mark.parametrize("mode", ["deterministic", "reference"])
def test_matches_transformers_prefill_and_generation(served, written, mode: str) -> None:
    """Logits of a 40-token prefill (five windows) and greedy token-by-token generation from
    a 25-token prompt agree with transformers within 1e-4 in float32, in both modes."""
    row, model, engine = served
    if mode == "reference":
        engine = _engine(written(row)[0], mode="reference")
    assert engine.decoder.spec.window(0) == row.window
    tokens = _tokens(3, 40)
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0]
    got = engine.decoder.logits_for_sequence(tokens)
    assert (got - want).abs().max() < 1e-4, float((got - want).abs().max())

    prompt = tokens[:25]
    with torch.no_grad():
        gen = model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, output_logits=True,
            return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
    want_ids = gen.sequences[0, len(prompt) :].tolist()
    want_lps = [torch.log_softmax(step[0], -1) for step in gen.logits]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    out = _llm(engine).generate([prompt], params, use_tqdm=False)[0]
    assert out.token_ids == want_ids
    for lp, token, step in zip(out.logprobs, want_ids, want_lps, strict=True):
        assert abs(lp - float(step[token])) < 1e-4


@pytest.mark.parametrize("row", WINDOWED, ids=lambda row: row.name)
def test_negative_control_without_the_window_the_logits_miss(
    row: Row, written, tmp_path: Path
) -> None:
    """The same weights served without the window (`Row.unwindowed`: every layer sees every
    key) agree with transformers inside the window and miss it past the window: the match
    above is the window's."""
    folder, model = written(row)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    config = {**json.loads((folder / "config.json").read_text()), **row.unwindowed}
    (tmp_path / "config.json").write_text(json.dumps(config))
    full = _engine(tmp_path)
    assert full.decoder.spec.window(0) != row.window
    tokens = _tokens(4, 30)
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0]
    got = full.decoder.logits_for_sequence(tokens)
    assert (got[:WINDOW] - want[:WINDOW]).abs().max() < 1e-4
    assert (got - want).abs().max() > 1e-3


@settings(max_examples=25, **_SETTINGS)
@given(seed=st.integers(0, 2**32 - 1))
def test_any_schedule_matches_cold_prefill(served, seed: int) -> None:
    """Random batch-mates, radix hits and chunks (lengths up to five windows): every
    position's logits and K/V equal one cold full prefill's bitwise."""
    engine = served[2]
    rng = random.Random(seed)
    problems = _schedule_mismatches(engine, rng, rng.randint(1, 40), max_mates=3)
    assert not problems, problems
    engine.check_integrity()


def test_generation_logprobs_equal_scoring(served) -> None:
    """Decode one token at a time versus one prefill of the whole text, greedy and sampled,
    from prompts shorter than, equal to and longer than the window."""
    engine = served[2]
    llm = _llm(engine)
    prompts = [_tokens(n, n) for n in (3, WINDOW, 3 * WINDOW + 1)]
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=12, temperature=temperature, seed=11, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        scores = llm.score([o.prompt_token_ids + o.token_ids for o in outs], use_tqdm=False)
        for out, score in zip(outs, scores, strict=True):
            assert score.logprobs[len(out.prompt_token_ids) :] == out.logprobs, temperature
    engine.check_integrity()


def test_negative_control_reference_mode_breaks_the_contract(served, written) -> None:
    """The same harness on reference mode (oneDNN GEMMs, SDPA) finds differences: it is not blind."""
    row = served[0]
    engine = _engine(written(row)[0], mode="reference")
    failures = 0
    for seed in range(8):
        rng = random.Random(seed)
        failures += bool(_schedule_mismatches(engine, rng, rng.randint(2 * WINDOW, 40), 2))
    assert failures > 0


def test_longrope_rotates_each_position_by_its_range(written) -> None:
    """Phi-3's LongRoPE tables (lockstep/models/rope.py): positions below the original context
    (128) rotate by transformers' short-factor frequencies, positions at or past it by the
    long ones (transformers' set for a sequence past the original context), both scaled by
    its attention factor; control: the two sets give other tables."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from lockstep.models.rope import rope_tables

    folder, model = written(ROWS[3])
    spec = _engine(folder).decoder.spec
    assert spec.longrope is not None and spec.longrope.original_max_position == 128
    cos, sin = rope_tables(spec, 256)
    positions = torch.arange(256, dtype=torch.float64)[:, None]
    want = {}
    for part, seq_len in (("short", None), ("long", 200)):
        inv_freq, factor = ROPE_INIT_FUNCTIONS["longrope"](model.config, "cpu", seq_len=seq_len)
        want[part] = (positions * inv_freq.double()).cos() * factor
    assert (cos[:128] - want["short"][:128]).abs().max() < 1e-5
    assert (cos[128:] - want["long"][128:]).abs().max() < 1e-5
    assert (want["short"][128:] - want["long"][128:]).abs().max() > 0.1
    assert sin.shape == cos.shape == (256, spec.rotary_dim // 2)


def test_longrope_past_the_original_context_keeps_the_contract(written) -> None:
    """Prompts of 130 to 170 tokens, across the original context of 128 where the frequencies
    change: any schedule gives the cold prefill's bits."""
    engine = _engine(written(ROWS[3])[0])
    for seed in range(6):
        rng = random.Random(seed)
        problems = _schedule_mismatches(engine, rng, rng.randint(130, 170), max_mates=2)
        assert not problems, problems


@pytest.mark.slow
@pytest.mark.parametrize("row", [ROWS[1], ROWS[3], ROWS[5]], ids=lambda row: row.name)
def test_lockstep_check_serve_passes_every_scenario(row: Row, tmp_path: Path) -> None:
    """`lockstep check --serve` on a windowed Mistral folder, a Phi-3 folder and a Gemma 3
    folder passes every scenario."""
    check_serve_passes_every_scenario(row.family, tmp_path, row.write)
