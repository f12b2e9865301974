"""The chunked gated delta rule (`gdn_kernel="chunked"`, lockstep/ops/triton/chunked_delta.py)
through the engine on the GPU, CUDA graphs on: graph decode equals eager decode; one request
among 64 batch-mates equals it alone; 520 decoded tokens equal a teacher-forced rescoring;
radix resumes at and between chunk boundaries equal a cold prefill; the chunked logits are
near the recurrent kernel's (the same math) but not its bits (the option reaches the kernels);
reference mode breaks batch invariance (the control). `LOCKSTEP_GPU_HYBRID_MODEL` picks the model
(default random:qwen3.5-9b). The kernels alone at the model's head sizes:
tests/kernels/test_chunked_delta_triton.py, which runs on the GPU where CUDA is present."""

from __future__ import annotations

import os

import pytest
import torch
from gpu_engines import (
    OneEngine,
    check_decode_equals_teacher_forced_scoring,
    check_graph_decode_equals_eager,
    check_one_request_among_64_batch_mates,
    random_prompts,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MODEL = os.environ.get("LOCKSTEP_GPU_HYBRID_MODEL", "random:qwen3.5-9b")
CHUNK = 32


@pytest.fixture(scope="module")
def engines():
    one = OneEngine(MODEL, gdn_kernel="chunked")
    yield one
    one.release()


@pytest.fixture
def graphed(engines):
    llm = engines.get()
    assert llm.engine.runner.graphs is not None
    assert llm.engine.decoder.linear_layout.kernel == "chunked"
    return llm


def test_graph_decode_equals_eager(engines) -> None:
    check_graph_decode_equals_eager(engines)


def test_one_request_among_64_batch_mates_equals_it_alone(graphed) -> None:
    check_one_request_among_64_batch_mates(graphed)
    assert graphed.engine.state_pool.num_free == graphed.engine.config.resolved_max_running


def test_decode_over_512_tokens_equals_teacher_forced_scoring(graphed) -> None:
    check_decode_equals_teacher_forced_scoring(graphed)


def test_radix_resumes_at_and_between_chunk_boundaries(graphed) -> None:
    """Two texts scored, 202 and 300 tokens (their prompt-end boundaries 6C = 192 and 9C =
    288 kept), then texts that share their first 6C - 1, 6C, 6C + 1, 250, 9C - 1, 9C and
    9C + 1 tokens and go on elsewhere: scored from the cache (resumed at the last kept
    boundary at or below the match, the rest recomputed) they equal the same texts scored
    cold."""
    llm = graphed
    llm.engine.flush_cache()
    base = [t for p in random_prompts(4, seed=21, longest=300) for t in p][:300]
    assert len(base) == 300
    shared = (6 * CHUNK - 1, 6 * CHUNK, 6 * CHUNK + 1, 250, 9 * CHUNK - 1, 9 * CHUNK, 9 * CHUNK + 1)
    tails = random_prompts(len(shared), seed=23, longest=40)
    texts = [
        base[:p] + [7 + i] + tail for i, (p, tail) in enumerate(zip(shared, tails, strict=True))
    ]
    llm.score([base[: 6 * CHUNK + 10], base], use_tqdm=False)
    assert llm.engine.stats()["state_snapshots"] >= 2
    warm = [llm.score([t], use_tqdm=False)[0].logprobs for t in texts]
    llm.engine.flush_cache()
    cold = [llm.score([t], use_tqdm=False)[0].logprobs for t in texts]
    assert warm == cold
    llm.engine.check_integrity()


def test_chunked_is_near_the_recurrent_kernel_but_not_its_bits(engines) -> None:
    prompt = random_prompts(1, seed=4, longest=200)[0] + [1234] * 40
    chunked = engines.get().score([prompt], use_tqdm=False)[0].logprobs
    recurrent = engines.get(gdn_kernel="recurrent").score([prompt], use_tqdm=False)[0].logprobs
    assert chunked[1:] != recurrent[1:]
    assert max(abs(a - b) for a, b in zip(chunked[1:], recurrent[1:], strict=True)) < 0.1


def test_negative_control_reference_mode_differs_among_batch_mates(engines) -> None:
    check_one_request_among_64_batch_mates(engines.get(mode="reference", gdn_kernel="recurrent"),
                                           equal=False)  # fmt: skip
