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
