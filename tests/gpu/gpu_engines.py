"""Helpers the GPU model suites share (tests/gpu/test_gpu_hybrid.py, test_gpu_deepseek.py): an
engine behind `LLM` built from a config dict, random prompts, sampled generation, and one live
engine at a time (two copies of a large model do not fit one H200)."""

from __future__ import annotations

import random

import torch


def make_llm(model: str, mode: str = "deterministic", max_model_len: int = 4096, **options):
    """An `LLM` over a CUDA bf16 engine of `model` (65,536 KV tokens, 96 running)."""
    from lockstep.config import EngineConfig
    from lockstep.engine.engine import Engine
    from lockstep.engine.llm import LLM

    config = dict(model=model, mode=mode, device="cuda", dtype="bfloat16", kv_tokens=65536,
                  max_model_len=max_model_len, max_running=96)  # fmt: skip
    config.update(options)
    llm = LLM.__new__(LLM)
    llm.engine = Engine(EngineConfig(**config))
    llm.tokenizer, llm._counter = llm.engine.tokenizer, 0
    return llm


def random_prompts(n: int, seed: int, longest: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 30000) for _ in range(rng.randint(1, longest))] for _ in range(n)]


def sampled(llm, prompts, max_tokens: int, seed: int = 1) -> list[tuple[list, list]]:
    """Each prompt's sampled tokens and logprobs (temperature 1, a seed per request)."""
    from lockstep.engine.sampling_params import SamplingParams

    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + i,
                             ignore_eos=True) for i in range(len(prompts))]  # fmt: skip
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.token_ids, o.logprobs) for o in outs]


class OneEngine:
    """A module's engine: `get(**options)` returns the live one when its options match, else
    frees it and builds one of `model` with those options (`make_llm`)."""

    def __init__(self, model: str, **defaults) -> None:
        self.model, self.defaults = model, defaults
        self.llm, self.options = None, None

    def get(self, **options):
        if self.llm is None or self.options != options:
            self.release()
            self.llm = make_llm(self.model, **{**self.defaults, **options})
            self.options = options
        return self.llm

    def release(self) -> None:
        if self.llm is not None:
            del self.llm.engine
            self.llm = None
            torch.cuda.empty_cache()


# The suite's checks, each called by a test of every model file that runs it.


def check_graph_decode_equals_eager(engines: OneEngine) -> None:
    """11 sampled sequences (padded to the 16-row graph bucket), 40 steps each: graph replays
    give the eager steps' tokens and logprobs bit for bit."""
    prompts = random_prompts(11, seed=9)
    graphed = engines.get()
    with_graphs = sampled(graphed, prompts, 40)
    assert graphed.engine.runner.graphs.num_graphs > 0
    graphed.engine.check_integrity()
    eager = engines.get(cuda_graphs=False)
    assert eager.engine.runner.graphs is None
    assert sampled(eager, prompts, 40) == with_graphs


def check_one_request_among_64_batch_mates(llm, equal: bool = True) -> None:
    """One request decoded beside 64 batch-mates, then alone after a cache flush: the same
    tokens and logprobs (`equal`), or not (the reference-mode control)."""
    prompts = random_prompts(65, seed=3)
    together = sampled(llm, prompts, 48)
    llm.engine.flush_cache()
    alone = sampled(llm, prompts[:1], 48)
    assert (alone[0] == together[0]) == equal


def check_decode_equals_teacher_forced_scoring(llm) -> None:
    """520 sampled tokens after 3 prompts: their decode logprobs equal a rescoring of the
    whole text (prefill) bit for bit."""
    prompts = random_prompts(3, seed=5, longest=100)
    outs = sampled(llm, prompts, 520)
    llm.engine.flush_cache()
    scores = llm.score([p + toks for p, (toks, _) in zip(prompts, outs, strict=True)],
                       use_tqdm=False)  # fmt: skip
    for prompt, (_, logprobs), score in zip(prompts, outs, scores, strict=True):
        assert score.logprobs[len(prompt) :] == logprobs
