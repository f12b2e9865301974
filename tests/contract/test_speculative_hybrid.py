"""Exact speculative decoding on hybrid models (docs/speculative.md): tiny Qwen3.5, Gated
DeltaNet layers under both forms of the rule (`gdn_kernel` recurrent and chunked). A verify
chunk advances the linear state over drafts that may be rejected; after it the state must be
the state after the kept tokens only (lockstep/models/linear_attention.py,
`LinearState.end_verify`). Every output equals plain decode bit for bit, greedy and seeded,
beside batch-mates, from the prefix cache (state snapshots) and through preemption, with prompt
lookup, with a control drafter whose drafts are right up to a point that moves (so every count
of kept drafts is rolled back to), and with the model's own MTP head (a tiny Qwen3.5 folder
written by transformers, given `mtp.*` tensors).

Negative controls: a rollback that keeps the state's open rows but not its convolution window
fails the comparison; and so does reference mode.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.engine.sampling_params import SamplingParams
from lockstep.models.linear_attention import CHUNK, LinearState
from tests.contract.test_speculative import (
    _alone,
    _assert_pool_free,
    _cached_sequences,
    _copy_prompts,
    _not_kept,
    _ReferenceDrafter,
    _run,
)
from tests.support.tiny_hf import add_mtp_layer, save_tiny

HYBRID = "random:tiny-qwen3.5"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _engine(model: str = HYBRID, **options) -> Engine:
    options = {"kv_tokens": 4096, "debug_checks": True} | options
    return Engine(EngineConfig(model=model, device="cpu", dtype="float32", **options))


class _PartlyRightDrafter(_ReferenceDrafter):
    """The true continuation with one wrong token at an index that moves with the context's
    length (sometimes past the drafts: all kept), so verify steps keep 1 .. k + 1 tokens."""

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        true = super().propose(tokens, limit)
        wrong = len(tokens) % (limit + 1)
        if wrong < len(true):
            true[wrong] = (true[wrong] + 1) % self.vocab
        return true


def _requests(seed: int, vocab: int, count: int, gen: int) -> dict:
    """Copy-inviting prompts behind a shared header longer than a chunk of the rule, so that
    later requests resume from a cached state snapshot."""
    rng = random.Random(seed)
    header = [rng.randrange(vocab) for _ in range(CHUNK + 8)]
    return {
        f"r{i}": (header + p, SamplingParams(max_tokens=gen, temperature=rng.choice([0.0, 1.0]),
                                             seed=i, ignore_eos=True, logprobs=1))
        for i, p in enumerate(_copy_prompts(rng, vocab, count))
    }  # fmt: skip


def _check_verify_chunks_stay_in_one_rule_chunk(engine: Engine) -> list[int]:
    """Wrap the runner: every verify chunk's next position stays before the boundary after
    its start. Returns the list the wrapper appends each step's widest draft to."""
    widest: list[int] = []
    launch = engine.runner.launch

    def checked(plan, *args, **kwargs):
        for c in plan:
            if c.draft:
                assert c.end < (c.start // CHUNK + 1) * CHUNK, (c.start, c.end)
        widest.append(max((len(c.draft) for c in plan), default=0))
        return launch(plan, *args, **kwargs)

    engine.runner.launch = checked
    return widest


# The chunked rule costs more on the CPU: fewer requests there.
@pytest.mark.parametrize(("kernel", "count"), [("recurrent", 10), ("chunked", 5)])
@pytest.mark.parametrize("drafter", ["ngram", "partly-right"])
def test_hybrid_speculation_batched_with_preemption_equals_plain_alone(
    kernel: str, count: int, drafter: str
) -> None:
    options = {"gdn_kernel": kernel, "max_model_len": 192, "kv_tokens": 192, "max_running": 4,
               "max_batch_tokens": 96, "chunk_size": 24, "output_reserve": 0.0}  # fmt: skip
    plain = _engine(**options)
    vocab = plain.decoder.spec.vocab_size
    requests = _requests(3, vocab, count, 40)
    alone = _alone(plain, requests)
    spec = _engine(speculative="ngram", prompt_lookup_min=1, **options)
    if drafter == "partly-right":
        finals = [requests[r][0] + alone[r][0] for r in requests]
        spec.speculator.drafter = _PartlyRightDrafter(finals, vocab, wrong=False)
    widest = _check_verify_chunks_stay_in_one_rule_chunk(spec)
    together = _run(spec, requests)
    stats = spec.stats()
    assert stats["num_preemptions"] > 0, "the KV budget did not force a preemption"
    assert any(r[4] > 0 for r in together.values()), "no prefix was reused"
    counters = spec.speculator.counters
    assert max(widest) == 4 and counters.drafted > 0
    assert stats["spec_boundary_limited_total"] == counters.boundary_limited > 0, stats
    if drafter == "partly-right":  # drafts kept and rejected: states rolled back mid-run
        assert 0 < counters.accepted < counters.drafted, counters
    finals = [requests[rid][0] + together[rid][0] for rid in requests]
    cached = _cached_sequences(spec)
    assert cached and not _not_kept(cached, finals), "the radix cache holds a rejected draft"
    _assert_pool_free(spec)
    for rid in requests:
        assert together[rid][:4] == alone[rid][:4], f"{rid} differs with speculation"


def test_negative_control_a_rollback_that_keeps_the_window_differs(monkeypatch) -> None:
    """Rolled back without rebuilding the convolution window (the open rows cut, the
    position set): the next tokens' logprobs differ from plain decode's."""
    plain = _engine()
    vocab = plain.decoder.spec.vocab_size
    requests = _requests(5, vocab, 4, 24)
    want = _run(plain, requests)

    def without_window(state: LinearState, position: int) -> None:
        """`end_verify` less the window: the open rows cut, the position set."""
        assert state.verify is not None
        state.verify = None
        for t in (state.open_k, state.open_gamma, state.open_u, state.open_beta):
            t[:, position % CHUNK :].zero_()
        state.position = position

    monkeypatch.setattr(LinearState, "end_verify", without_window)
    spec = _engine(speculative="ngram", prompt_lookup_min=1)
    spec.speculator.drafter = _PartlyRightDrafter(
        [requests[r][0] + want[r][0] for r in requests], vocab, wrong=False
    )
    got = _run(spec, requests)
    assert 0 < spec.speculator.counters.accepted < spec.speculator.counters.drafted
    assert any(got[r][1] != want[r][1] for r in requests), "a wrong window gave the same bits"


def test_negative_control_fast_mode_hybrid_speculation_differs() -> None:
    plain = _engine(mode="reference")
    vocab = plain.decoder.spec.vocab_size
    requests = _requests(6, vocab, 4, 16)
    want = _run(plain, requests)
    spec = _engine(mode="reference", speculative="ngram", prompt_lookup_min=1)
    spec.speculator.drafter = _ReferenceDrafter(
        [requests[r][0] + want[r][0] for r in requests], vocab, wrong=False
    )
    got = _run(spec, requests)
    assert spec.speculator.counters.accepted > 0
    assert any(got[r][1] != want[r][1] for r in requests), "reference mode gave the same bits"


@pytest.fixture(scope="module")
def qwen35_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3_5_mtp")
    save_tiny("qwen3_5", path)
    add_mtp_layer(path)
    return path


@pytest.mark.parametrize("kernel", ["recurrent", "chunked"])
def test_qwen35_mtp_speculation_equals_plain(qwen35_mtp: Path, kernel: str) -> None:
    options = {"gdn_kernel": kernel, "max_model_len": 160, "kv_tokens": 160, "max_running": 4,
               "max_batch_tokens": 96, "chunk_size": 24, "output_reserve": 0.0}  # fmt: skip
    model = str(qwen35_mtp)
    plain = _engine(model, **options)
    requests = _requests(7, plain.decoder.spec.vocab_size, 8 if kernel == "recurrent" else 4, 24)
    alone = _alone(plain, requests)
    spec = _engine(model, speculative="mtp", num_draft_tokens=3, **options)
    together = _run(spec, requests)
    stats = spec.stats()
    assert stats["spec_drafted_tokens_total"] > 0 and stats["num_preemptions"] > 0, stats
    _assert_pool_free(spec)
    for rid in requests:
        assert together[rid][:4] == alone[rid][:4], f"{rid} differs with MTP speculation"


def test_qwen35_mtp_head_drafts_what_transformers_layers_do(qwen35_mtp: Path) -> None:
    """transformers' Qwen3.5 full-attention decoder layer (float64) as the MTP head (the
    norms `mtp.pre_fc_norm_*` and `mtp.norm` stored as w - 1, `mtp.fc` over [embed; hidden],
    the model's LM head), from the same hidden row and token: the same greedy drafts as
    Lockstep's MTP layer."""
    import torch
    import transformers
    from safetensors.torch import load_file
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qw

    model = transformers.AutoModelForCausalLM.from_pretrained(qwen35_mtp, dtype=torch.float64)
    config = model.config
    config._attn_implementation = "eager"
    own = {k: v.double() for k, v in load_file(str(qwen35_mtp / "mtp.safetensors")).items()}
    full = max(i for i, t in enumerate(config.layer_types) if t == "full_attention")
    layer = qw.Qwen3_5DecoderLayer(config, layer_idx=full).double().eval()
    layer.load_state_dict({k.removeprefix("mtp.layers.0."): v for k, v in own.items()
                           if k.startswith("mtp.layers.0.")})  # fmt: skip
    eps = config.rms_norm_eps

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (1.0 + w) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def reference(hidden: torch.Tensor, token: int, limit: int) -> list[int]:
        rows, drafted = [], []
        for j in range(limit):
            e = model.model.embed_tokens(torch.tensor([token]))
            both = torch.cat([norm(e, own["mtp.pre_fc_norm_embedding.weight"]),
                              norm(hidden, own["mtp.pre_fc_norm_hidden.weight"])], -1)  # fmt: skip
            rows.append(both @ own["mtp.fc.weight"].T)
            window = torch.cat(rows)[None]
            positions = torch.arange(j + 1)[None]
            mask = torch.full((j + 1, j + 1), float("-inf"), dtype=torch.float64).triu(1)
            rotary = model.model.rotary_emb(window, positions[None].expand(3, 1, -1))
            out = layer(window, position_embeddings=rotary, attention_mask=mask[None, None],
                        position_ids=positions)  # fmt: skip
            hidden = out[0, -1:]
            token = int(model.lm_head(norm(hidden, own["mtp.norm.weight"])).argmax())
            drafted.append(token)
        return drafted

    mtp = _engine(str(qwen35_mtp), speculative="mtp").speculator.drafter.model  # type: ignore[union-attr]
    rng = random.Random(1)
    for _ in range(6):
        prompt = torch.tensor([[rng.randrange(config.vocab_size) for _ in range(12)]])
        with torch.no_grad():
            hidden = model.model(prompt).last_hidden_state[0, -1:]
            token = int(model.lm_head(hidden).argmax())
            want = reference(hidden, token, 4)
        assert mtp.draft(hidden[0].float(), token, 4) == want


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_moe_hybrid_mtp_heads_draft_and_equal_plain(tmp_path: Path, family: str) -> None:
    """The hybrid MoE families' MTP heads (a sparse layer: routed and shared experts), from
    tiny transformers folders: they load, draft, and the outputs are plain decode's."""
    save_tiny(family, tmp_path)
    add_mtp_layer(tmp_path)
    plain = _engine(str(tmp_path))
    requests = _requests(8, plain.decoder.spec.vocab_size, 4, 16)
    want = _run(plain, requests)
    spec = _engine(str(tmp_path), speculative="mtp")
    assert spec.speculator.drafter.model.decoder.spec.is_sparse(0)  # type: ignore[union-attr]
    got = _run(spec, requests)
    assert spec.speculator.counters.drafted > 0
    for rid in requests:
        assert got[rid][:4] == want[rid][:4], rid
