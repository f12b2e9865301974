"""One very long prompt through the engine. Prints a table line, then JSON.

    python scripts/long_prompt.py --model random:qwen3-8b --tokens 131072

The prompt is prefilled in chunks; attention workspace is bounded by the batch and split
limits (docs/gpu.md), so the context length alone must never make a request fail.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.engine.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:qwen3-8b")
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--chunk", type=int, default=16384)
    args = parser.parse_args()
    gen = 4
    engine = Engine(
        EngineConfig(
            model=args.model,
            max_model_len=args.tokens + gen,
            kv_tokens=args.tokens + 64,
            max_batch_tokens=args.chunk,
            chunk_size=args.chunk,
            max_running=4,
        )  # fmt: skip
    )
    rng = random.Random(0)
    prompt = [rng.randrange(engine.decoder.spec.vocab_size) for _ in range(args.tokens)]
    engine.add_request(
        "long", prompt, SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
    )
    t0 = time.perf_counter()
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    doc = {
        "benchmark": "long_prompt",
        "model": args.model,
        "prompt_tokens": args.tokens,
        "generated": [t for o in outs for t in o.new_token_ids],
        "finish_reason": outs[-1].finish_reason,
        "seconds": round(seconds, 2),
        "prefill_tok_s": round(args.tokens / seconds, 1),
        "max_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if torch.cuda.is_available()
        else None,
        "device": engine.fingerprint()["device_name"],
    }
    print(f"{args.tokens} tokens in {seconds:.1f} s, finish={doc['finish_reason']}")
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
