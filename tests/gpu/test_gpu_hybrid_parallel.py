"""Hybrid (Gated DeltaNet) models under tensor and expert parallelism over NCCL, one GPU per
rank: the CPU suite's checks (tests/contract/test_hybrid_parallel.py) on CUDA in bf16, with the
Triton linear-attention kernels and each rank's state pools on its own GPU.

* `random:tiny-qwen3.5` at TP 2 and `random:tiny-qwen3.5-moe` at TP 2 and EP 2 give TP 1's
  chunked bits (TP 1 without CUDA graphs: the chunked experts read counts on the host):
  logits, every KV head, the final linear state of every head and every boundary snapshot.
* The property case through the engine's requests (batch-mates, chunked prefill, prefix hits
  resumed from every rank's snapshots, decode against rescoring) at those degrees.
* Control: reference mode at TP 2 differs from TP 1.

Needs two CUDA devices; on fewer it skips, naming the count.
Run: `pytest -q tests/gpu/test_gpu_hybrid_parallel.py` on a 2-, 4- or 8-GPU host.
"""

from __future__ import annotations

import pytest
import torch

from lockstep import LLM
from tests.support.parallel_cases import check_request_cases, differing, random_sequences

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2,
        reason=f"needs 2 CUDA devices, {torch.cuda.device_count()} visible",
    ),
]

MODELS = {"random:tiny-qwen3.5": (2,), "random:tiny-qwen3.5-moe": (2, "ep2")}


def _llm(model: str, tp: int, **options) -> LLM:
    options.setdefault("kv_tokens", 4096)
    options.setdefault("max_batch_tokens", 64)  # prompts prefill in chunks
    return LLM(model, device="cuda", dtype="bfloat16", tp=tp, **options)


@pytest.fixture(scope="module", params=list(MODELS))
def engines(request):
    model = request.param
    llms = {}
    try:
        llms[1] = _llm(model, 1, tp_reduction="chunked", cuda_graphs=False)
        for degree in MODELS[model]:
            llms[degree] = _llm(model, 2, **({"ep": 2} if degree == "ep2" else {}))
        yield model, {name: llm.engine for name, llm in llms.items()}
    finally:
        for llm in llms.values():
            llm.close()


def test_tp_2_and_ep_2_give_the_bits_of_tp_1(engines) -> None:
    model, found = engines
    sequences = random_sequences(4, 200, seed=1)
    for degree in MODELS[model]:
        assert differing(found[1], found[degree], sequences) == [], degree


def test_position_invariance_through_requests(engines) -> None:
    model, found = engines
    for degree in MODELS[model]:
        for seed in range(4):
            check_request_cases(found[degree], found[1], seed)


def test_reference_mode_at_tp_2_changes_bits(engines) -> None:
    model, found = engines
    llm = _llm(model, 2, mode="reference")
    try:
        assert differing(found[1], llm.engine, random_sequences(3, 200, seed=2))
    finally:
        llm.close()
