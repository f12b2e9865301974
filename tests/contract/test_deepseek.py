"""The DeepSeek-architecture families (DeepSeek-V3, DeepSeek-V2, GLM-4.7-Flash) on the CPU.

Correctness against transformers: tiny folders built and saved by transformers itself (its
modeling code the reference): multi-head latent attention with and without a q LoRA, YaRN
RoPE with mscale on the tables and the scores, interleaved RoPE dims, sigmoid routing with a
non-zero correction bias inside expert groups (V3), softmax greedy routing scaled (V2),
ungated shared experts, dense first layers. Then the position-invariance contract through the
shared property harness (tests/support/invariance_harness.py): random schedules with
batch-mates and radix hits, hits of every length across the CPU kernel's 32-key block with
short uncached tails, every chunk size, decode versus teacher-forced scoring, preemption, a
bf16 cache; reference mode (stock SDPA and transformers' routing) must fail the same checks.
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
from lockstep.engine.memory import bytes_per_token, refuse_oversized_weights
from lockstep.engine.sampling_params import SamplingParams
from lockstep.errors import ConfigError, ModelLoadError
from lockstep.models.decoder import Decoder
from lockstep.models.presets import PRESETS
from lockstep.models.resolver import resolve_model
from lockstep.ops import get_ops
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

FAMILIES = ("deepseek_v3", "deepseek_v2", "glm4_moe_lite")
VOCAB = 300  # the tiny folders'
_SETTINGS = dict(
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)


def _engine(model: str, mode: str = "deterministic", **options) -> Engine:
    options = {"kv_tokens": 2048, "dtype": "float32", **options}
    return Engine(EngineConfig(model=model, mode=mode, device="cpu", **options))


# One torch thread for tiny shapes (tests/conftest.py): bits do not depend on the count.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    out = {}
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(family)
        out[family] = (folder, save_tiny(family, folder))
    return out


@pytest.fixture(scope="module")
def v3(folders) -> Engine:
    return _engine(str(folders["deepseek_v3"][0]))


def _llm(engine: Engine) -> LLM:
    llm = LLM.__new__(LLM)  # the module's engine, without loading the model again
    llm.engine, llm.tokenizer, llm._counter = engine, engine.tokenizer, 0
    return llm


# ---------------------------------------------------------------- against transformers


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_transformers_prefill_and_generation(folders, family: str) -> None:
    """Logprobs of a 100-token prefill and of greedy generation through the engine's decode
    steps (transformers with its latent cache) agree within 1e-4 in float32; same tokens."""
    folder, model = folders[family]
    engine = _engine(str(folder))
    spec = engine.decoder.spec
    assert spec.family == family and spec.mla is not None and spec.moe is not None
    assert spec.moe.sparse_layers == (1, 2) and not spec.moe.shared_expert_gated
    assert (spec.mla.q_lora_rank is None) == (family == "deepseek_v2")
    if family == "deepseek_v3":
        assert spec.moe.groups == 4 and spec.moe.correction_bias and spec.yarn is not None
    rng = random.Random(3)
    tokens = [rng.randrange(VOCAB) for _ in range(100)]
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([tokens])).logits[0], -1)
    got = torch.log_softmax(engine.decoder.logits_for_sequence(tokens), -1)
    assert (got - want).abs().max() < 1e-4, float((got - want).abs().max())

    prompt = tokens[:40]
    with torch.no_grad():
        gen = model.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, output_logits=True,
            return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
    want_ids = gen.sequences[0, len(prompt) :].tolist()
    want_lps = [torch.log_softmax(step[0], -1) for step in gen.logits]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    out = _llm(engine).generate([prompt], params, use_tqdm=False)[0]
    assert out.token_ids == want_ids
    for lp, token, step in zip(out.logprobs, want_ids, want_lps, strict=True):
        assert abs(lp - float(step[token])) < 1e-4


def test_negative_control_the_correction_bias_is_what_matches(folders, tmp_path: Path) -> None:
    """The V3 folder with its correction bias zeroed misses transformers' logits: the
    comparison above sees the bias (selection only), as it sees the groups."""
    from safetensors.torch import load_file, save_file

    folder, model = folders["deepseek_v3"]
    for path in folder.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
        tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, tmp_path / "model.safetensors")
    tokens = list(range(1, 60))
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0]
    got = _engine(str(tmp_path)).decoder.logits_for_sequence(tokens)
    assert (got - want).abs().max() > 1e-3


def test_multi_token_prediction_layers_are_skipped(folders, tmp_path: Path) -> None:
    """A folder holding `model.layers.{num_layers}.*` (DeepSeek's MTP layer) loads: those
    tensors are skipped, the logits are the folder's without them."""
    from safetensors.torch import load_file, save_file

    folder, _ = folders["deepseek_v3"]
    for path in folder.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(4, 4)
    tensors["model.layers.3.self_attn.q_a_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, tmp_path / "model.safetensors")
    tokens = list(range(1, 20))
    want = _engine(str(folder)).decoder.logits_for_sequence(tokens)
    assert torch.equal(_engine(str(tmp_path)).decoder.logits_for_sequence(tokens), want)


def test_weight_update_from_a_trainer_state_dict(folders) -> None:
    """transformers' state_dict (fused experts, the correction bias buffer) updates a served
    DeepSeek-V3 model in place: a changed correction bias (routing only) or kv_b_proj (the
    absorbed W_UK, W_UV) gives other logits, the original weights give the original bits."""
    folder, model = folders["deepseek_v3"]
    engine = _engine(str(folder))
    tokens = list(range(1, 40))
    before = engine.decoder.logits_for_sequence(tokens)
    state = model.state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)  # fused in memory
    for part in ("e_score_correction_bias", "kv_b_proj"):
        changed = {k: v.flip(-1) if part in k else v for k, v in state.items()}
        engine.update_weights(changed)
        assert not torch.equal(engine.decoder.logits_for_sequence(tokens), before), part
    engine.update_weights(state)
    assert torch.equal(engine.decoder.logits_for_sequence(tokens), before)


@pytest.mark.parametrize(
    ("family", "key", "value", "says"),
    [("deepseek_v3", "index_topk", 2048, "sparse attention"),
     ("deepseek_v3", "model_type", "deepseek_v32", "sparse attention"),
     ("deepseek_v2", "moe_layer_freq", 2, "moe_layer_freq=2"),
     ("deepseek_v2", "norm_topk_prob", True, "norm_topk_prob=true"),
     ("deepseek_v3", "kv_lora_rank", 72, "multiples of 16")],
)  # fmt: skip
def test_what_is_not_served_is_refused_in_one_line(
    folders, tmp_path: Path, family: str, key: str, value: object, says: str
) -> None:
    folder, _ = folders[family]
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    with pytest.raises(ModelLoadError) as err:
        resolve_model(str(tmp_path))
    assert "\n" not in str(err.value) and says in str(err.value)


def test_a_backend_without_latent_attention_is_refused_at_load(folders) -> None:
    """The float64 reference has neither latent attention nor DeepSeek routing: loading
    names the capability in one line."""
    loaded = resolve_model(str(folders["deepseek_v3"][0]))
    with pytest.raises(ModelLoadError) as err:
        Decoder.load(loaded, get_ops("cpu", "float64"), torch.float64, "cpu")
    assert "\n" not in str(err.value) and "LatentAttentionOps" in str(err.value)


def test_kv_bytes_per_token_are_the_latent_and_rope_key() -> None:
    """An MLA layer keeps kv_lora_rank + qk_rope_head_dim values per token whatever its head
    count: 576 for DeepSeek-V3, so 61 x 576 x 2 bytes in bf16 (a GQA model of 128 heads of
    192 would keep 128 x (192 + 128) per layer); the pool holds one tensor, no values."""
    v3 = PRESETS["deepseek-v3"].spec
    assert v3.mla is not None and v3.mla.cache_width == 576
    assert bytes_per_token(v3, 1, torch.bfloat16) == 61 * 576 * 2 == 70272
    assert bytes_per_token(v3, 1, torch.float8_e4m3fn) == 61 * 576
    lite = PRESETS["deepseek-v2-lite"].spec
    assert bytes_per_token(lite, 1, torch.bfloat16) == 27 * 576 * 2
    assert round(lite.num_parameters / 1e9, 1) == 15.7
    assert round(v3.num_parameters / 1e9) == 671
    with pytest.raises(ConfigError) as err:
        refuse_oversized_weights("random:deepseek-v3", v3, 2, 1, 140 * 2**30)
    assert "\n" not in str(err.value) and "671.03 B parameters" in str(err.value)


def test_engine_pool_keeps_one_latent_row_per_token(folders) -> None:
    """The pool holds one 96-value row per token and layer (no separate values), sized from
    memory at 3 x 96 x 4 bytes per token (float32), which the start-up line states."""
    engine = _engine(str(folders["deepseek_v3"][0]), kv_tokens=None)
    keys, values = engine.pool.k_cache(0), engine.pool.v_cache(0)
    assert keys.shape[1:] == (1, 96) and values.data_ptr() == keys.data_ptr()
    assert engine.kv_budget is not None and engine.kv_budget.bytes_per_token == 3 * 96 * 4
    assert f"tokens of {3 * 96 * 4} bytes" in engine.kv_budget.describe()


# ---------------------------------------------------------------- position invariance


@settings(max_examples=25, **_SETTINGS)
@given(seed=st.integers(0, 2**32 - 1))
def test_any_schedule_matches_cold_prefill(v3: Engine, seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 70)
    tokens = [rng.randrange(VOCAB) for _ in range(n)]
    plan = random_plan(rng, n, max_mates=3)
    problems = mismatches(reference(v3, tokens), compute(v3, tokens, plan, rng))
    assert not problems, f"n={n} {plan.describe()}: " + "; ".join(problems)
    v3.check_integrity()


def test_prefix_hits_of_every_length_and_every_chunk_size(v3: Engine) -> None:
    """Hits of every length 1..48 (across the kernel's 32-key block) with tails of 1..40
    beside a mate, and a 53-token prompt in chunks of every size: all equal a cold prefill."""
    check_prefix_hits_of_every_length(v3, VOCAB, 16)
    check_every_chunk_size(v3, VOCAB, 16)


def test_generation_logprobs_equal_scoring(v3: Engine) -> None:
    llm = _llm(v3)
    rng = random.Random(2)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 31, 45)]
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=10, temperature=temperature, seed=11, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        scores = llm.score([o.prompt_token_ids + o.token_ids for o in outs], use_tqdm=False)
        for out, score in zip(outs, scores, strict=True):
            assert score.logprobs[len(out.prompt_token_ids) :] == out.logprobs, temperature
    v3.check_integrity()


@settings(max_examples=3, **_SETTINGS)
@given(seed=st.integers(0, 2**32 - 1))
def test_engine_schedules_with_preemption_match_alone(folders, seed: int) -> None:
    rng = random.Random(seed)
    stem = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
    requests = {}
    for i in range(rng.randint(3, 5)):
        prompt = stem[: rng.randint(1, len(stem))] + [rng.randrange(VOCAB) for _ in range(9)]
        params = SamplingParams(max_tokens=rng.randint(1, 10), temperature=rng.choice([0.0, 1.0]),
                                seed=i, ignore_eos=True)  # fmt: skip
        requests[f"r{i}"] = (prompt, params)
    largest = max(len(p) + params.max_tokens for p, params in requests.values())
    batch_tokens = rng.randint(8, 64)
    engine = _engine(
        str(folders["deepseek_v3"][0]), kv_tokens=largest + rng.randint(0, 30),
        output_reserve=rng.choice([0.0, 0.5, 1.0]),
        max_batch_tokens=batch_tokens, chunk_size=rng.randint(1, batch_tokens),
        max_running=rng.randint(2, 5), debug_checks=True,
    )  # fmt: skip
    assert not differ_alone(engine, requests)
    engine.check_integrity()


@pytest.mark.parametrize("family", ["deepseek_v2", "glm4_moe_lite"])
def test_other_families_keep_the_contract(folders, family: str) -> None:
    """V2 (no q LoRA, softmax routing) and GLM-4.7-Flash through random schedules, with a
    bf16 cache and weights for one of them."""
    dtype = "bfloat16" if family == "glm4_moe_lite" else "float32"
    engine = _engine(str(folders[family][0]), dtype=dtype)
    for seed in range(6):
        rng = random.Random(seed)
        n = rng.randint(20, 60)
        tokens = [rng.randrange(VOCAB) for _ in range(n)]
        plan = random_plan(rng, n, max_mates=2)
        problems = mismatches(reference(engine, tokens), compute(engine, tokens, plan, rng))
        assert not problems, f"{family} n={n} {plan.describe()}: " + "; ".join(problems)


def test_negative_control_reference_mode_breaks_the_contract(folders) -> None:
    """The same harness in reference mode (oneDNN GEMMs, SDPA over the latent rows, transformers'
    routing) finds differences: it is not blind."""
    engine = _engine(str(folders["deepseek_v3"][0]), mode="reference")
    failures = 0
    for seed in range(8):
        rng = random.Random(seed)
        n = rng.randint(20, 60)
        tokens = [rng.randrange(VOCAB) for _ in range(n)]
        plan = random_plan(rng, n, max_mates=2)
        failures += bool(mismatches(reference(engine, tokens), compute(engine, tokens, plan, rng)))
    assert failures > 0


@pytest.mark.slow
def test_lockstep_check_serve_passes_every_scenario(tmp_path: Path) -> None:
    """`lockstep check --serve --model <tiny DeepSeek-V3 folder>` passes every scenario."""
    check_serve_passes_every_scenario("deepseek_v3", tmp_path)


def test_negative_control_stock_latent_attention_alone_breaks_the_contract(folders) -> None:
    """Everything deterministic but the latent attention, which is the stock SDPA
    formulation: the harness finds differences, so it sees the MLA kernel's part."""
    from lockstep.ops.cpu_stock import CpuStockOps

    engine = _engine(str(folders["deepseek_v3"][0]))
    ops = engine.decoder.ops
    ops.latent_attention = CpuStockOps.latent_attention.__get__(ops)  # type: ignore[method-assign]
    failures = 0
    for seed in range(8):
        rng = random.Random(seed)
        n = rng.randint(20, 60)
        tokens = [rng.randrange(VOCAB) for _ in range(n)]
        plan = random_plan(rng, n, max_mates=2)
        failures += bool(mismatches(reference(engine, tokens), compute(engine, tokens, plan, rng)))
    assert failures > 0
