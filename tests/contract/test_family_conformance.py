"""What every family must show, one row per tiny folder written by transformers
(tests/support/tiny_hf.py):

* logits and greedy generation within 1e-4 of transformers in float32, in both modes;
* the position-invariance contract on the same folder: random schedules (batch-mates, radix
  hits, chunks) give a cold prefill's logits, K/V and linear-attention states bitwise;
  decode gives teacher-forced scoring's logprobs; and on one row per kind of layer (full,
  windowed and latent attention, Gated DeltaNet with dense and routed MLPs): radix hits of
  every length across the row's structural span (the CPU kernels' 32-key block, the
  linear-attention chunk) and every chunk size, bfloat16 weights and cache, and whole
  requests through the scheduler, preempted and evicted, giving the tokens and logprobs of
  each request alone;
* a windowed row also: hits whose uncached tail straddles the window's edge, every chunk size
  around the window, and the control that the same weights served without the window miss
  transformers past it;
* transformers' state_dict (what a trainer holds) updates the served model in place;
* the negative controls: reference mode (stock PyTorch) breaks the schedules and makes decode
  differ from scoring, so neither comparison is blind;
* `lockstep check --serve` passing every scenario (slow; one row per kind of layer).

Rows: Mistral without a window, Mistral v0.1's window on every layer, Ministral's windowed
layers around a full one; Phi-3's fused projections with LongRoPE, and with a window; Gemma 3's
windowed layers around a global one; DeepSeek-V3, DeepSeek-V2 and GLM-4.7-Flash (latent
attention, DeepSeek routing); Qwen3.5 (Gated DeltaNet), Qwen3.5-MoE and Qwen3-Next (hybrid
MoE). What only one family has is in its own file (test_gemma3.py, test_phi3.py,
test_deepseek.py, test_hybrid.py, test_hybrid_moe.py). A new family adds its row here, and
its writer to tiny_hf. LOCKSTEP_LONG_TESTS=1 runs ten times the random schedules and four
times the preemption runs.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.engine.llm import LLM
from lockstep.engine.sampling_params import SamplingParams
from lockstep.models.linear_attention import CHUNK
from tests.support.invariance_harness import (
    Plan,
    check_every_chunk_size,
    check_prefix_hits_of_every_length,
    compute,
    differ_alone,
    mismatches,
    random_plan,
    reference,
)
from tests.support.tiny_hf import check_serve_passes_every_scenario, save_tiny

LONG = os.environ.get("LOCKSTEP_LONG_TESTS") == "1"
VOCAB = 300  # tiny_hf's vocabulary
WINDOW = 8  # the windowed rows' sliding_window: shorter than the prompts below
BLOCK = 16  # radix hits of every length 1..3 x 16: across the CPU kernels' 32-key block


@dataclass(frozen=True)
class Row:
    """A tiny folder and the lengths its checks use.

    `family`, `overrides`: tiny_hf's writer and config keys. `window`: the sliding window of
    the folder's first layer (None: full attention); `unwindowed`: the config keys that serve
    the same weights without it (the window control). `prefill`, `prompt`, `new_tokens`: the
    transformers comparison's prefill, and its greedy generation. `max_len`, `schedules`,
    `donor_step`: the random schedules (a hybrid's donor runs in steps of up to 48 tokens, so
    that it passes chunk boundaries). `span`: radix hits of every length 1..3 span and every
    chunk size up to span + 37 (None: not run; a windowed row checks its window's edges). `scoring`: prompt lengths of decode versus scoring. `stem`, `preemptions`: whole
    requests through the scheduler (0: not run). `lengths`: the negative control's sequence
    lengths (the bfloat16 run's from the first to `max_len`, `bf16_cases` of them; 0: not
    run). The scheduler and bfloat16 runs are on one row per kind of layer (full, windowed,
    latent attention, Gated DeltaNet with dense and routed MLPs) to keep the suite's time. `trained`: names of the state_dict parts a weight update
    changes. `serve`: run `lockstep check --serve` on this row."""

    name: str
    family: str
    overrides: dict[str, Any] = field(default_factory=dict)
    window: int | None = None
    unwindowed: dict[str, Any] = field(default_factory=lambda: {"sliding_window": None})
    prefill: int = 40
    prompt: int = 25
    new_tokens: int = 12
    max_len: int = 40
    schedules: int = 25
    donor_step: int = 8
    span: int | None = None
    scoring: tuple[int, ...] = (3, WINDOW, 3 * WINDOW + 1)
    stem: int = 30
    preemptions: int = 0
    lengths: tuple[int, int] = (2 * WINDOW, 40)
    bf16_cases: int = 0
    trained: tuple[str, ...] = ("self_attn",)
    serve: bool = False

    def write(self, family: str, folder: Path, **keys: Any) -> Any:
        return save_tiny(family, folder, **{**self.overrides, **keys})


_PLAIN_ROPE = {"rope_type": "default", "rope_theta": 1e4}
_WINDOWED = dict(window=WINDOW)
_DEEPSEEK = dict(prefill=100, prompt=40, new_tokens=8, max_len=70, scoring=(3, 31, 45),
                 lengths=(20, 60), trained=("e_score_correction_bias", "kv_b_proj"))  # fmt: skip
# Two Gated DeltaNet layers, then gated full attention (Qwen3-Next's middle layer dense).
_THREE_LAYERS = {
    "num_hidden_layers": 3,
    "layer_types": ["linear_attention", "linear_attention", "full_attention"],
}
_HYBRID = dict(prefill=150, prompt=70, max_len=3 * CHUNK + 20, donor_step=48, span=CHUNK,
               scoring=(5, CHUNK - 3, 2 * CHUNK - 1), stem=2 * CHUNK,
               lengths=(CHUNK // 2, 2 * CHUNK))  # fmt: skip
# fmt: off
ROWS = (
    Row("mistral", "mistral"),
    Row("mistral-window", "mistral", {"sliding_window": WINDOW}, **_WINDOWED, serve=True),
    Row("ministral", "ministral", **_WINDOWED),
    Row("phi3", "phi3", trained=("qkv_proj", "gate_up_proj"), serve=True),  # LongRoPE
    Row("phi3-window", "phi3", {"sliding_window": WINDOW, "rope_parameters": _PLAIN_ROPE},
        **_WINDOWED),
    # Gemma 3 needs a window: a window longer than every prompt serves it unwindowed.
    Row("gemma3", "gemma3", unwindowed={"sliding_window": 4096}, preemptions=5, bf16_cases=6,
        serve=True, **_WINDOWED),
    Row("deepseek_v3", "deepseek_v3", **_DEEPSEEK, span=BLOCK, preemptions=3, serve=True),
    Row("deepseek_v2", "deepseek_v2", **{**_DEEPSEEK, "trained": ("kv_b_proj",)},  # no bias
        schedules=6),
    Row("glm4_moe_lite", "glm4_moe_lite", **_DEEPSEEK, schedules=6, bf16_cases=6),
    Row("qwen3_5", "qwen3_5", _THREE_LAYERS, **_HYBRID, schedules=100, preemptions=10, bf16_cases=10,
        trained=("linear_attn",), serve=True),
    Row("qwen3_5_moe", "qwen3_5_moe", _THREE_LAYERS, **_HYBRID, preemptions=3, trained=("shared_expert",)),
    Row("qwen3_next", "qwen3_next", _THREE_LAYERS, **_HYBRID, preemptions=2, trained=("shared_expert",),
        serve=True),
)
# fmt: on
WINDOWED = tuple(row for row in ROWS if row.window is not None)
SPANNED = tuple(row for row in ROWS if row.span is not None)
SERVED = tuple(row for row in ROWS if row.serve)
PREEMPTED = tuple(row for row in ROWS if row.preemptions)
BF16 = tuple(row for row in ROWS if row.bf16_cases)


def _ids(row: Row) -> str:
    return row.name


# One torch thread for tiny shapes (tests/conftest.py): bits do not depend on the count.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _engine(model: Path, mode: str = "deterministic", **options: Any) -> Engine:
    options = {"kv_tokens": 4096, "dtype": "float32", **options}
    return Engine(EngineConfig(model=str(model), mode=mode, device="cpu", **options))


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


@pytest.fixture(scope="module", params=ROWS, ids=_ids)
def served(request, written) -> tuple[Row, Any, Engine]:
    """A row, its transformers model and a deterministic CPU engine on its folder."""
    folder, model = written(request.param)
    return request.param, model, _engine(folder)


def _llm(engine: Engine) -> LLM:
    llm = LLM.__new__(LLM)  # the module's engine, without loading the model again
    llm.engine, llm.tokenizer, llm._counter = engine, engine.tokenizer, 0
    return llm


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def _schedule_mismatches(
    engine: Engine, seed: int, lengths: tuple[int, int], donor_step: int, max_mates: int
) -> str:
    """Seed `seed`'s random prompt (of `lengths` tokens) computed under a random plan
    (batch-mates, a radix hit, chunks): its mismatches with one cold full prefill, "" when
    every bit agrees."""
    rng = random.Random(seed)
    n = rng.randint(*lengths)
    tokens = [rng.randrange(VOCAB) for _ in range(n)]
    plan = random_plan(rng, n, max_mates=max_mates)
    plan.donor_step = donor_step
    problems = mismatches(reference(engine, tokens), compute(engine, tokens, plan, rng))
    return f"seed={seed} n={n} {plan.describe()}: " + "; ".join(problems) if problems else ""


def _scoring_mismatches(engine: Engine, row: Row, temperature: float) -> list[int]:
    """Generate from the row's prompts side by side, then score each prompt + its tokens in
    one prefill: the prompts whose generated logprobs differ from the scored ones."""
    llm = _llm(engine)
    prompts = [_tokens(n, n) for n in row.scoring]
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=11, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    scores = llm.score([o.prompt_token_ids + o.token_ids for o in outs], use_tqdm=False)
    return [
        i
        for i, (out, score) in enumerate(zip(outs, scores, strict=True))
        if score.logprobs[len(out.prompt_token_ids) :] != out.logprobs
    ]


# ---------------------------------------------------------------- against transformers


@pytest.mark.parametrize("mode", ["deterministic", "reference"])
def test_matches_transformers_prefill_and_generation(served, written, mode: str) -> None:
    """Logits of a prefill past the row's structure (five windows, four chunk boundaries,
    YaRN's original context) and greedy token-by-token generation (transformers' own cache)
    agree with transformers within 1e-4 in float32, in both modes: reference mode computes
    the same model, so its failures below are about scheduling."""
    row, model, engine = served
    if mode == "reference":
        engine = _engine(written(row)[0], mode="reference")
    assert engine.decoder.spec.window(0) == row.window
    tokens = _tokens(3, row.prefill)
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0]
    got = engine.decoder.logits_for_sequence(tokens)
    assert (got - want).abs().max() < 1e-4, float((got - want).abs().max())

    prompt = tokens[: row.prompt]
    with torch.no_grad():
        gen = model.generate(
            torch.tensor([prompt]), max_new_tokens=row.new_tokens, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
    want_ids = gen.sequences[0, len(prompt) :].tolist()
    want_lps = [torch.log_softmax(step[0], -1) for step in gen.logits]
    params = SamplingParams(max_tokens=row.new_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=0)  # fmt: skip
    out = _llm(engine).generate([prompt], params, use_tqdm=False)[0]
    assert out.token_ids == want_ids
    for lp, token, step in zip(out.logprobs, want_ids, want_lps, strict=True):
        assert abs(lp - float(step[token])) < 1e-4


@pytest.mark.parametrize("row", WINDOWED, ids=_ids)
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


def test_weight_update_from_a_trainer_state_dict(served) -> None:
    """transformers' state_dict (fused experts and projections as transformers holds them)
    updates the served model in place: each changed part (`Row.trained`) gives other logits,
    the original weights give the original bits back."""
    row, model, engine = served
    tokens = list(range(1, 40))
    before = engine.decoder.logits_for_sequence(tokens)
    state = model.state_dict()
    for part in row.trained:
        assert any(part in k for k in state), part
        engine.update_weights({k: v.flip(-1) if part in k else v for k, v in state.items()})
        assert not torch.equal(engine.decoder.logits_for_sequence(tokens), before), part
    engine.update_weights(state)
    assert torch.equal(engine.decoder.logits_for_sequence(tokens), before)


# ---------------------------------------------------------------- position invariance


def test_any_schedule_matches_cold_prefill(served) -> None:
    """Random batch-mates, radix hits and chunks (`Row.schedules` seeds of 1..`Row.max_len`
    tokens): every position's logits, K/V and linear-attention state equal one cold full
    prefill's bitwise."""
    row, _, engine = served
    for seed in range(row.schedules * (10 if LONG else 1)):
        problems = _schedule_mismatches(engine, seed, (1, row.max_len), row.donor_step, 3)
        assert not problems, problems
        engine.check_integrity()


@pytest.mark.parametrize("row", BF16, ids=_ids)
def test_bfloat16_weights_and_cache_keep_the_contract(row: Row, written) -> None:
    engine = _engine(written(row)[0], dtype="bfloat16")
    for seed in range(row.bf16_cases):
        lengths = (row.lengths[0], row.max_len)
        problems = _schedule_mismatches(engine, seed, lengths, row.donor_step, 2)
        assert not problems, problems


@pytest.mark.parametrize("row", SPANNED, ids=_ids)
def test_prefix_hits_of_every_length_and_every_chunk_size(row: Row, written) -> None:
    """Hits of every length 1..3 x span with tails of 1..40 beside a mate, and a prompt of
    span + 37 tokens in chunks of every size: all equal a cold prefill."""
    assert row.span is not None
    engine = _engine(written(row)[0])
    check_prefix_hits_of_every_length(engine, VOCAB, row.span)
    check_every_chunk_size(engine, VOCAB, row.span)


def _check_plan(engine: Engine, tokens: list[int], plan: Plan, rng: random.Random) -> None:
    problems = mismatches(reference(engine, tokens), compute(engine, tokens, plan, rng))
    assert not problems, f"n={len(tokens)} {plan.describe()}: " + "; ".join(problems)


@pytest.mark.parametrize("row", WINDOWED, ids=_ids)
def test_radix_hits_whose_tail_straddles_the_window_edge(row: Row, written) -> None:
    """A hit of every length 1..36 (across the CPU kernel's 32-key block too), each followed
    by an uncached tail of 1..2W+1 tokens in one pass beside a mate: the tail's first rows
    see cached keys at the window's lower edge, its later rows (tails longer than W) none."""
    engine = _engine(written(row)[0])
    rng = random.Random(11)
    stem = [rng.randrange(VOCAB) for _ in range(36)]
    for prefix in range(1, 37):
        tail = 1 + (prefix * 5) % (2 * WINDOW + 1)
        tokens = stem[:prefix] + [rng.randrange(VOCAB) for _ in range(tail)]
        _check_plan(engine, tokens, Plan(prefix, [tail], [[rng.randint(1, 9)]]), rng)
        engine.flush_cache()
    engine.check_integrity()


@pytest.mark.parametrize("row", WINDOWED, ids=_ids)
def test_chunk_sizes_around_the_window(row: Row, written) -> None:
    engine = _engine(written(row)[0])
    rng = random.Random(5)
    n = 41
    tokens = [rng.randrange(VOCAB) for _ in range(n)]
    ref = reference(engine, tokens)
    for size in (*range(1, 2 * WINDOW + 3), 31, 32, 33, n):
        chunks = [size] * (n // size) + ([n % size] if n % size else [])
        problems = mismatches(ref, compute(engine, tokens, Plan(0, chunks), rng))
        assert not problems, f"chunk size {size}: " + "; ".join(problems)
    engine.check_integrity()


def test_generation_logprobs_equal_scoring(served) -> None:
    """Decode one token at a time versus one prefill of the whole text, greedy and sampled,
    from prompts on both sides of the row's window or chunk boundary."""
    engine = served[2]
    for temperature in (0.0, 1.0):
        assert _scoring_mismatches(engine, served[0], temperature) == [], temperature
    engine.check_integrity()


@pytest.mark.parametrize("row", PREEMPTED, ids=_ids)
def test_engine_schedules_with_preemption_match_alone(row: Row, written) -> None:
    """Whole requests through the real scheduler under random budgets and a KV pool small
    enough to evict and preempt: every request's tokens and logprobs equal those of the same
    request alone on a cold cache."""
    for seed in range(row.preemptions * (4 if LONG else 1)):
        rng = random.Random(seed)
        stem = [rng.randrange(VOCAB) for _ in range(rng.randint(1, row.stem))]
        requests = {}
        for i in range(rng.randint(3, 6)):
            prompt = stem[: rng.randint(1, len(stem))]
            prompt += [rng.randrange(VOCAB) for _ in range(rng.randint(0, 30))]
            params = SamplingParams(max_tokens=rng.randint(1, 16), seed=i, ignore_eos=True,
                                    temperature=rng.choice([0.0, 1.0]))  # fmt: skip
            requests[f"r{i}"] = (prompt, params)
        largest = max(len(p) + params.max_tokens for p, params in requests.values())
        batch_tokens = rng.randint(8, 96)
        engine = _engine(
            written(row)[0], kv_tokens=largest + rng.randint(0, 40),
            output_reserve=rng.choice([0.0, 0.5, 1.0]), max_batch_tokens=batch_tokens,
            chunk_size=rng.randint(1, batch_tokens), max_running=rng.randint(2, 6),
            debug_checks=True,
        )  # fmt: skip
        differing = differ_alone(engine, requests)
        assert not differing, f"seed {seed}: {differing} differ when scheduled together"
        engine.check_integrity()


# ---------------------------------------------------------------- negative controls


def test_negative_control_reference_mode_breaks_the_contract(served, written) -> None:
    """The same harnesses in reference mode (oneDNN GEMMs, SDPA, stock routing and delta
    rule) find differences: some schedule differs from the cold prefill, and decode differs
    from scoring somewhere. Neither comparison is blind."""
    row = served[0]
    engine = _engine(written(row)[0], mode="reference")
    # Up to 8 schedules, until one differs.
    assert any(
        _schedule_mismatches(engine, seed, row.lengths, row.donor_step, 2) for seed in range(8)
    ), "reference mode passed every schedule: the check is blind"
    assert _scoring_mismatches(engine, row, 0.0), "reference mode agreed with scoring everywhere"


@pytest.mark.slow
@pytest.mark.parametrize("row", SERVED, ids=_ids)
def test_lockstep_check_serve_passes_every_scenario(row: Row, tmp_path: Path) -> None:
    """`lockstep check --serve` on the row's folder passes every scenario."""
    check_serve_passes_every_scenario(row.family, tmp_path, row.write)
