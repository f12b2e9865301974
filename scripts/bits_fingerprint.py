"""A fingerprint of a model's output bits, to compare two builds of Lockstep on one machine.

    python scripts/bits_fingerprint.py --model random:qwen3-8b
    PYTHONPATH=/path/to/other/checkout python scripts/bits_fingerprint.py --model random:qwen3-8b

Generates greedily from seeded random token prompts (several lengths, all in one batch, with
per-token logprobs) and scores the same prompts teacher-forced, then prints one JSON line: the
SHA-256 of every generated token id and every logprob's exact bits (float.hex), the package it
imported (so a comparison shows which build ran), and the first tokens for a quick look. Two
builds give the same digest exactly when every token and every logprob bit agree.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time

import lockstep
from lockstep.engine.llm import LLM
from lockstep.engine.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-prompt-len", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kv-dtype", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None)
    args = ap.parse_args()

    options = {"device": args.device}
    if args.kv_dtype:
        options["kv_dtype"] = args.kv_dtype
    if args.dtype:
        options["dtype"] = args.dtype
    t0 = time.perf_counter()
    llm = LLM(args.model, **options)
    vocab = llm.engine.decoder.spec.vocab_size
    rng = random.Random(0)
    prompts = [
        [rng.randrange(vocab) for _ in range(rng.randint(20, args.max_prompt_len))]
        for _ in range(args.prompts)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=0)  # fmt: skip
    outs = llm.generate(prompts, params, use_tqdm=False)
    scores = llm.score(prompts, use_tqdm=False)
    digest = hashlib.sha256()
    for out, score in zip(outs, scores, strict=True):
        digest.update(json.dumps(out.token_ids).encode())
        digest.update(",".join(float(x).hex() for x in out.logprobs).encode())
        digest.update(",".join(float(x).hex() for x in score.logprobs[1:]).encode())
    print(json.dumps({
        "model": args.model,
        "kv_dtype": args.kv_dtype,
        "package": lockstep.__file__,
        "sha256": digest.hexdigest(),
        "first_tokens": outs[0].token_ids[:8],
        "seconds": round(time.perf_counter() - t0, 1),
    }))  # fmt: skip
    llm.close()


if __name__ == "__main__":
    main()
