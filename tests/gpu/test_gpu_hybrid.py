"""Hybrid (Gated DeltaNet) models on the GPU through the engine, CUDA graphs on: decode
replayed from graphs (batch padding included) equals eager decode; one request among 64
batch-mates equals the request alone; decode logprobs over 512+ generated tokens equal a
teacher-forced rescoring (prefill); reference mode breaks batch invariance (the control).
`LOCKSTEP_GPU_HYBRID_MODEL` picks the model (default random:qwen3.5-9b). One engine lives at a
time: two copies of random:qwen3.5-35b-a3b (65 GiB each) do not fit one H200."""

from __future__ import annotations

import os

import pytest
import torch
from gpu_engines import (
    OneEngine,
    check_decode_equals_teacher_forced_scoring,
    check_graph_decode_equals_eager,
    check_one_request_among_64_batch_mates,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MODEL = os.environ.get("LOCKSTEP_GPU_HYBRID_MODEL", "random:qwen3.5-9b")


@pytest.fixture(scope="module")
def engines():
    one = OneEngine(MODEL)
    yield one
    one.release()


@pytest.fixture
def graphed(engines):
    llm = engines.get()
    assert llm.engine.runner.graphs is not None
    return llm


def test_graph_decode_equals_eager(engines) -> None:
    check_graph_decode_equals_eager(engines)


def test_one_request_among_64_batch_mates_equals_it_alone(graphed) -> None:
    check_one_request_among_64_batch_mates(graphed)
    assert graphed.engine.state_pool.num_free == graphed.engine.config.resolved_max_running


def test_decode_over_512_tokens_equals_teacher_forced_scoring(graphed) -> None:
    check_decode_equals_teacher_forced_scoring(graphed)


def test_negative_control_reference_mode_differs_among_batch_mates(engines) -> None:
    check_one_request_among_64_batch_mates(engines.get(mode="reference"), equal=False)
