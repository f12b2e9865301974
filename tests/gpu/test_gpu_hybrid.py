"""Hybrid (Gated DeltaNet) models on the GPU through the engine, CUDA graphs on: decode
replayed from graphs (batch padding included) equals eager decode; one request among 64
batch-mates equals the request alone; decode logprobs over 512+ generated tokens equal a
teacher-forced rescoring (prefill); fast mode breaks batch invariance (the control).
`LOCKSTEP_GPU_HYBRID_MODEL` picks the model (default random:qwen3.5-9b). One engine lives at a
time: two copies of random:qwen3.5-35b-a3b (65 GiB each) do not fit one H200."""

from __future__ import annotations

import os
import random

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MODEL = os.environ.get("LOCKSTEP_GPU_HYBRID_MODEL", "random:qwen3.5-9b")


def _llm(mode: str = "deterministic", **options):
    from lockstep.config import EngineConfig
    from lockstep.engine.engine import Engine
    from lockstep.engine.llm import LLM

    config = dict(model=MODEL, mode=mode, device="cuda", dtype="bfloat16", kv_tokens=65536,
                  max_model_len=4096, max_running=96)  # fmt: skip
    config.update(options)
    llm = LLM.__new__(LLM)
    llm.engine = Engine(EngineConfig(**config))
    llm.tokenizer, llm._counter = llm.engine.tokenizer, 0
    return llm


def _prompts(n: int, seed: int, longest: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 30000) for _ in range(rng.randint(1, longest))] for _ in range(n)]


def _run(llm, prompts, max_tokens: int, seed: int = 1) -> list[tuple[list, list]]:
    from lockstep.engine.sampling_params import SamplingParams

    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + i,
                             ignore_eos=True) for i in range(len(prompts))]  # fmt: skip
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.token_ids, o.logprobs) for o in outs]


def _free(llm) -> None:
    del llm.engine
    torch.cuda.empty_cache()


class _OneEngine:
    """The module's engine: `get(**options)` returns the live one when its options match,
    else frees it and builds one with those options."""

    def __init__(self) -> None:
        self.llm, self.options = None, None

    def get(self, **options):
        if self.llm is None or self.options != options:
            self.release()
            self.llm, self.options = _llm(**options), options
        return self.llm

    def release(self) -> None:
        if self.llm is not None:
            _free(self.llm)
            self.llm = None


@pytest.fixture(scope="module")
def engines():
    one = _OneEngine()
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
    prompts = _prompts(11, seed=9)
    graphed = engines.get()
    with_graphs = _run(graphed, prompts, 40)
    assert graphed.engine.runner.graphs.num_graphs > 0
    graphed.engine.check_integrity()
    eager = engines.get(cuda_graphs=False)
    assert eager.engine.runner.graphs is None
    assert _run(eager, prompts, 40) == with_graphs


def test_one_request_among_64_batch_mates_equals_it_alone(graphed) -> None:
    prompts = _prompts(65, seed=3)
    together = _run(graphed, prompts, 48)
    graphed.engine.flush_cache()
    alone = _run(graphed, prompts[:1], 48)
    assert alone[0] == together[0]
    assert graphed.engine.state_pool.num_free == graphed.engine.config.resolved_max_running


def test_decode_over_512_tokens_equals_teacher_forced_scoring(graphed) -> None:
    prompts = _prompts(3, seed=5, longest=100)
    outs = _run(graphed, prompts, 520)
    graphed.engine.flush_cache()
    scores = graphed.score([p + toks for p, (toks, _) in zip(prompts, outs, strict=True)],
                           use_tqdm=False)  # fmt: skip
    for prompt, (_, logprobs), score in zip(prompts, outs, scores, strict=True):
        assert score.logprobs[len(prompt) :] == logprobs


def test_negative_control_fast_mode_differs_among_batch_mates(engines) -> None:
    fast = engines.get(mode="fast")
    prompts = _prompts(65, seed=3)
    together = _run(fast, prompts, 48)
    fast.engine.flush_cache()
    alone = _run(fast, prompts[:1], 48)
    assert alone[0] != together[0]
