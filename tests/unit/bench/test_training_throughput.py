"""scripts/training_throughput.py on the CPU with a tiny model: it times both implementations
and reports the training module's logprobs equal to LLM.score bit for bit; the control, the
module on the stock backend, is reported unequal. `--profile` reports one step's forward and
backward apart and its top ops, each op's total the sum of its two phases."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "training_throughput.py"
ARGS = ["--device", "cpu", "--model", "random:tiny-qwen3", "--batch", "2", "--seq-len", "24",
        "--steps", "1", "--warmup", "0"]  # fmt: skip


def _script():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("training_throughput", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_throughput_script_reports_rates_and_the_bitwise_check(
    capsys: pytest.CaptureFixture[str],
) -> None:
    script = _script()
    doc = script.main([*ARGS, "--profile", "--profile-top", "5"])
    printed = capsys.readouterr().out.strip().splitlines()
    assert json.loads(printed[-1]) == doc  # the JSON document is the last line
    profile = doc["profile"]
    assert profile["forward_s"] > 0 and profile["backward_s"] > 0
    assert profile["forward_kernel_ms"] > 0 and profile["backward_kernel_ms"] > 0
    top = profile["top_kernels"]
    assert len(top) == 5 and all(r["calls"] > 0 for r in top)
    assert [r["total_ms"] for r in top] == sorted((r["total_ms"] for r in top), reverse=True)
    for r in top:
        assert abs(r["total_ms"] - r["forward_ms"] - r["backward_ms"]) <= 0.002
        assert any(r["kernel"][:90] in line for line in printed)
    assert doc["bitwise_equal_llm_score"] is True and doc["max_abs_diff_llm_score"] == 0.0
    assert doc["tokens"] == 48
    for name in ("lockstep", "transformers"):
        assert doc["implementations"][name]["tokens_per_s"] > 0
    # The control: the stock backend's logprobs are not the engine's bits.
    stock = script.main([*ARGS, "--mode", "reference"])
    assert stock["bitwise_equal_llm_score"] is False and stock["max_abs_diff_llm_score"] > 0
    assert "profile" not in stock  # profiled only when asked
