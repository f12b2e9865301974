"""Every supported family computes the bits recorded in tests/bit_exact_fixture.json (made by
tests/bit_exact_fixture.py on the model code before its refactor into blocks and families):
logits, K/V caches and next-token logprobs of one cold prefill, bit for bit. The controls show
the comparison can fail: the fast backend and a one-bit change of one weight both move it."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from bit_exact_fixture import CASES, FIXTURE, Case, load_case, record

from lockstep.ops import get_ops

RECORDED: dict[str, dict[str, Any]] = json.loads(FIXTURE.read_text())
BY_NAME = {case.name: case for case in CASES}


def _first_difference(got: dict[str, Any], want: dict[str, Any]) -> str:
    for position, (a, b) in enumerate(zip(got["logprobs"], want["logprobs"], strict=True)):
        if a != b:
            return f"first differing logprob at position {position}: {a} != {b} (hex float32)"
    return "every next-token logprob equal"


def test_the_fixture_records_every_case() -> None:
    assert list(RECORDED) == [case.name for case in CASES]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_bits_equal_the_recording(case: Case, tmp_path: Path) -> None:
    want = RECORDED[case.name]
    loaded, weights = load_case(case, tmp_path)
    # A changed checkpoint (another transformers drawing tests/tiny_hf.py's weights) says
    # nothing about the decoder: name it rather than report the decoder's bits as changed.
    assert weights == want.get("weights_sha256"), f"{case.name}: the checkpoint itself changed"
    got = record(case, loaded)
    assert got["tokens"] == want["tokens"]
    assert got["logits_sha256"] == want["logits_sha256"], _first_difference(got, want)
    assert got["logprobs"] == want["logprobs"]
    assert got["kv_sha256"] == want["kv_sha256"]


def test_fast_mode_differs_from_the_recording() -> None:
    case = BY_NAME["random:tiny-qwen3"]
    loaded, _ = load_case(case, Path())
    got = record(case, loaded, get_ops("cpu", "fast"))
    assert got["logits_sha256"] != RECORDED[case.name]["logits_sha256"]
    assert got["logprobs"] != RECORDED[case.name]["logprobs"]


class _OneBitFlipped:
    """A weight source with the lowest mantissa bit of one element of one tensor flipped."""

    def __init__(self, inner: Any, name: str) -> None:
        self.inner, self.name = inner, name

    def names(self) -> list[str]:
        return self.inner.names()

    def iter(self, dtype: torch.dtype, device: torch.device | str) -> Iterator[Any]:
        for name, tensor in self.inner.iter(dtype, device):
            if name == self.name:
                tensor = tensor.clone()
                tensor.view(-1)[:1].view(torch.int32).bitwise_xor_(1)
            yield name, tensor


@pytest.mark.parametrize(
    "weight", ["model.layers.1.mlp.down_proj.weight", "model.layers.0.linear_attn.A_log"]
)
def test_one_flipped_weight_bit_differs_from_the_recording(weight: str) -> None:
    case = BY_NAME["random:tiny-qwen3.5"]
    loaded, _ = load_case(case, Path())
    flipped = dataclasses.replace(loaded, weights=_OneBitFlipped(loaded.weights, weight))
    got = record(case, flipped)
    assert got["logits_sha256"] != RECORDED[case.name]["logits_sha256"]
