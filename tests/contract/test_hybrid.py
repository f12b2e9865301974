"""Hybrid linear-attention models (Qwen3.5: Gated DeltaNet + gated full attention) on the CPU.

Correctness against transformers (a tiny Qwen3.5 built and saved by transformers itself), and
the position-invariance contract for the linear layers' states (docs/design.md, "Linear
attention"): logits, K/V, the final linear state and every chunk-boundary snapshot equal one
cold full prefill bitwise, however the sequence was split: random schedules with batch-mates,
prefix hits of every length 1..3C with uncached tails of 1..40 tokens, every chunk size from 1
to the whole prompt, decode versus teacher-forced scoring, preemption, a second process. The
negative controls run the same checks with the stock formulation (transformers': recurrent for
one-token steps, chunked from each step's first row otherwise) and require them to fail.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.engine.llm import LLM
from lockstep.engine.sampling_params import SamplingParams
from lockstep.errors import ModelLoadError
from lockstep.models.linear_attention import CHUNK
from tests.support.invariance_harness import (
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
HYBRID = "random:tiny-qwen3.5"
VOCAB = 512  # random:tiny-qwen3.5

_SETTINGS = dict(
    deadline=None,
    derandomize=not LONG,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)


def _engine(model: str = HYBRID, mode: str = "deterministic", **options) -> Engine:
    options.setdefault("kv_tokens", 4096)
    return Engine(EngineConfig(model=model, mode=mode, device="cpu", dtype="float32", **options))


# One torch thread for tiny shapes (tests/conftest.py); the second-process test compares
# against the default count.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hybrid() -> Engine:
    return _engine()


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    folder = tmp_path_factory.mktemp("qwen3_5")
    return folder, save_tiny("qwen3_5", folder)


def _llm(engine: Engine) -> LLM:
    llm = LLM.__new__(LLM)  # the module's engine, without loading the model again
    llm.engine, llm.tokenizer, llm._counter = engine, engine.tokenizer, 0
    return llm


# ---------------------------------------------------------------- against transformers


@pytest.mark.parametrize("mode", ["deterministic", "reference"])
def test_matches_transformers_prefill_and_generation(hf_folder, mode: str) -> None:
    """Logits of a 150-token prefill (four chunk boundaries) and greedy token-by-token
    generation (transformers' cache: recurrent decode) agree within 1e-4 in float32."""
    folder, model = hf_folder
    engine = _engine(str(folder), mode=mode)
    rng = random.Random(3)
    tokens = [rng.randrange(300) for _ in range(150)]
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0]
    got = engine.decoder.logits_for_sequence(tokens)
    assert (got - want).abs().max() < 1e-4, float((got - want).abs().max())

    prompt = tokens[:70]
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


def test_multimodal_checkpoint_serves_its_text_model(tmp_path: Path, hf_folder) -> None:
    """A Qwen3_5ForConditionalGeneration folder (model_type qwen3_5, text_config, tensors under
    model.language_model., a vision tower, an MTP head) loads as the text model."""
    from safetensors.torch import load_file, save_file

    folder, _ = hf_folder
    text = json.loads((folder / "config.json").read_text())
    config = {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
        for k, v in load_file(folder / "model.safetensors").items()
    }
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, tmp_path / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    tokens = list(range(1, 40))
    want = _engine(str(folder)).decoder.logits_for_sequence(tokens)
    assert torch.equal(_engine(str(tmp_path)).decoder.logits_for_sequence(tokens), want)


def test_weight_update_from_a_trainer_state_dict(hf_folder) -> None:
    """transformers' state_dict (what a trainer holds) updates a served hybrid in place: other
    weights give other logits, the original ones give the original bits back."""
    folder, model = hf_folder
    engine = _engine(str(folder))
    tokens = list(range(1, 40))
    before = engine.decoder.logits_for_sequence(tokens)
    changed = {k: v * 1.01 if "linear_attn" in k else v for k, v in model.state_dict().items()}
    engine.update_weights(changed)
    assert not torch.equal(engine.decoder.logits_for_sequence(tokens), before)
    engine.update_weights(model.state_dict())
    assert torch.equal(engine.decoder.logits_for_sequence(tokens), before)


def test_unsupported_layer_type_is_refused_in_one_line(tmp_path: Path, hf_folder) -> None:
    folder, _ = hf_folder
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["layer_types"][1] = "sliding_attention"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as err:
        _engine(str(tmp_path))
    message = str(err.value)
    assert "\n" not in message and "layer_types holds 'sliding_attention'" in message


def test_backend_without_linear_attention_is_refused() -> None:
    """The float64 oracle has no gated delta rule: a hybrid model is refused in one line
    naming the block and the missing capability; a backend with it loads (control)."""
    from lockstep.models.decoder import Decoder
    from lockstep.models.resolver import resolve_model
    from lockstep.ops import get_ops

    with pytest.raises(ModelLoadError) as err:
        Decoder.load(resolve_model(HYBRID), get_ops("cpu", "float64"), torch.float32, "cpu")
    message = str(err.value)
    assert "\n" not in message
    assert "float64 backend cannot run" in message and "GatedDeltaNet" in message
    assert "LinearAttentionOps" in message
    ops = get_ops("cpu", "deterministic")
    assert Decoder.load(resolve_model(HYBRID), ops, torch.float32, "cpu").spec.hybrid


# ---------------------------------------------------------------- position invariance


def _check_case(engine: Engine, seed: int, max_len: int, max_mates: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, max_len)
    tokens = [rng.randrange(VOCAB) for _ in range(n)]
    plan = random_plan(rng, n, max_mates)
    plan.donor_step = 48
    got = compute(engine, tokens, plan, rng)
    problems = mismatches(reference(engine, tokens), got)
    assert not problems, f"n={n} {plan.describe()}: " + "; ".join(problems)
    engine.check_integrity()


@settings(max_examples=1000 if LONG else 100, **_SETTINGS)
@given(seed=st.integers(0, 2**32 - 1))
def test_any_schedule_matches_cold_prefill(hybrid: Engine, seed: int) -> None:
    _check_case(hybrid, seed, max_len=3 * CHUNK + 20, max_mates=3)


def test_bfloat16_weights_and_cache_keep_the_contract() -> None:
    engine = Engine(EngineConfig(model=HYBRID, device="cpu", dtype="bfloat16", kv_tokens=4096))
    for seed in range(10):
        _check_case(engine, seed, max_len=2 * CHUNK + 20, max_mates=3)


def test_prefix_hits_of_every_length_with_short_tails(hybrid: Engine) -> None:
    check_prefix_hits_of_every_length(hybrid, VOCAB, CHUNK)


def test_every_chunk_size_from_one_to_the_whole_prompt(hybrid: Engine) -> None:
    check_every_chunk_size(hybrid, VOCAB, CHUNK)


def test_generation_logprobs_equal_scoring(hybrid: Engine) -> None:
    """Decode one token at a time (from the boundary state and the open chunk) versus one
    prefill of the whole text: the same logprob bits, greedy and sampled, across a chunk
    boundary."""
    llm = _llm(hybrid)
    rng = random.Random(2)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, CHUNK - 3, 2 * CHUNK - 1)]
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=12, temperature=temperature, seed=11, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        scores = llm.score([o.prompt_token_ids + o.token_ids for o in outs], use_tqdm=False)
        for out, score in zip(outs, scores, strict=True):
            assert score.logprobs[len(out.prompt_token_ids) :] == out.logprobs, temperature
    hybrid.check_integrity()


def test_prefix_hit_resumes_at_the_last_snapshot_and_is_reported(hybrid: Engine) -> None:
    """cached_tokens counts what was reused: the last kept chunk boundary at or below the
    match. A prompt of 94 tokens and 4 generated keeps the prompt's end (64) and the end of
    its text (96), not 32 (the interval is 512): a prompt that branches off inside the
    generated text resumes at 64, one that continues the whole text (the next turn) at 96.
    Snapshots are counted, go back to their pool with their nodes, and are checked by
    check_integrity."""
    hybrid.flush_cache()
    assert hybrid.stats()["state_snapshots"] == 0
    llm = _llm(hybrid)
    rng = random.Random(8)
    prompt = [rng.randrange(VOCAB) for _ in range(2 * CHUNK + 30)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    stats = hybrid.stats()
    assert stats["state_snapshots"] == 2
    assert stats["state_bytes"] == 2 * hybrid.decoder.linear_layout.snapshot_bytes
    assert stats["state_snapshots_free"] == stats["state_snapshot_slots"] - 2
    branch = [t for t in range(VOCAB) if t != first.token_ids[0]][:3]
    again = llm.generate([prompt + branch], params, use_tqdm=False)[0]
    assert first.cached_tokens == 0 and again.cached_tokens == 2 * CHUNK
    turn = llm.generate([prompt + first.token_ids + [5, 6]], params, use_tqdm=False)[0]
    assert turn.cached_tokens == 3 * CHUNK
    hybrid.check_integrity()
    hybrid.flush_cache()
    stats = hybrid.stats()
    assert stats["state_snapshots"] == stats["state_bytes"] == 0
    assert stats["state_snapshots_free"] == stats["state_snapshot_slots"]
    hybrid.check_integrity()


def test_a_long_decode_holds_one_end_of_text_snapshot_at_a_time(hybrid: Engine) -> None:
    """Decoding past 32, 64 and 96 keeps each boundary until the next replaces it: the
    request never holds more than one, and the cache gets the last (96 of 109 computed)."""
    hybrid.flush_cache()
    hybrid.add_request("long", [7] * 10, SamplingParams(max_tokens=100, ignore_eos=True))
    held = set()
    while hybrid.has_unfinished():
        hybrid.step()
        for request in hybrid.scheduler.running:
            state = request.linear_state
            assert len(state.captured) + len(state.keep) <= 1, (state.position, state.captured)
            held |= set(state.captured)
    assert held == {CHUNK, 2 * CHUNK, 3 * CHUNK}
    assert [s.position for s in hybrid.radix.pooled_snapshots()] == [3 * CHUNK]
    hybrid.check_integrity()
    hybrid.flush_cache()


def test_a_step_captures_only_the_reserved_boundaries(hybrid: Engine) -> None:
    """An engine request's state (`keep` reserved from a snapshot pool, in a working-state
    slot) captures exactly the reserved boundaries, inside the step (64) and at its end (96),
    with the bits of a state that captures every one; the others (32) take no slot."""
    from lockstep.cache.linear_snapshots import LinearSnapshotPool
    from lockstep.models.decoder import ScratchKV
    from lockstep.models.forward_batch import ForwardBatch
    from lockstep.models.linear_attention import LinearState, LinearStatePool
    from lockstep.ops.base import build_attention_meta

    decoder, layout = hybrid.decoder, hybrid.decoder.linear_layout
    tokens = [random.Random(4).randrange(VOCAB) for _ in range(3 * CHUNK)]
    every = reference(hybrid, tokens).snapshots
    assert sorted(every) == [CHUNK, 2 * CHUNK, 3 * CHUNK]
    snapshots = LinearSnapshotPool(layout, 3)
    state = LinearState.resume(layout, None, LinearStatePool(layout, 1), keep_all=False)
    state.keep = {p: snapshots.acquire(p) for p in (2 * CHUNK, 3 * CHUNK)}
    n = len(tokens)
    kv = ScratchKV(decoder.spec, n, decoder.kv_dtype, decoder.device)
    meta = build_attention_meta([n], [0], [list(range(n))])
    batch = ForwardBatch.from_lists(tokens, range(n), range(n), meta, range(n), [state])
    decoder.forward(batch, kv)
    assert sorted(state.captured) == [2 * CHUNK, 3 * CHUNK] and state.keep == {}
    for p, snap in state.captured.items():
        assert snap.pool is snapshots
        assert torch.equal(snap.conv, every[p][0]) and torch.equal(snap.recurrent, every[p][1])
    assert snapshots.num_free == 1
    state.release()
    assert snapshots.num_free == 3


@settings(max_examples=40 if LONG else 10, **_SETTINGS)
@given(seed=st.integers(0, 2**32 - 1))
def test_engine_schedules_with_preemption_match_alone(seed: int) -> None:
    """Whole requests through the real scheduler under random budgets and a KV pool small
    enough to evict and preempt: every request's tokens and logprobs equal those of the same
    request alone on a cold cache."""
    rng = random.Random(seed)
    stem = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 2 * CHUNK))]
    requests = {}
    for i in range(rng.randint(3, 8)):
        prompt = stem[: rng.randint(1, len(stem))]
        prompt += [rng.randrange(VOCAB) for _ in range(rng.randint(0, 30))]
        params = SamplingParams(max_tokens=rng.randint(1, 16), temperature=rng.choice([0.0, 1.0]),
                                seed=i, ignore_eos=True)  # fmt: skip
        requests[f"r{i}"] = (prompt, params)
    largest = max(len(p) + params.max_tokens for p, params in requests.values())
    max_batch_tokens = rng.randint(8, 96)
    engine = _engine(
        kv_tokens=largest + rng.randint(0, 40),
        output_reserve=rng.choice([0.0, 0.5, 1.0]),
        max_batch_tokens=max_batch_tokens,
        chunk_size=rng.randint(1, max_batch_tokens),
        max_running=rng.randint(2, min(8, max_batch_tokens)),
        debug_checks=True,
    )

    differing = differ_alone(engine, requests)
    assert not differing, f"{differing} differ when scheduled together"
    engine.check_integrity()


_RESTART_SCRIPT = """
import json, random, sys, torch
torch.set_num_threads(2)
sys.path.insert(0, sys.argv[1])
from tests.support.invariance_harness import reference
from lockstep.check.compare import PASS, SKIP
from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
e = Engine(EngineConfig(model="random:tiny-qwen3.5", device="cpu", dtype="float32",
                        kv_tokens=512))
rng = random.Random(5)
tokens = [rng.randrange(512) for _ in range(100)]
print(json.dumps(reference(e, tokens).logits.view(torch.int32).flatten().tolist()[::7]))
"""


def test_restart_in_a_second_process(hybrid: Engine) -> None:
    here = os.path.join(os.path.dirname(__file__), "..", "..")  # the repository root
    out = subprocess.run(
        [sys.executable, "-c", _RESTART_SCRIPT, here],
        capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    rng = random.Random(5)
    tokens = [rng.randrange(VOCAB) for _ in range(100)]
    ours = reference(hybrid, tokens).logits.view(torch.int32).flatten().tolist()[::7]
    assert ours == theirs


@pytest.mark.slow
def test_lockstep_check_serve_passes_every_scenario(tmp_path: Path) -> None:
    """`lockstep check --serve --model <tiny Qwen3.5 folder>` passes every scenario."""
    check_serve_passes_every_scenario("qwen3_5", tmp_path)


# ---------------------------------------------------------------- negative controls


def _failures(engine: Engine) -> int:
    failures = 0
    for seed in range(8):
        rng = random.Random(seed)
        n = rng.randint(CHUNK // 2, 2 * CHUNK)
        tokens = [rng.randrange(VOCAB) for _ in range(n)]
        plan = random_plan(rng, n, max_mates=2)
        failures += bool(mismatches(reference(engine, tokens), compute(engine, tokens, plan, rng)))
    return failures


def test_negative_control_stock_gated_delta_rule_breaks_the_contract() -> None:
    """Reference mode fails the property; so does the deterministic backend with only its gated
    delta rule replaced by the stock one: the suite sees the linear layers' arithmetic."""
    assert _failures(_engine(mode="reference")) > 0
    from lockstep.ops.cpu_deterministic import CpuDeterministicOps
    from lockstep.ops.torch_stock import TorchRowOps

    class StockRule(CpuDeterministicOps):
        gated_delta_rule = TorchRowOps.gated_delta_rule

    engine = _engine()
    engine.decoder.ops = StockRule()
    assert _failures(engine) > 0, "the stock delta rule passed: the check is blind"


def test_negative_control_reference_mode_decode_differs_from_scoring() -> None:
    engine = _engine(mode="reference")
    llm = _llm(engine)
    rng = random.Random(2)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, CHUNK - 3, 2 * CHUNK - 1)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    scores = llm.score([o.prompt_token_ids + o.token_ids for o in outs], use_tqdm=False)
    differs = sum(
        score.logprobs[len(out.prompt_token_ids) :] != out.logprobs
        for out, score in zip(outs, scores, strict=True)
    )
    assert differs > 0, "reference mode agreed with scoring everywhere: the comparison is blind"
