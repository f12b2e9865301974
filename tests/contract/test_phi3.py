"""Phi-3 on the CPU: what only Phi-3 has.

What every family shows (transformers within 1e-4 in both modes, with and without a window,
the property suite, a weight update from transformers' fused state_dict, reference mode
failing, `lockstep check --serve`) is Phi-3's rows of tests/contract/test_family_conformance.py.
Here, on a tiny Phi3ForCausalLM saved by transformers (LongRoPE over half of each head, an
original context of 128 positions): LongRoPE's two frequency sets, each at its positions,
and the contract across the position where they change.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from tests.support.invariance_harness import compute, mismatches, random_plan, reference
from tests.support.tiny_hf import save_tiny

VOCAB = 300  # tiny_hf's vocabulary

# One torch thread for tiny shapes (tests/conftest.py): bits do not depend on the count.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Engine, object]:
    """A deterministic CPU engine on a tiny Phi-3 folder, and transformers' model of it."""
    folder: Path = tmp_path_factory.mktemp("phi3")
    model = save_tiny("phi3", folder)
    config = EngineConfig(model=str(folder), device="cpu", kv_tokens=2048, dtype="float32")
    return Engine(config), model


def test_longrope_rotates_each_position_by_its_range(phi3) -> None:
    """Phi-3's LongRoPE tables (lockstep/models/rope.py): positions below the original context
    (128) rotate by transformers' short-factor frequencies, positions at or past it by the
    long ones (transformers' set for a sequence past the original context), both scaled by
    its attention factor; control: the two sets give other tables."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from lockstep.models.rope import rope_tables

    engine, model = phi3
    spec = engine.decoder.spec
    assert spec.longrope is not None and spec.longrope.original_max_position == 128
    cos, sin = rope_tables(spec, 256)
    positions = torch.arange(256, dtype=torch.float64)[:, None]
    want = {}
    for part, seq_len in (("short", None), ("long", 200)):
        inv_freq, factor = ROPE_INIT_FUNCTIONS["longrope"](model.config, "cpu", seq_len=seq_len)
        want[part] = (positions * inv_freq.double()).cos() * factor
    assert (cos[:128] - want["short"][:128]).abs().max() < 1e-5
    assert (cos[128:] - want["long"][128:]).abs().max() < 1e-5
    assert (want["short"][128:] - want["long"][128:]).abs().max() > 0.1
    assert sin.shape == cos.shape == (256, spec.rotary_dim // 2)


def test_longrope_past_the_original_context_keeps_the_contract(phi3) -> None:
    """Prompts of 130 to 170 tokens, across the original context of 128 where the frequencies
    change: any schedule gives the cold prefill's bits."""
    engine, _ = phi3
    for seed in range(6):
        rng = random.Random(seed)
        n = rng.randint(130, 170)
        tokens = [rng.randrange(VOCAB) for _ in range(n)]
        plan = random_plan(rng, n, max_mates=2)
        problems = mismatches(reference(engine, tokens), compute(engine, tokens, plan, rng))
        assert not problems, f"n={n} {plan.describe()}: " + "; ".join(problems)
