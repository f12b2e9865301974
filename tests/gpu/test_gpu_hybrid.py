"""Hybrid (Gated DeltaNet) models on the GPU through the engine, CUDA graphs on: decode
replayed from graphs (batch padding included) equals eager decode; one request among 64
batch-mates equals the request alone; decode logprobs over 512+ generated tokens equal a
teacher-forced rescoring (prefill); fast mode breaks batch invariance (the control).
`LOCKSTEP_GPU_HYBRID_MODEL` picks the model (default random:qwen3.5-9b). One engine lives at a
time: two copies of random:qwen3.5-35b-a3b (65 GiB each) do not fit one H200."""

from __future__ import annotations

import os

import pytest
import torch
from gpu_engines import OneEngine, random_prompts, sampled

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
    """11 sampled sequences (padded to the 16-row graph bucket), 40 steps each, crossing
    chunk boundaries: graph replays give the eager steps' tokens and logprobs bit for bit."""
    prompts = random_prompts(11, seed=9)
    graphed = engines.get()
    with_graphs = sampled(graphed, prompts, 40)
    assert graphed.engine.runner.graphs.num_graphs > 0
    graphed.engine.check_integrity()
    eager = engines.get(cuda_graphs=False)
    assert eager.engine.runner.graphs is None
    assert sampled(eager, prompts, 40) == with_graphs


def test_one_request_among_64_batch_mates_equals_it_alone(graphed) -> None:
    prompts = random_prompts(65, seed=3)
    together = sampled(graphed, prompts, 48)
    graphed.engine.flush_cache()
    alone = sampled(graphed, prompts[:1], 48)
    assert alone[0] == together[0]
    assert graphed.engine.state_pool.num_free == graphed.engine.config.resolved_max_running


def test_decode_over_512_tokens_equals_teacher_forced_scoring(graphed) -> None:
    prompts = random_prompts(3, seed=5, longest=100)
    outs = sampled(graphed, prompts, 520)
    graphed.engine.flush_cache()
    scores = graphed.score([p + toks for p, (toks, _) in zip(prompts, outs, strict=True)],
                           use_tqdm=False)  # fmt: skip
    for prompt, (_, logprobs), score in zip(prompts, outs, scores, strict=True):
        assert score.logprobs[len(prompt) :] == logprobs


def test_negative_control_fast_mode_differs_among_batch_mates(engines) -> None:
    fast = engines.get(mode="fast")
    prompts = random_prompts(65, seed=3)
    together = sampled(fast, prompts, 48)
    fast.engine.flush_cache()
    alone = sampled(fast, prompts[:1], 48)
    assert alone[0] != together[0]
