"""The DeepSeek-architecture families (DeepSeek-V3, DeepSeek-V2, GLM-4.7-Flash) on the CPU:
what only they have.

What every family shows (transformers within 1e-4 in both modes, random schedules, radix
hits of every length, every chunk size, decode versus scoring, preemption, bf16, a weight
update from transformers' state_dict, reference mode failing, `lockstep check --serve`) is
their rows of tests/contract/test_family_conformance.py, on tiny folders saved by
transformers: multi-head latent attention with and without a q LoRA, YaRN RoPE with mscale
on the tables and the scores, sigmoid routing with a non-zero correction bias inside expert
groups (V3), softmax greedy routing scaled (V2), ungated shared experts, dense first layers.
Here: that the spec reads that structure, the controls that the correction bias and the latent
attention kernel are what the contract sees, the multi-token-prediction layers skipped, the
refusals, and the latent cache's size.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.engine.memory import bytes_per_token, refuse_oversized_weights
from lockstep.errors import ConfigError, ModelLoadError
from lockstep.models.decoder import Decoder
from lockstep.models.presets import PRESETS
from lockstep.models.resolver import resolve_model
from lockstep.ops import get_ops
from tests.support.invariance_harness import compute, mismatches, random_plan, reference
from tests.support.tiny_hf import save_tiny

FAMILIES = ("deepseek_v3", "deepseek_v2", "glm4_moe_lite")
VOCAB = 300  # the tiny folders'


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


# ---------------------------------------------------------------- the spec and its controls


@pytest.mark.parametrize("family", FAMILIES)
def test_the_spec_reads_latent_attention_and_routing(folders, family: str) -> None:
    """Each folder's spec has latent attention and DeepSeek routing: layer 0 dense, an
    ungated shared expert, a q LoRA but in V2, V3's expert groups, correction bias and YaRN."""
    spec = resolve_model(str(folders[family][0])).spec
    assert spec.family == family and spec.mla is not None and spec.moe is not None
    assert spec.moe.sparse_layers == (1, 2) and not spec.moe.shared_expert_gated
    assert (spec.mla.q_lora_rank is None) == (family == "deepseek_v2")
    if family == "deepseek_v3":
        assert spec.moe.groups == 4 and spec.moe.correction_bias and spec.yarn is not None


def test_negative_control_the_correction_bias_is_what_matches(folders, tmp_path: Path) -> None:
    """The V3 folder with its correction bias zeroed misses transformers' logits: the
    comparison with transformers (tests/contract/test_family_conformance.py) sees the bias
    (selection only), as it sees the groups."""
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


# ---------------------------------------------------------------- negative control


def test_negative_control_stock_latent_attention_alone_breaks_the_contract(folders) -> None:
    """Everything deterministic but the latent attention, which is the stock SDPA
    formulation: the harness finds differences, so it sees the MLA kernel's part (the
    conformance rows' reference-mode control changes every op at once)."""
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
