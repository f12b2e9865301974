"""Host work of one engine step, without the model: the forward is replaced by a cached logits
tensor, so what is timed is scheduling, batch building, sampling and output (the Python that
runs between GPU steps).

    python scripts/host_step_cost.py --batch 32
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time

import torch

from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.engine.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--model", default="random:tiny")
    ap.add_argument("--random-prompts", action="store_true",
                    help="random token ids (as the decode benchmark) instead of a ramp")  # fmt: skip
    ap.add_argument("--profile", action="store_true", help="cProfile the timed steps")
    args = ap.parse_args()
    engine = Engine(EngineConfig(model=args.model, kv_tokens=args.batch * (args.prompt_len + 400),
                                 max_running=args.batch, max_model_len=args.prompt_len + 4000))  # fmt: skip
    params = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
    vocab = engine.decoder.spec.vocab_size
    rng = random.Random(0)
    for r in range(args.batch):
        if args.random_prompts:
            prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        else:
            prompt = [(i + r) % 500 for i in range(args.prompt_len)]
        engine.add_request(f"r{r}", prompt, params)
    while any(not r.output_ids for r in engine.requests.values()):  # prefill
        engine.step()
    # A few cached logits tensors per row count, cycled, so that the greedy tokens change
    # from step to step (the detokenizer sees varied tokens, as with a real model).
    cached: dict[int, list[torch.Tensor]] = {}
    calls = [0]

    def no_model(batch, kv):  # noqa: ARG001 - the decoder's signature
        n = batch.logit_rows.shape[0]
        if n not in cached:
            cached[n] = [torch.randn(n, engine.decoder.spec.vocab_size) for _ in range(8)]
        calls[0] += 1
        return cached[n][calls[0] % 8]

    engine.decoder.forward = no_model
    for _ in range(50):
        engine.step()
    times = []
    prof = cProfile.Profile() if args.profile else None
    for _ in range(args.steps):
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        engine.step()
        if prof:
            prof.disable()
        times.append(time.perf_counter() - t0)
    median = statistics.median(times) * 1e6
    print(f"batch {args.batch}, prompt {args.prompt_len}: host work {median:.1f} us per step, "
          f"{median / args.batch:.1f} us per request")  # fmt: skip
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
