"""Gemma 3 on the CPU: sliding-window layers interleaved with a global one, GeGLU, four norms per
layer, scaled embeddings, per-layer-type RoPE (lockstep/models/families/gemma3.py).

What every family shows (transformers within 1e-4 in both modes, the window control, random
schedules, decode versus scoring, reference mode failing, `lockstep check --serve`) is Gemma 3's
row of tests/contract/test_family_conformance.py. Here, what only Gemma 3 has, on a tiny
Gemma3ForCausalLM saved by transformers (its window of 8 keys shorter than every prompt):
the multimodal layouts, logit soft-capping, its refusals, and the contract where the window
meets the cache: radix hits whose uncached tail straddles the window's edge, every chunk size
around the window, whole requests through the scheduler with preemption, bf16.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.engine.sampling_params import SamplingParams
from lockstep.errors import ModelLoadError
from tests.support.invariance_harness import (
    Plan,
    compute,
    differ_alone,
    mismatches,
    random_plan,
    reference,
)
from tests.support.tiny_hf import save_tiny

WINDOW = 8  # tiny_hf's Gemma 3 window
VOCAB = 300  # tiny_hf's vocabulary
_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

_SETTINGS = dict(
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)


def _engine(model: str, mode: str = "deterministic", **options) -> Engine:
    options = {"kv_tokens": 2048, "dtype": "float32", **options}
    return Engine(EngineConfig(model=model, mode=mode, device="cpu", **options))


# One torch thread for tiny shapes (tests/conftest.py): bits do not depend on the count.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    folder = tmp_path_factory.mktemp("gemma3")
    return folder, save_tiny("gemma3", folder)


@pytest.fixture(scope="module")
def gemma(hf_folder) -> Engine:
    return _engine(str(hf_folder[0]))


def _copy(folder: Path, to: Path, **config: object) -> Path:
    """`folder`'s files in `to`, with `config` keys replaced in its config.json."""
    for name in _FILES:
        (to / name).write_bytes((folder / name).read_bytes())
    changed = {**json.loads((folder / "config.json").read_text()), **config}
    (to / "config.json").write_text(json.dumps(changed))
    return to


# ---------------------------------------------------------------- Gemma 3's own layouts


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_multimodal_checkpoint_serves_its_text_model(
    tmp_path: Path, hf_folder, gemma: Engine, prefix: str
) -> None:
    """A Gemma3ForConditionalGeneration folder (model_type gemma3, text_config, the text
    tensors under transformers 5's or earlier writers' prefix, a vision tower and projector)
    loads as the text model and gives its bits."""
    from safetensors.torch import load_file, save_file

    folder, _ = hf_folder
    text = json.loads((folder / "config.json").read_text())
    config = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
              "text_config": text, "vision_config": {"model_type": "siglip_vision_model"}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {prefix + k.removeprefix("model."): v
               for k, v in load_file(folder / "model.safetensors").items()}  # fmt: skip
    vision = "model." if prefix.startswith("model.") else ""
    tensors[vision + "vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(4)
    tensors[vision + "multi_modal_projector.mm_input_projection_weight"] = torch.zeros(4, 4)
    save_file(tensors, tmp_path / "model.safetensors")
    for name in _FILES[2:]:
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    tokens = list(range(1, 30))
    want = gemma.decoder.logits_for_sequence(tokens)
    assert torch.equal(_engine(str(tmp_path)).decoder.logits_for_sequence(tokens), want)


def test_final_logit_softcapping_matches_transformers(tmp_path: Path, gemma: Engine) -> None:
    """final_logit_softcapping (set by no released Gemma 3, served all the same): a cap of 3
    matches transformers within 1e-4; control: the same weights uncapped give other logits."""
    model = save_tiny("gemma3", tmp_path, final_logit_softcapping=3.0)
    tokens = list(range(1, 30))
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0]
    got = _engine(str(tmp_path)).decoder.logits_for_sequence(tokens)
    assert (got - want).abs().max() < 1e-4, float((got - want).abs().max())
    assert (got - gemma.decoder.logits_for_sequence(tokens)).abs().max() > 0.1


@pytest.mark.parametrize(
    ("key", "value"),
    [("attn_logit_softcapping", 50.0), ("hidden_activation", "silu"),
     ("use_bidirectional_attention", True)],
)  # fmt: skip
def test_what_gemma_3_does_not_need_is_refused_in_one_line(
    hf_folder, tmp_path: Path, key: str, value: object
) -> None:
    folder, _ = hf_folder
    with pytest.raises(ModelLoadError) as err:
        _engine(str(_copy(folder, tmp_path, **{key: value})))
    message = str(err.value)
    assert "\n" not in message and f"{key}={value!r} is not supported" in message


# ---------------------------------------------------------------- position invariance


def _check(engine: Engine, tokens: list[int], plan: Plan, rng: random.Random) -> None:
    problems = mismatches(reference(engine, tokens), compute(engine, tokens, plan, rng))
    assert not problems, f"n={len(tokens)} {plan.describe()}: " + "; ".join(problems)


def test_radix_hits_whose_tail_straddles_the_window_edge(gemma: Engine) -> None:
    """A hit of every length 1..36 (across the CPU kernel's 32-key block too), each followed
    by an uncached tail of 1..2W+1 tokens in one pass beside a mate: the tail's first rows
    see cached keys at the window's lower edge, its later rows (tails longer than W) none."""
    rng = random.Random(11)
    stem = [rng.randrange(VOCAB) for _ in range(36)]
    for prefix in range(1, 37):
        tail = 1 + (prefix * 5) % (2 * WINDOW + 1)
        tokens = stem[:prefix] + [rng.randrange(VOCAB) for _ in range(tail)]
        _check(gemma, tokens, Plan(prefix, [tail], [[rng.randint(1, 9)]]), rng)
        gemma.flush_cache()
    gemma.check_integrity()


def test_chunk_sizes_around_the_window(gemma: Engine) -> None:
    rng = random.Random(5)
    n = 41
    tokens = [rng.randrange(VOCAB) for _ in range(n)]
    ref = reference(gemma, tokens)
    for size in (*range(1, 2 * WINDOW + 3), 31, 32, 33, n):
        chunks = [size] * (n // size) + ([n % size] if n % size else [])
        problems = mismatches(ref, compute(gemma, tokens, Plan(0, chunks), rng))
        assert not problems, f"chunk size {size}: " + "; ".join(problems)
    gemma.check_integrity()


@settings(max_examples=5, **_SETTINGS)
@given(seed=st.integers(0, 2**32 - 1))
def test_engine_schedules_with_preemption_match_alone(hf_folder, seed: int) -> None:
    """Whole requests through the real scheduler, with a KV pool small enough to evict and
    preempt: each request's tokens and logprobs equal those of the request alone."""
    rng = random.Random(seed)
    stem = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
    requests = {}
    for i in range(rng.randint(3, 6)):
        prompt = stem[: rng.randint(1, len(stem))] + [rng.randrange(VOCAB) for _ in range(9)]
        params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 1.0]),
                                seed=i, ignore_eos=True)  # fmt: skip
        requests[f"r{i}"] = (prompt, params)
    largest = max(len(p) + params.max_tokens for p, params in requests.values())
    batch_tokens = rng.randint(8, 64)
    engine = _engine(
        str(hf_folder[0]), kv_tokens=largest + rng.randint(0, 30),
        output_reserve=rng.choice([0.0, 0.5, 1.0]), max_batch_tokens=batch_tokens,
        chunk_size=rng.randint(1, batch_tokens), max_running=rng.randint(2, 6), debug_checks=True,
    )  # fmt: skip
    assert not differ_alone(engine, requests)
    engine.check_integrity()


def test_bfloat16_weights_and_cache_keep_the_contract(hf_folder) -> None:
    engine = _engine(str(hf_folder[0]), dtype="bfloat16")
    for seed in range(6):
        rng = random.Random(seed)
        n = rng.randint(WINDOW, 40)
        tokens = [rng.randrange(VOCAB) for _ in range(n)]
        _check(engine, tokens, random_plan(rng, n, max_mates=2), rng)


def test_cache_bytes_per_token_are_the_blocks_sum() -> None:
    """Each mixer block declares its cache bytes (`Mixer.cache_bytes`) and the pool's budget
    sums them: Gemma 3's sliding layers keep every key, so random:gemma3-4b costs K and V of
    34 layers x 4 KV heads x 256 in bf16 per token, half that in e4m3; a hybrid's per token is
    its attention layers' K/V alone, its snapshots (their own pool) the size its state layout
    counts."""
    from lockstep.engine.memory import bytes_per_token, snapshot_bytes
    from lockstep.models.linear_attention import LinearLayout
    from lockstep.models.presets import PRESETS

    gemma = PRESETS["gemma3-4b"].spec
    assert bytes_per_token(gemma, 4, torch.bfloat16) == 2 * 34 * 4 * 256 * 2 == 139264
    assert bytes_per_token(gemma, 4, torch.float8_e4m3fn) == 139264 // 2
    assert snapshot_bytes(gemma) == 0
    hybrid = PRESETS["qwen3.5-9b"].spec
    layout = LinearLayout.of(hybrid, torch.device("cpu"))
    assert bytes_per_token(hybrid, 4, torch.bfloat16) == 2 * len(hybrid.kv_layers) * 4 * 256 * 2
    assert snapshot_bytes(hybrid) == layout.snapshot_bytes
