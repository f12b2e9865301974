"""Host work of one engine step, without the model: the forward is replaced by a cached logits
tensor, so what is timed is scheduling, batch building, sampling and output (the Python that
runs between GPU steps).

    python scripts/host_step_cost.py --batch 32
"""

from __future__ import annotations

import argparse
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
    args = ap.parse_args()
    engine = Engine(EngineConfig(model="random:tiny", kv_tokens=args.batch * (args.prompt_len + 400),
                                 max_running=args.batch, max_model_len=args.prompt_len + 4000))  # fmt: skip
    params = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
    for r in range(args.batch):
        engine.add_request(f"r{r}", [(i + r) % 500 for i in range(args.prompt_len)], params)
    while any(not r.output_ids for r in engine.requests.values()):  # prefill
        engine.step()
    cached: dict[int, torch.Tensor] = {}

    def no_model(batch, kv):  # noqa: ARG001 - the decoder's signature
        n = batch.logit_rows.shape[0]
        if n not in cached:
            cached[n] = torch.randn(n, engine.decoder.spec.vocab_size)
        return cached[n]

    engine.decoder.forward = no_model
    for _ in range(50):
        engine.step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    median = statistics.median(times) * 1e6
    print(f"batch {args.batch}, prompt {args.prompt_len}: host work {median:.1f} us per step, "
          f"{median / args.batch:.1f} us per request")  # fmt: skip


if __name__ == "__main__":
    main()
