"""Cost of choosing sampled tokens (temperature, top-p, top-k) for a batch of logits rows:
the float64 work (noise, top-p's probabilities) from its kernels (C++ on CPU, Triton on CUDA)
against the torch references (the filters are the same batched code in both columns).

    python scripts/sampler_cost.py [--device cuda] [--vocab 151936] [--batches 1,8,32]

Prints ms per call (CUDA: synchronized around each call) and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime, timezone
from functools import partial

import torch

from lockstep.engine import sampler
from lockstep.engine.sampler import RowSampling, choose_token_tensor


def time_ms(fn, device: str, reps: int) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.device == "cpu":
        from lockstep.ops.cpu_build import load_extension

        load_extension()  # the deterministic CPU backend builds it at start-up
    kernels = {"gumbel_noise": sampler.gumbel_noise, "probability_units": sampler.probability_units}
    references = {"gumbel_noise": sampler.gumbel_noise_reference,
                  "probability_units": sampler.probability_units_reference}  # fmt: skip
    filters = {"temperature": {}, "top_p 0.9": {"top_p": 0.9}, "top_k 50": {"top_k": 50}}
    records = []
    for batch in map(int, args.batches.split(",")):
        gen = torch.Generator().manual_seed(batch)
        logits = (torch.randn(batch, args.vocab, generator=gen) * 3).to(args.device)
        for name, kw in filters.items():
            params = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, **kw}
            rows = [RowSampling(**params, seed=i, position=1000 + i) for i in range(batch)]
            out = {}
            for column, functions in (("kernel", kernels), ("reference", references)):
                for attr, fn in functions.items():
                    setattr(sampler, attr, fn)
                try:
                    call = partial(choose_token_tensor, logits, rows)
                    out[column] = time_ms(call, args.device, args.reps)
                finally:
                    for attr, fn in kernels.items():
                        setattr(sampler, attr, fn)
            records.append({"batch": batch, "filter": name, "kernel_ms": out["kernel"],
                            "reference_ms": out["reference"]})  # fmt: skip
            print(f"batch {batch:3d} {name:12s} kernels {out['kernel']:9.2f} ms   "
                  f"references {out['reference']:9.2f} ms", flush=True)  # fmt: skip
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(
        json.dumps(
            {
                "command": "python scripts/sampler_cost.py "
                + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
                "device": device,
                "vocab": args.vocab,
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "rows": records,
            }
        )
    )


if __name__ == "__main__":
    main()
