"""LLM.score of prompts sharing a long prefix, cold versus served from the prefix cache.

    python scripts/score_cache_hit.py --prefix-tokens 1000 --suffixes 6 --suffix-tokens 16

Each prompt is the same ~1,000-token prefix plus a short distinct suffix, scored alone. Cold:
the cache is flushed before every call, so every position is computed. Warm: the prefix was
scored once; each call reuses the KV and the stored logprobs of the cached positions
(docs/design.md, "Memory, cache and scheduling") and computes only the rest. The warm time
should fall by about the cached fraction of the tokens, less the fixed cost of one forward
pass (on the CPU, streaming the weights once however few rows it computes). The script checks
that every run returns the same logprobs, and prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import statistics
import sys
import time

import torch

from lockstep.engine.llm import LLM

PREFIX_TEXT = (
    "The harbour town kept a ledger of every ship that came and went: its name, its cargo, "
    "the weather at its arrival and the tide at its departure. "
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--suffixes", type=int, default=6)
    parser.add_argument("--suffix-tokens", type=int, default=16)
    parser.add_argument("--top-logprobs", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="rounds; the median is reported")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (torch's default)")
    args = parser.parse_args()

    llm = LLM(args.model, device=args.device, kv_tokens=4 * (args.prefix_tokens + 64),
              num_threads=args.threads)  # fmt: skip
    engine, tok = llm.engine, llm.tokenizer
    repeats = -(-args.prefix_tokens // len(tok.encode(PREFIX_TEXT)))
    prefix = tok.encode(PREFIX_TEXT * (repeats + 1))[: args.prefix_tokens]
    prompts = []
    for i in range(args.suffixes):
        words = f" Entry {i}: the {i * 7 + 3}th ship, the {'north' if i % 2 else 'south'} quay."
        prompts.append(prefix + tok.encode(words * 4)[: args.suffix_tokens])

    def score(prompt: list[int]) -> tuple[float, int, list]:
        before = engine.stats()["cached_tokens_total"]
        t0 = time.perf_counter()
        (out,) = llm.score([prompt], top_logprobs=args.top_logprobs, use_tqdm=False)
        seconds = time.perf_counter() - t0
        return seconds, engine.stats()["cached_tokens_total"] - before, out.top_logprobs

    llm.score([prompts[0]], use_tqdm=False)  # build and warm the kernels before timing
    seconds = {"cold": [], "warm": []}
    cached = {"cold": 0, "warm": 0}  # per round
    outputs = []  # every round's logprobs, cold and warm: all must be equal
    for _ in range(args.repeat):
        for run in ("cold", "warm"):
            engine.flush_cache()
            if run == "warm":
                llm.score([prefix], top_logprobs=args.top_logprobs, use_tqdm=False)
            total_s, cached[run], outs = 0.0, 0, []
            for prompt in prompts:
                if run == "cold":
                    engine.flush_cache()
                call_s, hit, out = score(prompt)
                total_s += call_s
                cached[run] += hit
                outs.append(out)
            seconds[run].append(total_s)
            outputs.append(outs)
    same = all(outs == outputs[0] for outs in outputs)
    total = sum(len(p) for p in prompts)
    cold_s, warm_s = statistics.median(seconds["cold"]), statistics.median(seconds["warm"])
    fraction = cached["warm"] / total
    doc = {
        "benchmark": "score_cache_hit",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python " + shlex.join(sys.argv),
        "model": engine.model_name,
        "device": args.device,
        "cpu": _cpu_name(),
        "threads": torch.get_num_threads(),
        "prompts": len(prompts),
        "prompt_tokens": total,
        "prefix_tokens": args.prefix_tokens,
        "suffix_tokens": args.suffix_tokens,
        "top_logprobs": args.top_logprobs,
        "cold_s": round(cold_s, 3),
        "warm_s": round(warm_s, 3),
        "cold_cached_tokens": cached["cold"],
        "warm_cached_tokens": cached["warm"],
        "cached_fraction": round(fraction, 4),
        "time_drop": round(1 - warm_s / cold_s, 4),
        "logprobs_equal": same,
        "rounds_s": {k: [round(x, 3) for x in v] for k, v in seconds.items()},
    }
    print(f"{'run':<6}{'prompts':>8}{'tokens':>8}{'cached':>8}{'seconds':>9}{'ms/prompt':>11}")
    for run in ("cold", "warm"):
        run_s = doc[f"{run}_s"]
        print(f"{run:<6}{len(prompts):>8}{total:>8}{cached[run]:>8}{run_s:>9.3f}"
              f"{1000 * run_s / len(prompts):>11.1f}")  # fmt: skip
    print(f"cached fraction {fraction:.3f}, time drop {doc['time_drop']:.3f}, "
          f"logprobs equal: {same}")  # fmt: skip
    print(json.dumps(doc))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
