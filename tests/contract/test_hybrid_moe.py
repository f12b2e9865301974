"""The hybrid mixture-of-experts families (Qwen3.5-MoE, Qwen3-Next) on the CPU.

Correctness against transformers (tiny folders built and saved by transformers itself, its
modeling code the reference: Gated DeltaNet and gated full attention as in Qwen3.5, routed
experts plus a sigmoid-gated shared expert, Qwen3-Next's grouped projections and dense
`mlp_only_layers`), and the position-invariance contract on the tiny presets through the
shared property harness (tests/support/invariance_harness.py, as tests/contract/test_hybrid.py uses it): random
schedules with batch-mates, prefix hits of every length 1..3C with short uncached tails, every
chunk size, decode versus teacher-forced scoring, preemption. The negative controls run the
same checks in reference mode and require them to fail.
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
from lockstep.engine.llm import LLM
from lockstep.engine.memory import GIB, refuse_oversized_weights
from lockstep.engine.sampling_params import SamplingParams
from lockstep.errors import ConfigError, ModelLoadError
from lockstep.models.linear_attention import CHUNK
from lockstep.models.presets import PRESETS
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

FAMILIES = ("qwen3_5_moe", "qwen3_next")
PRESET = {"qwen3_5_moe": "random:tiny-qwen3.5-moe", "qwen3_next": "random:tiny-qwen3-next"}
VOCAB = 512  # the tiny presets'

_SETTINGS = dict(
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)


def _engine(model: str, mode: str = "deterministic", **options) -> Engine:
    options.setdefault("kv_tokens", 4096)
    return Engine(EngineConfig(model=model, mode=mode, device="cpu", dtype="float32", **options))


# One torch thread for tiny shapes (tests/conftest.py): bits do not depend on the count.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=FAMILIES)
def hf_folder(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, object]:
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, save_tiny(request.param, folder)


@pytest.fixture(scope="module", params=FAMILIES)
def preset(request) -> Engine:
    return _engine(PRESET[request.param])


def _llm(engine: Engine) -> LLM:
    llm = LLM.__new__(LLM)  # the module's engine, without loading the model again
    llm.engine, llm.tokenizer, llm._counter = engine, engine.tokenizer, 0
    return llm


# ---------------------------------------------------------------- against transformers


def test_matches_transformers_prefill_and_generation(hf_folder) -> None:
    """Logprobs of a 150-token prefill (four chunk boundaries) and of greedy token-by-token
    generation (transformers' cache: recurrent decode) agree within 1e-4 in float32; the
    tokens are the same."""
    family, folder, model = hf_folder
    engine = _engine(str(folder))
    spec = engine.decoder.spec
    assert spec.family == family and spec.moe is not None and spec.moe.shared_expert_size == 48
    dense = (1,) if family == "qwen3_next" else ()  # mlp_only_layers
    assert spec.moe.sparse_layers == tuple(i for i in range(4) if i not in dense)
    rng = random.Random(3)
    tokens = [rng.randrange(300) for _ in range(150)]
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([tokens])).logits[0], -1)
    got = torch.log_softmax(engine.decoder.logits_for_sequence(tokens), -1)
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


def test_reference_mode_matches_transformers(hf_folder) -> None:
    """The yardstick computes the same model (so its failures below are about scheduling)."""
    _, folder, model = hf_folder
    tokens = [random.Random(4).randrange(300) for _ in range(70)]
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0]
    got = _engine(str(folder), mode="reference").decoder.logits_for_sequence(tokens)
    assert (got - want).abs().max() < 1e-4, float((got - want).abs().max())


def test_multimodal_qwen3_5_moe_checkpoint_serves_its_text_model(tmp_path: Path) -> None:
    """A Qwen3_5MoeForConditionalGeneration folder (model_type qwen3_5_moe, text_config,
    tensors under model.language_model., a vision tower, an MTP head) loads as the text
    model: the same logits bits."""
    from safetensors.torch import load_file, save_file

    text_folder = tmp_path / "text"
    text_folder.mkdir()
    save_tiny("qwen3_5_moe", text_folder)
    text = json.loads((text_folder / "config.json").read_text())
    config = {"model_type": "qwen3_5_moe", "text_config": text, "tie_word_embeddings": False,
              "architectures": ["Qwen3_5MoeForConditionalGeneration"]}  # fmt: skip
    wrapped = tmp_path / "wrapped"
    wrapped.mkdir()
    (wrapped / "config.json").write_text(json.dumps(config))
    tensors = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
        for k, v in load_file(text_folder / "model.safetensors").items()
    }
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, wrapped / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (wrapped / name).write_bytes((text_folder / name).read_bytes())
    tokens = list(range(1, 40))
    want = _engine(str(text_folder)).decoder.logits_for_sequence(tokens)
    assert torch.equal(_engine(str(wrapped)).decoder.logits_for_sequence(tokens), want)


def test_weight_update_from_a_trainer_state_dict(hf_folder) -> None:
    """transformers' state_dict (fused experts, Qwen3-Next's grouped projections) updates a
    served model in place: a changed shared expert gives other logits, the original weights
    give the original bits back."""
    _, folder, model = hf_folder
    engine = _engine(str(folder))
    tokens = list(range(1, 40))
    before = engine.decoder.logits_for_sequence(tokens)
    state = model.state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)  # fused in memory
    changed = {k: v * 1.01 if "shared_expert" in k else v for k, v in state.items()}
    engine.update_weights(changed)
    assert not torch.equal(engine.decoder.logits_for_sequence(tokens), before)
    engine.update_weights(state)
    assert torch.equal(engine.decoder.logits_for_sequence(tokens), before)


@pytest.mark.parametrize("key_heads, value_heads", [(2, 2), (2, 6)])
def test_grouped_projections_reorder_as_transformers_splits_them(key_heads, value_heads) -> None:
    """Qwen3-Next's in_proj_qkvz / in_proj_ba rows, reordered at load, are exactly the
    q | k | v, z, b, a rows that transformers' fix_query_key_value_ordering cuts from their
    outputs (applied here to the weights' columns, as if each were a token's output), for 1
    and 3 value heads per key head."""
    import transformers
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    from lockstep.models.blocks.gated_deltanet import ungroup_projections
    from lockstep.models.spec import LinearAttentionSpec

    config = transformers.Qwen3NextConfig(
        hidden_size=32, num_hidden_layers=1, linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads, linear_key_head_dim=8, linear_value_head_dim=4,
    )  # fmt: skip
    torch.manual_seed(0)
    layer = Qwen3NextGatedDeltaNet(config, 0)
    qkvz, ba = layer.in_proj_qkvz.weight.detach(), layer.in_proj_ba.weight.detach()
    parts = layer.fix_query_key_value_ordering(qkvz.T[None], ba.T[None])
    q, k, v, z, b, a = (t.reshape(32, -1).T for t in parts)
    lin = LinearAttentionSpec(("linear_attention",), key_heads, value_heads, 8, 4, 4, True)
    rows = ungroup_projections(lin, qkvz, ba)
    for got, want in zip(rows, [torch.cat([q, k, v]), z, b, a], strict=True):
        assert torch.equal(got, want)


def test_a_shared_expert_is_refused_where_the_family_has_none(tmp_path: Path) -> None:
    """Only the hybrid MoE model types serve shared_expert_intermediate_size: a Qwen3-MoE
    config with one is refused in one line naming the key; a Qwen3.5-MoE config without one
    is refused too (its layers need it)."""
    folder = tmp_path / "moe"
    folder.mkdir()
    save_tiny("qwen3_moe", folder, num_hidden_layers=2, mlp_only_layers=[])
    config = json.loads((folder / "config.json").read_text())
    config["shared_expert_intermediate_size"] = 48
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as err:
        _engine(str(folder))
    assert "\n" not in str(err.value)
    assert "shared_expert_intermediate_size=48 (a shared expert) is not supported" in str(err.value)

    from lockstep.models.families import family_of

    text = {"model_type": "qwen3_5_moe_text", "num_experts": 8}
    family = family_of(text, "config.json")
    with pytest.raises(ModelLoadError, match="shared_expert_intermediate_size is missing"):
        family.spec(text, "config.json")


def test_real_shaped_presets_and_their_memory_arithmetic() -> None:
    """random:qwen3.5-35b-a3b fits one H200 in bf16 (139 GiB free); random:qwen3-next-80b-a3b
    does not and cannot be sharded yet: refused with the arithmetic. Control: a free memory
    above its weights passes."""
    big = PRESETS["qwen3-next-80b-a3b"].spec
    small = PRESETS["qwen3.5-35b-a3b"].spec
    assert round(small.num_parameters / 1e9, 2) == 34.66
    assert round(big.num_parameters / 1e9, 2) == 79.67
    assert big.linear is not None and big.linear.grouped_projections
    h200 = int(139 * GIB)
    refuse_oversized_weights("random:qwen3.5-35b-a3b", small, 2, 1, h200)
    with pytest.raises(ConfigError) as err:
        refuse_oversized_weights("random:qwen3-next-80b-a3b", big, 2, 1, h200)
    message = str(err.value)
    assert "\n" not in message
    assert "148.4 GiB per GPU (79.67 B parameters x 2 bytes / tp=1)" in message
    assert "139.0 GiB free" in message and "tp=1 only" in message
    refuse_oversized_weights("random:qwen3-next-80b-a3b", big, 2, 1, int(149 * GIB))


# ---------------------------------------------------------------- position invariance


@settings(max_examples=25, **_SETTINGS)
@given(seed=st.integers(0, 2**32 - 1))
def test_any_schedule_matches_cold_prefill(preset: Engine, seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 3 * CHUNK + 20)
    tokens = [rng.randrange(VOCAB) for _ in range(n)]
    plan = random_plan(rng, n, max_mates=3)
    plan.donor_step = 48
    problems = mismatches(reference(preset, tokens), compute(preset, tokens, plan, rng))
    assert not problems, f"n={n} {plan.describe()}: " + "; ".join(problems)
    preset.check_integrity()


def test_prefix_hits_of_every_length_with_short_tails(preset: Engine) -> None:
    check_prefix_hits_of_every_length(preset, VOCAB, CHUNK)


def test_every_chunk_size_from_one_to_the_whole_prompt(preset: Engine) -> None:
    check_every_chunk_size(preset, VOCAB, CHUNK)


def test_generation_logprobs_equal_scoring(preset: Engine) -> None:
    """Decode one token at a time versus one prefill of the whole text: the same logprob bits,
    greedy and sampled, across a chunk boundary."""
    llm = _llm(preset)
    rng = random.Random(2)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, CHUNK - 3, 2 * CHUNK - 1)]
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=12, temperature=temperature, seed=11, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        scores = llm.score([o.prompt_token_ids + o.token_ids for o in outs], use_tqdm=False)
        for out, score in zip(outs, scores, strict=True):
            assert score.logprobs[len(out.prompt_token_ids) :] == out.logprobs, temperature
    preset.check_integrity()


@settings(max_examples=5, **_SETTINGS)
@given(seed=st.integers(0, 2**32 - 1), family=st.sampled_from(FAMILIES))
def test_engine_schedules_with_preemption_match_alone(seed: int, family: str) -> None:
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
        PRESET[family],
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


@pytest.mark.slow
def test_lockstep_check_serve_passes_every_scenario(tmp_path: Path) -> None:
    """`lockstep check --serve --model <tiny Qwen3-Next folder>` passes every scenario."""
    check_serve_passes_every_scenario("qwen3_next", tmp_path)


# ---------------------------------------------------------------- negative controls


@pytest.mark.parametrize("family", FAMILIES)
def test_negative_control_reference_mode_breaks_the_contract(family: str) -> None:
    """The same schedules as above in reference mode: some position differs from the cold
    prefill, and decode differs from scoring somewhere."""
    engine = _engine(PRESET[family], mode="reference")
    failures = 0
    for seed in range(8):
        rng = random.Random(seed)
        n = rng.randint(CHUNK // 2, 2 * CHUNK)
        tokens = [rng.randrange(VOCAB) for _ in range(n)]
        plan = random_plan(rng, n, max_mates=2)
        failures += bool(mismatches(reference(engine, tokens), compute(engine, tokens, plan, rng)))
    assert failures > 0, "reference mode passed every schedule: the check is blind"

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
