"""Exact speculative decoding with the models' own multi-token-prediction layers
(docs/speculative.md, lockstep/models/mtp.py): a tiny DeepSeek-V3 folder written by
transformers, given an MTP layer under the released checkpoints' names (transformers saves
none), drafts with `speculative="mtp"`, and every output equals plain decode bit for bit,
greedy and seeded, beside batch-mates, from the prefix cache and through preemption.

The MTP layer itself is checked against transformers' own DeepSeek-V3 decoder layer run as
DeepSeek's MTP module (enorm, hnorm, eh_proj over [embed; hidden], one layer, shared head):
the same drafts. Negative control: reference mode's verify rows differ from its decode rows.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.engine.sampling_params import SamplingParams
from lockstep.errors import ConfigError
from tests.contract.test_speculative import (
    _alone,
    _assert_pool_free,
    _cached_sequences,
    _copy_prompts,
    _not_kept,
    _run,
)
from tests.support.tiny_hf import add_mtp_layer, save_tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("deepseek_v3_mtp")
    save_tiny("deepseek_v3", path)
    add_mtp_layer(path)
    return path


def _engine(model: str, **options) -> Engine:
    options = {"kv_tokens": 4096, "debug_checks": True} | options
    return Engine(EngineConfig(model=model, device="cpu", dtype="float32", **options))


def test_mtp_layer_drafts_what_deepseeks_mtp_module_does(folder: Path) -> None:
    """transformers' DeepSeek-V3 decoder layer as the MTP module (float64), from the same
    hidden row and token: the same greedy drafts as Lockstep's MTP layer."""
    import transformers
    from safetensors.torch import load_file
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    config = model.config
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # torch's grouped_mm takes no float64
    layers = config.num_hidden_layers
    own = {k.removeprefix(f"model.layers.{layers}."): v.double()
           for k, v in load_file(str(folder / "mtp.safetensors")).items()}  # fmt: skip
    layer = ds.DeepseekV3DecoderLayer(config, layer_idx=layers).double().eval()
    parts = {k: v for k, v in own.items() if k.split(".")[0] in
             ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")}  # fmt: skip
    # The module holds its experts fused, [E, 2I, H] (gate rows, then up) and [E, H, I].
    experts = range(config.n_routed_experts)
    ex = {p: [parts.pop(f"mlp.experts.{e}.{p}_proj.weight") for e in experts]
          for p in ("gate", "up", "down")}  # fmt: skip
    parts["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([g, u]) for g, u in zip(ex["gate"], ex["up"], strict=True)]
    )
    parts["mlp.experts.down_proj"] = torch.stack(ex["down"])
    layer.load_state_dict(parts)
    eps = config.rms_norm_eps

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def reference(hidden: torch.Tensor, token: int, limit: int) -> list[int]:
        rows, drafted = [], []
        for j in range(limit):
            e = model.model.embed_tokens(torch.tensor([token]))
            x = torch.cat([norm(e, own["enorm.weight"]), norm(hidden, own["hnorm.weight"])], -1)
            rows.append(x @ own["eh_proj.weight"].T)
            window = torch.cat(rows)[None]  # every drafted position so far, causal
            positions = torch.arange(j + 1)[None]
            mask = torch.full((j + 1, j + 1), float("-inf"), dtype=torch.float64).triu(1)
            out = layer(window, attention_mask=mask[None, None], position_ids=positions,
                        position_embeddings=model.model.rotary_emb(window, positions))  # fmt: skip
            hidden = out[0, -1:]
            head = norm(hidden, own["shared_head.norm.weight"]) @ own["shared_head.head.weight"].T
            token = int(head.argmax())
            drafted.append(token)
        return drafted

    mtp = _engine(str(folder), speculative="mtp").speculator.drafter.model  # type: ignore[union-attr]
    rng = random.Random(0)
    compared = 0
    for _ in range(6):
        prompt = torch.tensor([[rng.randrange(config.vocab_size) for _ in range(12)]])
        with torch.no_grad():
            out = model.model(prompt)
            hidden = out.last_hidden_state[0, -1:]  # final-normed, as the engine keeps it
            token = int(model.lm_head(hidden).argmax())
            want = reference(hidden, token, 4)
        got = mtp.draft(hidden[0].float(), token, 4)
        assert got == want
        compared += len(want)
    assert compared == 24


@pytest.mark.parametrize("seed", [0, 1])
def test_mtp_speculation_batched_with_preemption_equals_plain_alone(
    folder: Path, seed: int
) -> None:
    rng = random.Random(seed)
    options = {"kv_tokens": 200, "max_model_len": 128, "max_batch_tokens": 128, "chunk_size": 32,
               "output_reserve": 0.0}  # fmt: skip
    spec = _engine(str(folder), speculative="mtp", num_draft_tokens=3, **options)
    vocab = spec.decoder.spec.vocab_size
    requests = {
        f"r{i}": (p, SamplingParams(max_tokens=12, temperature=rng.choice([0.0, 1.0]), seed=i,
                                    ignore_eos=True, logprobs=2))
        for i, p in enumerate(_copy_prompts(rng, vocab, 12))
    }  # fmt: skip
    together = _run(spec, requests)
    stats = spec.stats()
    assert stats["num_preemptions"] > 0, "the KV budget did not force a preemption"
    assert any(r[4] > 0 for r in together.values()), "no prefix was reused"
    # The MTP layer drafted (random weights: its drafts are rarely the target's tokens).
    assert stats["spec_drafted_tokens_total"] > 0 and stats["spec_verify_chunks_total"] > 0
    finals = [requests[rid][0] + together[rid][0] for rid in requests]
    cached = _cached_sequences(spec)
    assert cached and not _not_kept(cached, finals), "the radix cache holds a rejected draft"
    _assert_pool_free(spec)
    alone = _alone(_engine(str(folder)), requests)
    for rid in requests:
        assert together[rid][:4] == alone[rid][:4], f"{rid} differs with MTP speculation"


def test_negative_control_fast_mode_mtp_speculation_differs(folder: Path) -> None:
    """Reference mode's CPU matmuls give a verify chunk's rows other bits than one-row decode: the
    comparison above fails there."""
    rng = random.Random(2)
    requests = {
        f"r{i}": ([rng.randrange(300) for _ in range(rng.randint(4, 24))],
                  SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1))
        for i in range(4)
    }  # fmt: skip
    want = _run(_engine(str(folder), mode="reference"), requests)
    spec = _engine(str(folder), mode="reference", speculative="mtp", num_draft_tokens=3)
    got = _run(spec, requests)
    assert spec.speculator.counters.drafted > 0
    assert any(got[r][1] != want[r][1] for r in requests), "reference mode gave the same bits"


def test_mtp_is_refused_without_mtp_weights(folder: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="speculative='mtp' is invalid for random:tiny"):
        _engine("random:tiny", speculative="mtp")
    plain = tmp_path / "plain"
    plain.mkdir()
    for path in folder.iterdir():
        if path.name != "mtp.safetensors":
            (plain / path.name).write_bytes(path.read_bytes())
    with pytest.raises(ConfigError, match="no multi-token-prediction layers"):
        _engine(str(plain), speculative="mtp")
    with pytest.raises(ConfigError, match="speculative='mtp' is invalid with tp=2"):
        EngineConfig(model=str(folder), speculative="mtp", tp=2)
