"""Hybrid linear-attention models (Qwen3.5: Gated DeltaNet + gated full attention) on the CPU:
what only hybrids have.

What every family shows is Qwen3.5's row of tests/contract/test_family_conformance.py, on a
tiny folder saved by transformers: transformers within 1e-4 in both modes, and the
position-invariance contract for the linear layers' states (docs/design.md, "Linear
attention"): logits, K/V, the final linear state and every chunk-boundary snapshot equal one
cold full prefill bitwise under random schedules, prefix hits of every length 1..3C with
uncached tails of 1..40 tokens, every chunk size, decode versus scoring, preemption, bf16;
reference mode failing. Here, on the tiny preset: the radix snapshots (which boundaries are
kept, what a hit resumes from and reports, what a step captures), a second process, the
refusals, and the control that the gated delta rule alone is what the contract sees (the
stock formulation, transformers': recurrent for one-token steps, chunked from each step's
first row otherwise, must fail).
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

from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.engine.llm import LLM
from lockstep.engine.sampling_params import SamplingParams
from lockstep.errors import ModelLoadError
from lockstep.models.linear_attention import CHUNK
from tests.support.invariance_harness import compute, mismatches, random_plan, reference
from tests.support.tiny_hf import save_tiny

HYBRID = "random:tiny-qwen3.5"
VOCAB = 512  # random:tiny-qwen3.5


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


# ---------------------------------------------------------------- layouts and refusals


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


# ---------------------------------------------------------------- radix snapshots


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
    """The deterministic backend with only its gated delta rule replaced by the stock one
    fails the property: the suite sees the linear layers' arithmetic (the conformance row's
    reference-mode control changes every op at once)."""
    from lockstep.ops.cpu_deterministic import CpuDeterministicOps
    from lockstep.ops.torch_stock import TorchRowOps

    class StockRule(CpuDeterministicOps):
        gated_delta_rule = TorchRowOps.gated_delta_rule

    engine = _engine()
    engine.decoder.ops = StockRule()
    assert _failures(engine) > 0, "the stock delta rule passed: the check is blind"
