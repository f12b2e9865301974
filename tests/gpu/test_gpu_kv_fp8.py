"""The FP8 KV cache on the GPU, through the whole engine: the contract with one byte per cached
value (float8_e4m3fn at scale 1.0, lockstep/ops/fp8.py), real model shapes, CUDA graphs on.

A request decoded among 64 batch-mates (mixed prefill and decode steps, graph replays of
padded decode batches) gives the bits it gives alone; generation's logprobs equal a teacher-
forced scoring of the same 2,000+ tokens (decode tiles against prefill tiles over one cache);
graph replays equal eager steps. The negative control: reference mode (cuBLAS, SDPA) breaks the
first property on the same harness. Runs only where CUDA is present; CI runs the kernels'
part under the interpreter (test_kv_fp8_triton.py) and checks the layout the decode tiles
need by compiling for sm_90 (test_kernel_compile_sm90.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.support.invariance_harness import generate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Dense bf16 weights, FP8 weights (block-wise), and a mixture of experts.
MODELS = ["random:qwen3-8b", "random:qwen3-8b-fp8", "random:qwen3-30b-a3b"]


def _engine(model: str, mode: str = "deterministic", **options):
    from lockstep.config import EngineConfig
    from lockstep.engine.engine import Engine

    settings = {"kv_tokens": 160_000, "max_model_len": 4096, "max_running": 128} | options
    return Engine(EngineConfig(model=model, mode=mode, device="cuda", dtype="bfloat16",
                               kv_dtype="fp8_e4m3", **settings))  # fmt: skip


def _requests(engine, count: int, seed: int) -> dict:
    from lockstep.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = engine.decoder.spec.vocab_size
    return {
        f"r{i}": (
            [rng.randrange(vocab) for _ in range(rng.randint(200, 1500))],
            SamplingParams(
                max_tokens=32, temperature=0.0 if i % 2 else 1.0, seed=i, ignore_eos=True
            ),  # fmt: skip
        )
        for i in range(count)
    }


def _differ_alone(engine, requests: dict, checked: list[str]) -> list[str]:
    together = generate(engine, requests)
    differing = []
    for rid in checked:
        engine.flush_cache()
        if generate(engine, {rid: requests[rid]})[rid] != together[rid]:
            differing.append(rid)
    engine.check_integrity()
    return differing


@pytest.mark.parametrize("model", MODELS)
def test_decoded_among_64_batch_mates_equals_alone(model: str) -> None:
    engine = _engine(model)
    assert engine.runner.graphs is not None
    requests = _requests(engine, 65, seed=3)
    assert _differ_alone(engine, requests, ["r0", "r1", "r2", "r3", "r64"]) == []
    del engine
    torch.cuda.empty_cache()


def test_negative_control_reference_mode_differs_among_batch_mates() -> None:
    engine = _engine("random:qwen3-0.6b", mode="reference")
    requests = _requests(engine, 65, seed=3)
    assert _differ_alone(engine, requests, ["r0", "r1", "r2", "r3", "r64"]) != []
    del engine
    torch.cuda.empty_cache()


def test_generation_logprobs_equal_scoring_over_2048_tokens() -> None:
    from lockstep.engine.llm import LLM
    from lockstep.engine.sampling_params import SamplingParams

    llm = LLM("random:qwen3-8b", device="cuda", dtype="bfloat16", kv_dtype="fp8_e4m3",
              kv_tokens=65_536, max_model_len=4096)  # fmt: skip
    rng = random.Random(4)
    vocab = llm.engine.decoder.spec.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (7, 600)]
    params = [SamplingParams(max_tokens=2048, temperature=t, seed=2, ignore_eos=True)
              for t in (0.0, 1.0)]  # fmt: skip
    outs = llm.generate(prompts, params, use_tqdm=False)
    scores = llm.score([o.prompt_token_ids + o.token_ids for o in outs], use_tqdm=False)
    for out, score in zip(outs, scores, strict=True):
        assert len(out.token_ids) == 2048
        assert score.logprobs[len(out.prompt_token_ids) :] == out.logprobs
    del llm
    torch.cuda.empty_cache()


def test_cuda_graph_decode_equals_eager() -> None:
    results = []
    for graphs in (True, False):
        engine = _engine("random:qwen3-0.6b", cuda_graphs=graphs, max_running=16)
        assert (engine.runner.graphs is not None) == graphs
        results.append(generate(engine, _requests(engine, 11, seed=9)))
        if graphs:
            assert engine.runner.graphs.num_graphs > 0
        del engine
        torch.cuda.empty_cache()
    assert results[0] == results[1]
