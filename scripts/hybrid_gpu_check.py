"""Hybrid (Qwen3.5) models on a GPU: the position-invariance property, its negative control,
and rough timings, deterministic against reference in one run.

    python scripts/hybrid_gpu_check.py --model random:qwen3.5-9b --cases 8

(`--device cpu --model random:tiny-qwen3.5 --dtype float32` runs the same on the CPU.)

For each mode: random cases through the invariance harness (prefix hits resuming at chunk
boundaries, random chunkings with one-token decode steps, batch-mates), prefix hits of every
length 1..3C with 1-40 token tails, and decode logprobs against teacher-forced scoring; every
position's logits, K/V, final linear state and boundary snapshots compared bitwise with one
cold prefill. The deterministic mode must have no failure, the reference mode some. Then the time
of a cold prefill and of decode steps at batch 1 and 64. A table, then one JSON document on
the last line. Needs no server dependencies.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support

from lockstep.config import EngineConfig  # noqa: E402
from lockstep.engine.engine import Engine  # noqa: E402
from lockstep.engine.llm import LLM  # noqa: E402
from lockstep.engine.sampling_params import SamplingParams  # noqa: E402
from tests.support.invariance_harness import Plan, compute, mismatches, random_plan, reference  # noqa: E402


def _failures(engine: Engine, cases: int, max_len: int) -> dict:
    vocab, chunk = engine.decoder.spec.vocab_size, engine.decoder.linear_layout.chunk
    random_fail, first = 0, None
    for seed in range(cases):
        rng = random.Random(seed)
        n = rng.randint(1, max_len)
        tokens = [rng.randrange(vocab) for _ in range(n)]
        plan = random_plan(rng, n, max_mates=3)
        problems = mismatches(reference(engine, tokens), compute(engine, tokens, plan, rng))
        if problems:
            random_fail += 1
            first = first or f"n={n} {plan.describe()}: {problems[0]}"
    rng = random.Random(11)
    stem = [rng.randrange(vocab) for _ in range(3 * chunk)]
    prefix_fail = 0
    for prefix in range(1, 3 * chunk + 1):
        tail = 1 + (prefix - 1) % 40
        tokens = stem[:prefix] + [rng.randrange(vocab) for _ in range(tail)]
        plan = Plan(prefix, [tail], [[rng.randint(1, 9)]], donor_step=chunk)
        prefix_fail += bool(
            mismatches(reference(engine, tokens), compute(engine, tokens, plan, rng))
        )
        engine.flush_cache()
    engine.check_integrity()
    return {"random_cases": cases, "random_failures": random_fail,
            "prefix_hits": 3 * chunk, "prefix_failures": prefix_fail, "first_failure": first}  # fmt: skip


def _decode_vs_scoring(llm: LLM, vocab: int) -> int:
    rng = random.Random(2)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 61, 200)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    scores = llm.score([o.prompt_token_ids + o.token_ids for o in outs], use_tqdm=False)
    return sum(
        s.logprobs[len(o.prompt_token_ids) :] != o.logprobs
        for o, s in zip(outs, scores, strict=True)
    )


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timings(llm: LLM, vocab: int, prefill: int) -> dict:
    rng = random.Random(3)
    prompt = [rng.randrange(vocab) for _ in range(prefill)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.engine.flush_cache()
    _sync()
    t0 = time.perf_counter()
    llm.generate([prompt], one, use_tqdm=False)
    _sync()
    out = {"prefill_tokens": prefill, "prefill_s": time.perf_counter() - t0}
    for batch in (1, 64):
        prompts = [[rng.randrange(vocab) for _ in range(32)] for _ in range(batch)]
        steps = SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True)
        short = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        llm.engine.flush_cache()
        t0 = time.perf_counter()
        llm.generate(prompts, short, use_tqdm=False)
        base = time.perf_counter() - t0
        llm.engine.flush_cache()
        t0 = time.perf_counter()
        llm.generate(prompts, steps, use_tqdm=False)
        out[f"decode_b{batch}_ms_per_step"] = (time.perf_counter() - t0 - base) / 32 * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:qwen3.5-9b")
    parser.add_argument("--cases", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=160)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report: dict = {"model": args.model, "device": name, "torch": torch.__version__,
                    "dtype": args.dtype}  # fmt: skip
    for mode in ("deterministic", "reference"):
        engine = Engine(EngineConfig(model=args.model, mode=mode, device=args.device,
                                     dtype=args.dtype, kv_tokens=16384, max_running=64))  # fmt: skip
        llm = LLM.__new__(LLM)
        llm.engine, llm.tokenizer, llm._counter = engine, engine.tokenizer, 0
        vocab = engine.decoder.spec.vocab_size
        result = _failures(engine, args.cases, args.max_len)
        result["decode_vs_scoring_differs"] = _decode_vs_scoring(llm, vocab)
        result.update(_timings(llm, vocab, args.prefill))
        result["snapshot_bytes"] = engine.decoder.linear_layout.snapshot_bytes
        result["kv_tokens"] = engine.pool.num_slots
        report[mode] = result
        print(f"{mode:>13}: " + ", ".join(f"{k}={v}" for k, v in result.items()))
        del engine, llm
        if args.device == "cuda":
            torch.cuda.empty_cache()
    det, reference = report["deterministic"], report["reference"]
    report["passed"] = (
        det["random_failures"] == det["prefix_failures"] == det["decode_vs_scoring_differs"] == 0
        and reference["random_failures"] + reference["prefix_failures"] > 0
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
