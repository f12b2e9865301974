"""The cost of a speculative verify step against a one-token decode step at batch 1.

One request of `--context` random tokens decodes greedily on a plain engine, then on a
speculating one whose drafter always proposes `--k` tokens (copies of the last token, nearly
always rejected), so that every step after the prefill is a verify step of k + 1 rows. Runs
alternate between the two engines (`--rounds`), each timing `--steps` steps; reported: the
median step time of each and their ratio. A table, then one JSON document on the last line.

    python scripts/verify_step_cost.py --device cpu --k 4 --context 512

--profile: then where a step's time goes on each engine: the host's functions (cProfile,
by own time) and, on CUDA, the GPU's kernels (torch.profiler: time and launches a step).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from collections.abc import Sequence

from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.engine.sampling_params import SamplingParams


class RepeatLastDrafter:
    """Proposes `limit` copies of the last token: a verify step of full width every step."""

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        return [tokens[-1]] * limit


def step_times(engine: Engine, prompt: list[int], steps: int) -> list[float]:
    import torch  # after lockstep, which sets up torch's CPU threads (docs/cpu_ops.md)

    engine.add_request("t", prompt, SamplingParams(max_tokens=8 * steps + 8, temperature=0.0,
                                                   ignore_eos=True))  # fmt: skip
    engine.step()  # the prefill
    times = []
    for _ in range(steps):
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    engine.abort_request("t")
    engine.flush_cache()
    return times


def profile_steps(engine: Engine, prompt: list[int], steps: int, name: str) -> dict:
    """Print the host's top functions over `steps` steps and, on CUDA, the GPU kernel time
    and launches a step; return the figures."""
    import cProfile
    import io
    import pstats

    import torch

    engine.add_request("p", prompt, SamplingParams(max_tokens=8 * steps + 8, temperature=0.0,
                                                   ignore_eos=True))  # fmt: skip
    engine.step()
    engine.step()
    host = cProfile.Profile()
    host.enable()
    for _ in range(steps):
        engine.step()
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(18)
    print(f"--- {name} steps, host (cProfile, {steps} steps)\n{text.getvalue()}")
    out: dict = {}
    if engine.device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        kernels = [ev for ev in prof.events() if ev.device_type.name == "CUDA"]
        out = {"gpu_us_per_step": sum(ev.device_time_total for ev in kernels) / steps,
               "kernels_per_step": len(kernels) / steps}  # fmt: skip
        print(f"--- {name} steps, GPU: {out['gpu_us_per_step']:.0f} us of kernels and "
              f"{out['kernels_per_step']:.0f} kernels a step")  # fmt: skip
    engine.abort_request("p")
    engine.flush_cache()
    return out


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per verify step")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens")
    parser.add_argument("--steps", type=int, default=32, help="steps timed per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, engines in turn")
    parser.add_argument("--profile", action="store_true", help="host and GPU profiles of steps")
    parser.add_argument(
        "--verify-graphs",
        action="store_true",
        help="verify steps as whole-step CUDA graphs (--verify-cuda-graphs)",
    )
    args = parser.parse_args()
    base = dict(model=args.model, device=args.device, kv_tokens=args.context + 16 * args.steps)
    plain = Engine(EngineConfig(**base))
    spec = Engine(EngineConfig(**base, speculative="ngram", num_draft_tokens=args.k,
                               verify_cuda_graphs=args.verify_graphs))  # fmt: skip
    assert spec.speculator is not None
    spec.speculator.drafter = RepeatLastDrafter()
    rng = random.Random(0)
    prompt = [rng.randrange(1000, min(30000, plain.decoder.spec.vocab_size))
              for _ in range(args.context)]  # fmt: skip
    step_times(plain, prompt, 4)  # warm-up
    step_times(spec, prompt, 4)
    decode, verify = [], []
    for _ in range(args.rounds):
        decode.append(statistics.median(step_times(plain, prompt, args.steps)))
        verify.append(statistics.median(step_times(spec, prompt, args.steps)))
    doc = {
        "benchmark": "verify_step_cost",
        "model": plain.model_name,
        "device": plain.device.type,
        "processor": torch.cuda.get_device_name() if plain.device.type == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "k": args.k,
        "context": args.context,
        "verify_graphs": args.verify_graphs,
        "decode_ms": 1000 * statistics.median(decode),
        "verify_ms": 1000 * statistics.median(verify),
        "ratios": [v / d for v, d in zip(verify, decode, strict=True)],
    }  # fmt: skip
    doc["ratio"] = doc["verify_ms"] / doc["decode_ms"]
    if args.profile:
        for name, engine in (("decode", plain), ("verify", spec)):
            doc[f"{name}_profile"] = profile_steps(engine, prompt, args.steps, name)
    print(f"{'decode ms/step':>16}{'verify ms/step (k=' + str(args.k) + ')':>24}{'ratio':>8}")
    print(f"{doc['decode_ms']:>16.2f}{doc['verify_ms']:>24.2f}{doc['ratio']:>8.2f}")
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
