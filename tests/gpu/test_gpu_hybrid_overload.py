"""The hybrid overload run (tests/contract/test_hybrid_overload.py) on the GPU: 300 requests
at once against a KV pool of 512 tokens, 8 running requests and 8 snapshot slots, with
`LOCKSTEP_GPU_HYBRID_MODEL` (default random:qwen3.5-9b) in bfloat16 with CUDA graphs. Every
request must complete, equal itself alone on a cold cache bit for bit, and leave every pool
free; the CPU file's negative controls show the checks can fail."""

from __future__ import annotations

import os

import pytest
import torch

from tests.contract.test_hybrid_overload import check_300_requests_under_small_budgets

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MODEL = os.environ.get("LOCKSTEP_GPU_HYBRID_MODEL", "random:qwen3.5-9b")


def test_300_requests_under_small_budgets_on_the_gpu() -> None:
    check_300_requests_under_small_budgets({"model": MODEL, "device": "cuda", "dtype": "bfloat16"})
    torch.cuda.empty_cache()
