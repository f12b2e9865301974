"""The hybrid mixture-of-experts families (Qwen3.5-MoE, Qwen3-Next) on the CPU: what only they
have.

What every family shows is their rows of tests/contract/test_family_conformance.py, on tiny
folders saved by transformers (Gated DeltaNet and gated full attention as in Qwen3.5, routed
experts plus a sigmoid-gated shared expert, Qwen3-Next's grouped projections and dense
`mlp_only_layers`): transformers within 1e-4 in both modes, random schedules, prefix hits of
every length 1..3C with short uncached tails, every chunk size, decode versus scoring,
preemption, bf16, a weight update from transformers' state_dict, reference mode failing,
`lockstep check --serve`. Here: that the spec reads that structure, the multimodal layout,
the grouped projections' order, the refusals and the real-shaped presets' memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.engine.memory import GIB, refuse_oversized_weights
from lockstep.errors import ConfigError, ModelLoadError
from lockstep.models.presets import PRESETS
from lockstep.models.resolver import resolve_model
from tests.support.tiny_hf import save_tiny

FAMILIES = ("qwen3_5_moe", "qwen3_next")


def _engine(model: str, mode: str = "deterministic", **options) -> Engine:
    options.setdefault("kv_tokens", 4096)
    return Engine(EngineConfig(model=model, mode=mode, device="cpu", dtype="float32", **options))


# One torch thread for tiny shapes (tests/conftest.py): bits do not depend on the count.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=FAMILIES)
def hf_folder(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, object]:
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, save_tiny(request.param, folder)


# ---------------------------------------------------------------- the spec, layouts and refusals


def test_the_spec_reads_the_experts_and_the_shared_expert(hf_folder) -> None:
    """Routed experts in every layer but Qwen3-Next's `mlp_only_layers`, and a shared expert
    of width 48."""
    family, folder, _ = hf_folder
    spec = resolve_model(str(folder)).spec
    assert spec.family == family and spec.moe is not None and spec.moe.shared_expert_size == 48
    dense = (1,) if family == "qwen3_next" else ()  # mlp_only_layers
    assert spec.moe.sparse_layers == tuple(i for i in range(4) if i not in dense)
    assert spec.linear is not None and spec.linear.grouped_projections == (family == "qwen3_next")


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
    does not: refused with the arithmetic and the degree that fits; at tp=2 on 60 GiB it is
    refused again, with its arithmetic per GPU and --tp 4. Control: a free memory above its
    weights passes."""
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
    assert message.endswith("139.0 GiB free; --tp 2 fits (degrees that work: 1, 2, 4, 8)")
    with pytest.raises(ConfigError) as err:
        refuse_oversized_weights("random:qwen3-next-80b-a3b", big, 2, 2, int(60 * GIB))
    message = str(err.value)
    assert "\n" not in message
    assert ("74.2 GiB per GPU (79.67 B parameters x 2 bytes: 79.62 B of them / tp=2 (experts "
            "77.31 B), 0.051 B of norms and routers on every rank) and the device has 60.0 GiB "
            "free; --tp 4 fits") in message  # fmt: skip
    refuse_oversized_weights("random:qwen3-next-80b-a3b", big, 2, 1, int(149 * GIB))
    refuse_oversized_weights("random:qwen3-next-80b-a3b", big, 2, 2, int(75 * GIB))


def test_the_largest_hybrid_moe_preset_needs_eight_h200s() -> None:
    """random:qwen3.5-397b-a17b (396.35 B parameters) is refused on one H200 with the
    arithmetic and --tp 8; on H100s (78 GiB) even tp=8 is refused, naming its need;
    at tp=8 / ep=8 on H200s it fits (the control)."""
    spec = PRESETS["qwen3.5-397b-a17b"].spec
    assert round(spec.num_parameters / 1e9, 2) == 396.35
    name = "random:qwen3.5-397b-a17b"
    h200, h100 = int(139 * GIB), int(78 * GIB)
    with pytest.raises(ConfigError) as err:
        refuse_oversized_weights(name, spec, 2, 1, h200)
    message = str(err.value)
    assert "\n" not in message
    assert "738.3 GiB per GPU (396.35 B parameters x 2 bytes / tp=1)" in message
    assert message.endswith("139.0 GiB free; --tp 8 fits (degrees that work: 1, 2, 4, 8)")
    with pytest.raises(ConfigError) as err:
        refuse_oversized_weights(name, spec, 2, 8, h100, ep=8)
    assert str(err.value).endswith(
        "78.0 GiB free; even tp=8 needs 92.5 GiB per GPU (degrees that work: 1, 2, 4, 8)"
    )
    refuse_oversized_weights(name, spec, 2, 8, h200, ep=8)
