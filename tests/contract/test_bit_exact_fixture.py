"""Every supported family computes the bits recorded in tests/support/bit_exact_fixture.json (made by
tests/support/bit_exact_fixture.py on the model code before its refactor into blocks and families):
logits, K/V caches and next-token logprobs of one cold prefill, bit for bit. The controls show
the comparison can fail: the stock backend and a one-bit change of one weight both move it.

One child process computes every case and control (`record_pinned`: torch pinned to the CPU
kernels the recording used), about 20 s on two cores."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.bit_exact_fixture import CASES, FIXTURE, FLIPPED, Case, record_pinned

RECORDED: dict[str, dict[str, Any]] = json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def computed() -> dict[str, Any]:
    return record_pinned()


def _first_difference(got: dict[str, Any], want: dict[str, Any]) -> str:
    for position, (a, b) in enumerate(zip(got["logprobs"], want["logprobs"], strict=True)):
        if a != b:
            return f"first differing logprob at position {position}: {a} != {b} (hex float32)"
    return "every next-token logprob equal"


def test_the_fixture_records_every_case() -> None:
    assert list(RECORDED) == [case.name for case in CASES]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_bits_equal_the_recording(case: Case, computed: dict[str, Any]) -> None:
    want, got = RECORDED[case.name], computed["cases"][case.name]
    # A changed checkpoint (another transformers drawing tests/support/tiny_hf.py's weights) says
    # nothing about the decoder: name it rather than report the decoder's bits as changed.
    assert got.get("weights_sha256") == want.get("weights_sha256"), "the checkpoint changed"
    assert got["tokens"] == want["tokens"]
    assert got["logits_sha256"] == want["logits_sha256"], _first_difference(got, want)
    assert got["logprobs"] == want["logprobs"]
    assert got["kv_sha256"] == want["kv_sha256"]


def test_reference_mode_differs_from_the_recording(computed: dict[str, Any]) -> None:
    got, want = computed["controls"]["reference mode"], RECORDED["random:tiny-qwen3"]
    assert got["logits_sha256"] != want["logits_sha256"]
    assert got["logprobs"] != want["logprobs"]


@pytest.mark.parametrize("weight", FLIPPED)
def test_one_flipped_weight_bit_differs_from_the_recording(
    weight: str, computed: dict[str, Any]
) -> None:
    got = computed["controls"][f"flipped {weight}"]
    assert got["logits_sha256"] != RECORDED["random:tiny-qwen3.5"]["logits_sha256"]
