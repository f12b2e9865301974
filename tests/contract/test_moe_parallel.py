"""Mixture-of-experts models under tensor and expert parallelism on the CPU (gloo, one process
per rank): the same bits at every degree (lockstep/parallel/experts.py).

On a tiny Qwen3-MoE folder written by transformers (8 experts of width 40, top 4, so that a
token's experts usually live on both expert-parallel ranks; dense and sparse layers):

* TP 2, TP 4 and EP 2 give TP 1's bits (the chunked reduction) for logits and every KV head.
* The property suite at TP 2 and EP 2: random prefix hits, partitions and batch-mates equal
  one cold prefill, at that degree and at TP 1; generated logprobs equal the rescored ones.
* Negative controls: TP 2 under the "ranks" reduction, TP 1's default one-call experts, fast
  mode at TP 2, and EP 2 under "all_reduce" (each rank combines its own experts, the library
  sums the ranks: another order of adding a token's four outputs) each give other bits.
* A tiny DeepSeek-V3 folder (multi-head latent attention with a q LoRA, grouped sigmoid
  routing with a correction bias, an ungated shared expert, a dense first layer): TP 2 and
  EP 2 give TP 1's bits, and the property suite holds at TP 2; TP 1's default reduction
  differs (the control).
* EP without experts, or an EP degree that is not --tp, is refused in one line.
* A worker killed mid-run ends the engine with the one-line `TensorParallelError`.
* `lockstep check --serve` against `lockstep serve --tp 2 --ep 2`: on a Qwen3.5-MoE folder,
  whose routed experts are these plus linear states (tests/contract/test_hybrid_parallel.py).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from lockstep import LLM, SamplingParams
from lockstep.errors import ConfigError
from lockstep.parallel.group import TensorParallelError
from tests.support.invariance_harness import (
    generation_scoring_mismatches,
    mismatches,
    reference,
)
from tests.support.parallel_cases import (
    check_property_cases,
    differing,
    engines_at,
    llm_at,
    random_sequences,
)
from tests.support.tiny_hf import save_tiny


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3_moe")
    save_tiny("qwen3_moe", folder, num_experts_per_tok=4)
    return folder


@pytest.fixture(scope="module")
def engines(moe_folder: Path):
    """The Qwen3-MoE folder at TP 1 (chunked), TP 2 and EP 2: 5 processes."""
    with engines_at(moe_folder, (1, 2, "ep2")) as found:
        yield found


@pytest.mark.parametrize("degree", [2, "ep2"])
def test_tp_2_and_ep_2_give_the_logits_and_kv_of_tp_1(engines, degree) -> None:
    sequences = random_sequences(4, 48, seed=1)
    assert engines[degree].decoder.spec.moe.top_k == 4
    assert differing(engines[1], engines[degree], sequences) == []


@pytest.mark.parametrize("degree", [2, "ep2"])
def test_position_invariance_at_tp_2_and_ep_2(engines, degree) -> None:
    """The property suite's case: random prefix hits, partitions and batch-mates equal one
    cold prefill at this degree and at TP 1."""
    check_property_cases(engines[degree], engines[1], range(8))


@pytest.mark.parametrize("degree", [2, "ep2"])
def test_decode_equals_rescoring(engines, degree) -> None:
    params = SamplingParams(temperature=0.9, seed=7, max_tokens=10, logprobs=0, ignore_eos=True)
    prompts = random_sequences(3, 12, seed=4)
    assert generation_scoring_mismatches(engines[degree], prompts, params) == []
    engines[degree].check_integrity()


def test_tp_4_gives_the_bits_of_tp_1(engines, moe_folder: Path) -> None:
    four = llm_at(moe_folder, 4)
    try:
        assert differing(engines[1], four.engine, random_sequences(2, 32, seed=5)) == []
    finally:
        four.close()


def test_controls_other_reductions_and_combines_change_bits(engines, moe_folder: Path) -> None:
    """The chunked rule and the fixed combine are what make the degrees agree: TP 2 under
    "ranks" or "all_reduce", TP 1's default one-call experts, reference mode at TP 2 and EP 2
    under "ranks" or "all_reduce" each differ from TP 1. And the combine alone: at 2 ranks
    the library's SUM adds two partials as "ranks" does (TP 2 gives the same bits under
    both), so EP 2's two reductions differ only in how a token's four expert outputs are
    combined (in rank order, or per rank then summed), which changes bits."""
    sequences = random_sequences(3, 48, seed=2)
    options = {
        "tp=2 ranks": (2, {"tp_reduction": "ranks"}),
        "tp=2 all_reduce": (2, {"tp_reduction": "all_reduce"}),
        "tp=1 default": (1, {}),
        "tp=2 reference": (2, {"mode": "reference"}),
        "ep=2 ranks": (2, {"ep": 2, "tp_reduction": "ranks"}),
        "ep=2 all_reduce": (2, {"ep": 2, "tp_reduction": "all_reduce"}),
    }
    got = {}
    for name, (tp, extra) in options.items():
        llm = llm_at(moe_folder, tp, **extra)
        try:
            got[name] = [reference(llm.engine, tokens) for tokens in sequences]
        finally:
            llm.close()
    chunked = [reference(engines[1], tokens) for tokens in sequences]

    def differ(a: str | list, b: str) -> bool:
        first = chunked if isinstance(a, list) else got[a]
        return any(mismatches(x, y) for x, y in zip(first, got[b], strict=True))

    for name in options:
        assert differ(chunked, name), f"{name} gave the TP 1 bits"
    assert not differ("tp=2 ranks", "tp=2 all_reduce")
    assert differ("ep=2 ranks", "ep=2 all_reduce")


def test_a_killed_rank_ends_the_engine_with_one_line(moe_folder: Path) -> None:
    llm = llm_at(moe_folder, 2)
    try:
        engine = llm.engine
        params = SamplingParams(max_tokens=50, ignore_eos=True)
        engine.add_request("r", [1, 2, 3], params)
        engine.step()
        (pid,) = engine.workers.pids
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TensorParallelError) as info:
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - start < 10
        message = str(info.value)
        assert "\n" not in message
        assert f"rank 1 (pid {pid}) exited with status -9" in message
    finally:
        llm.close()


@pytest.mark.parametrize(
    ("model", "options", "needle"),
    [
        (None, {"ep": 2, "tp": 1}, "ep=2 is invalid with tp=1: expert parallelism spreads "),
        (None, {"ep": 9, "tp": 1}, "ep=9 is invalid: expected an integer from 1 to 8"),
        ("random:tiny", {"ep": 2, "tp": 2}, "ep=2 is invalid for random:tiny: it has no routed "),
    ],
)
def test_bad_expert_parallel_settings_are_refused_in_one_line(model, options, needle) -> None:
    with pytest.raises(ConfigError) as info:
        LLM(model, device="cpu", kv_tokens=64, **options)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(needle)


@pytest.fixture(scope="module")
def deepseek_engines(tmp_path_factory: pytest.TempPathFactory):
    """A tiny DeepSeek-V3 folder at TP 1 (chunked and default), TP 2 and EP 2."""
    folder = tmp_path_factory.mktemp("deepseek_v3")
    save_tiny("deepseek_v3", folder)
    with engines_at(folder) as found:
        yield found


def test_deepseek_v3_at_tp_2_and_ep_2_gives_the_bits_of_tp_1(deepseek_engines) -> None:
    engines = deepseek_engines
    spec = engines[2].decoder.spec
    assert spec.mla is not None and spec.moe is not None and spec.moe.shared_expert_size
    assert spec.moe.groups > 1 and spec.moe.correction_bias
    sequences = random_sequences(3, 40, seed=6)
    for degree in (2, "ep2"):
        assert differing(engines[1], engines[degree], sequences) == [], degree
    # One latent row per token and layer on every rank, as at TP 1.
    assert engines[2].pool.k_cache(0).shape[1:] == (1, spec.mla.cache_width)
    assert differing(engines[1], engines["default"], sequences), "the control gave TP 1's bits"


def test_deepseek_v3_position_invariance_at_tp_2(deepseek_engines) -> None:
    check_property_cases(deepseek_engines[2], deepseek_engines[1], range(100, 106))


def test_training_refuses_the_chunked_experts_in_one_line(moe_folder: Path) -> None:
    """The training module has no differentiable view of the chunked experts: refused."""
    from lockstep.training import LockstepForCausalLM

    with pytest.raises(ValueError) as info:
        LockstepForCausalLM.from_pretrained(str(moe_folder), tp_reduction="chunked")
    message = str(info.value)
    assert "\n" not in message
    assert message.endswith("train with the TP 1 reduction only; expected tp_reduction='ranks'")
