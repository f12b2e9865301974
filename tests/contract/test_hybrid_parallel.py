"""Hybrid (Gated DeltaNet) models under tensor and expert parallelism on the CPU (gloo, one
process per rank): the same bits at every degree (lockstep/parallel/sharding.py,
lockstep/parallel/linear_states.py).

On tiny Qwen3.5 and Qwen3.5-MoE folders written by transformers (3 Gated DeltaNet layers,
then gated full attention; Qwen3.5 with 2 key heads serving 4 value heads, the MoE one with 4
serving 8, 8 experts, top 2, and a gated shared expert):

* TP 2 (Qwen3.5, Qwen3-Next's grouped projections), TP 2, EP 2 and TP 4 (Qwen3.5-MoE) give
  TP 1's bits under the chunked reduction: logits, every KV head, the final linear state of every head and every
  chunk-boundary snapshot (sequences past two chunks). Each rank holds 1/tp of the linear
  heads' state.
* The property suite at TP 2 (EP 2) through the engine's requests, whose states live in the
  pools of every rank: batch-mates and chunked prefill (24-token steps), prefix hits resumed
  from the snapshots of every rank, each request equal to TP 1 alone on a cold cache; decode
  equal to rescoring.
* Negative controls: reference mode at TP 2, TP 1's default reduction and TP 2 under "ranks"
  each give other bits.
* A degree that does not divide the linear-attention key heads, and speculative decoding at
  tp > 1 (its rollback is rank 0's), are refused in one line.
* `lockstep check --serve` against `lockstep serve --tp 2 --ep 2` on a Qwen3.5-MoE folder
  passes every scenario but restart, exactly.

A rank killed mid-run: tests/server/test_tensor_parallel_server.py (random:tiny-qwen3.5-moe
among its models).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from lockstep import LLM
from lockstep.errors import ConfigError
from lockstep.models.linear_attention import LinearLayout, LinearState, LinearStatePool
from lockstep.models.presets import PRESETS
from lockstep.parallel.linear_states import StateWire, wire_states
from tests.support.invariance_harness import mismatches, reference
from tests.support.parallel_cases import (
    check_request_cases,
    differing,
    engines_at,
    llm_at,
    random_sequences,
)
from tests.support.tiny_hf import check_serve_passes_every_scenario, save_tiny

# Each family's folder options and degrees (tests/support/parallel_cases.py's DEGREES): the
# Qwen3.5-MoE folder has 4 key heads serving 8 value heads, so that TP 4 splits them too.
FAMILIES = {
    "qwen3_5": ({}, (1, 2)),
    "qwen3_5_moe": ({"linear_num_key_heads": 4, "linear_num_value_heads": 8}, (1, 2, "ep2", 4)),
}
STEP_TOKENS = 24  # max_batch_tokens of every engine here: prompts prefill in chunks


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    found = {}
    for family, (options, _) in FAMILIES.items():
        found[family] = tmp_path_factory.mktemp(family)
        save_tiny(family, found[family], **options)
    return found


@pytest.fixture(scope="module", params=list(FAMILIES))
def hybrid(request, folders: dict[str, Path]):
    """A family's engines at TP 1 (chunked) and its other degrees, and those degrees."""
    family = request.param
    degrees = FAMILIES[family][1]
    with engines_at(folders[family], degrees, max_batch_tokens=STEP_TOKENS) as found:
        yield degrees[1:], found


def test_tp_2_4_and_ep_2_give_the_logits_kv_and_states_of_tp_1(hybrid) -> None:
    degrees, engines = hybrid
    sequences = random_sequences(4, 80, seed=1)
    assert max(map(len, sequences)) > 64  # two chunk boundaries: snapshots at 32 and 64
    full = engines[1].decoder.linear_layout
    for degree in degrees:
        tp = engines[degree].config.tp
        layout = engines[degree].decoder.linear_layout  # each rank's share of the heads
        assert layout.num_key_heads * tp == full.num_key_heads, degree
        assert layout.num_value_heads * tp == full.num_value_heads, degree
        assert differing(engines[1], engines[degree], sequences) == [], degree
    got = reference(engines[degrees[-1]], max(sequences, key=len))
    assert got.state and sorted(got.snapshots) == [32, 64], "no linear state compared"


def test_position_invariance_through_requests_at_tp_2_and_ep_2(hybrid) -> None:
    """The requests' property case; then its control: rank 0 resumes its states without the
    workers filling their slots alike, and the case fails (so it does exercise every rank's
    states and resumes)."""
    degrees, engines = hybrid
    for degree in (d for d in degrees if d != 4):
        for seed in (1, 2):
            check_request_cases(engines[degree], engines[1], seed)
    engine = engines[2]
    scheduler, mirrored = engine.scheduler, engine.scheduler.new_linear_state
    scheduler.new_linear_state = partial(LinearState.resume, engine.decoder.linear_layout,
                                         pool=engine.state_pool, keep_all=False)  # fmt: skip
    try:
        with pytest.raises(AssertionError, match="differ from TP 1 alone"):
            check_request_cases(engine, engines[1], 3)
    finally:
        scheduler.new_linear_state = mirrored
        engine.flush_cache()  # its snapshots were captured from the workers' stale slots


def test_states_outside_the_pools_are_refused_at_tp_2() -> None:
    """A tensor-parallel step of states outside the engine's pools (tensors on rank 0 only,
    as the decoder-level harness makes) is refused before any rank computes, rather than
    computed from whatever the workers' slots hold; a pooled state crosses as its slot."""
    layout = LinearLayout.of(PRESETS["tiny-qwen3.5"].spec, torch.device("cpu"), tp=2)
    with pytest.raises(ValueError, match="needs the engine's pooled linear states"):
        wire_states([LinearState.resume(layout, None)])
    pooled = LinearState.resume(layout, None, LinearStatePool(layout, 2), keep_all=False)
    assert wire_states([pooled]) == [StateWire(pooled.slot, 0, {}, {})]


def test_qwen3_next_grouped_projections_at_tp_2_give_the_bits_of_tp_1(tmp_path: Path) -> None:
    """Qwen3-Next stores its Gated DeltaNet inputs grouped by key head: reordered, then
    sharded as Qwen3.5's; TP 2 gives TP 1's bits, states and snapshots included."""
    save_tiny("qwen3_next", tmp_path)
    single, two = llm_at(tmp_path, 1, tp_reduction="chunked"), llm_at(tmp_path, 2)
    try:
        assert two.engine.decoder.spec.linear.grouped_projections
        assert differing(single.engine, two.engine, random_sequences(2, 70, seed=4)) == []
    finally:
        single.close()
        two.close()


def test_controls_other_modes_and_reductions_change_bits(folders: dict[str, Path]) -> None:
    """The chunked reduction and the deterministic ops are what make the degrees agree:
    reference mode at TP 2, TP 1's default reduction and TP 2 under "ranks" each differ
    from TP 1 under the chunked one on the Qwen3.5-MoE folder; and the requests' check
    (`check_request_cases`) fails TP 1's default reduction against the chunked one."""
    folder = folders["qwen3_5_moe"]
    sequences = random_sequences(3, 48, seed=2)
    options = {
        "tp=2 reference": (2, {"mode": "reference"}),
        "tp=1 default": (1, {}),
        "tp=2 ranks": (2, {"tp_reduction": "ranks"}),
    }
    chunked = llm_at(folder, 1, tp_reduction="chunked")
    try:
        expected = [reference(chunked.engine, tokens) for tokens in sequences]
        for name, (tp, extra) in options.items():
            llm = llm_at(folder, tp, **extra)
            try:
                got = [reference(llm.engine, tokens) for tokens in sequences]
                if name == "tp=1 default":
                    with pytest.raises(AssertionError, match="differ from TP 1 alone"):
                        check_request_cases(llm.engine, chunked.engine, 1)
            finally:
                llm.close()
            assert any(mismatches(a, b) for a, b in zip(expected, got, strict=True)), name
    finally:
        chunked.close()


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"tp": 4}, "tp=4 is invalid for random:tiny-qwen3.5 (4 heads, 2 KV heads): it does "
                    "not divide the 2 linear-attention key heads; degrees that work: 1, 2"),
        ({"tp": 2, "speculative": "ngram"}, "speculative='ngram' is invalid for "
                                            "random:tiny-qwen3.5 at tp=2: a hybrid model's "),
    ],
)  # fmt: skip
def test_bad_hybrid_parallel_settings_are_refused_in_one_line(options, needle) -> None:
    with pytest.raises(ConfigError) as info:
        LLM("random:tiny-qwen3.5", device="cpu", kv_tokens=256, **options)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(needle), message


@pytest.mark.slow
def test_check_serve_passes_at_tp_2_ep_2(tmp_path: Path) -> None:
    """The one `check --serve` run of the parallel suites: a hybrid MoE folder at TP 2 / EP 2
    exercises the routed experts of tests/contract/test_moe_parallel.py's folders, the
    tensor-parallel attention and the linear states at once."""
    check_serve_passes_every_scenario(
        "qwen3_5_moe", tmp_path, serve_args=("--tp", "2", "--ep", "2")
    )
