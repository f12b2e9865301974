"""A hybrid MoE model's CUDA-graph padding rows against its real rows, on one GPU.

    python scripts/hybrid_moe_padding_check.py                            # this build's route
    git show eab10c9:lockstep/ops/triton/moe.py > moe_before.py
    python scripts/hybrid_moe_padding_check.py --route-from moe_before.py  # negative control

The throughput benchmark's workload at a smaller output length (random:qwen3.5-35b-a3b,
200 x 1000 tokens in, 40 out, a warm-up run first, as `lockstep bench throughput` does), then
the spot check (requests re-run alone, bit for bit). The first pure decode step comes right
after the prefills, at batch 200 in a graph of 256: 56 padding rows, which in a hybrid model
run from the state pool's scratch slot (lockstep/engine/cuda_graphs.py), stale rows of other
sequences' open chunks included. Per decode step it counts the graph's non-finite logit rows,
padding and real apart; at the end, whether the scratch slot is finite, how many generated
tokens are 0 (greedy on NaN logits) and the spot check's verdict.

`--route-from` routes with another build's kernel: the one before the NaN guard gives a row of
NaN logits expert id E_PAD, so with NaN padding rows its spot check should fail (token 0 in
the batch) where this build's passes. `--no-graphs`, `--no-overlap` and
`--max-batch-tokens` bisect. A table, then one JSON document on the last line.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lockstep.bench.throughput import bench_throughput  # noqa: E402
from lockstep.bench.workload import BenchRequest  # noqa: E402
from lockstep.config import EngineConfig  # noqa: E402
from lockstep.engine.cuda_graphs import DecodeGraphRunner  # noqa: E402
from lockstep.engine.engine import Engine  # noqa: E402
from lockstep.engine.sampling_params import SamplingParams  # noqa: E402


def use_route_from(path: str) -> None:
    """Route with the `_route_kernel` of another build's moe.py (the negative control: the
    kernel before its NaN guard, `git show eab10c9:lockstep/ops/triton/moe.py`)."""
    import importlib.util

    from lockstep.ops.triton import moe

    spec = importlib.util.spec_from_file_location("moe_other_build", path)
    assert spec is not None and spec.loader is not None
    other = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = other  # its dataclasses look their module up there
    spec.loader.exec_module(other)
    moe._route_kernel = other._route_kernel


def watch_graph_rows(steps: list[dict]) -> None:
    """After each replay, count the graph's non-finite logit rows: real (< b) and padding."""
    original = DecodeGraphRunner.run

    def run(self: DecodeGraphRunner, batch, patch=None):  # noqa: ANN001, ANN202
        out = original(self, batch, patch)
        b = batch.meta.num_seqs
        bb = self.batch_buckets[bisect.bisect_left(self.batch_buckets, b)]
        cb = self.context_buckets[bisect.bisect_left(self.context_buckets, batch.meta.max_kv)]
        bad = ~torch.isfinite(self._graphs[(bb, cb)].logits).all(dim=1)
        steps.append({"batch": b, "bucket": bb, "real_nonfinite": int(bad[:b].sum()),
                      "padding_nonfinite": int(bad[b:].sum())})  # fmt: skip
        return out

    DecodeGraphRunner.run = run


def scratch_finite(engine: Engine) -> dict[str, bool] | None:
    pool = engine.state_pool
    if pool is None:
        return None
    s = pool.scratch_slot
    parts = {"conv": pool.conv, "recurrent": pool.recurrent, "open_k": pool.open_k,
             "open_gamma": pool.open_gamma, "open_u": pool.open_u}  # fmt: skip
    return {name: bool(torch.isfinite(t[s]).all()) for name, t in parts.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:qwen3.5-35b-a3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=40)
    ap.add_argument("--spot-check", type=int, default=6)
    ap.add_argument("--kv-tokens", type=int, default=None)
    ap.add_argument("--max-batch-tokens", type=int, default=None)
    ap.add_argument(
        "--route-from",
        default=None,
        help="another build's lockstep/ops/triton/moe.py whose route kernel to use",
    )
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--no-overlap", action="store_true")
    args = ap.parse_args()
    if args.route_from:
        use_route_from(args.route_from)
    steps: list[dict] = []
    watch_graph_rows(steps)
    config = EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, kv_tokens=args.kv_tokens,
        max_batch_tokens=args.max_batch_tokens, cuda_graphs=not args.no_graphs,
        overlap_decode=False if args.no_overlap else None,
    )  # fmt: skip
    engine = Engine(config)
    vocab = engine.decoder.spec.vocab_size
    g = torch.Generator().manual_seed(0)
    requests = [
        BenchRequest(
            torch.randint(0, vocab, (args.input_len,), generator=g).tolist(), args.output_len
        )  # fmt: skip
        for _ in range(args.num_prompts)
    ]
    params = [SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
              for _ in requests]  # fmt: skip
    run, check, _ = bench_throughput(engine, requests, params, spot_checks=args.spot_check,
                                     progress=False)  # fmt: skip
    zeros = [(i, gen.token_ids.index(0)) for i, gen in enumerate(run.generations)
             if 0 in gen.token_ids]  # fmt: skip
    padding_bad = [i for i, s in enumerate(steps) if s["padding_nonfinite"]]
    real_bad = [i for i, s in enumerate(steps) if s["real_nonfinite"]]
    doc = {
        "model": args.model, "route_from": args.route_from, "graphs": not args.no_graphs,
        "overlap": not args.no_overlap, "max_batch_tokens": args.max_batch_tokens,
        "graph_steps": len(steps),
        "graph_steps_with_nonfinite_padding": len(padding_bad),
        "first_nonfinite_padding_step": steps[padding_bad[0]] if padding_bad else None,
        "graph_steps_with_nonfinite_real_rows": len(real_bad),
        "first_nonfinite_real_step": steps[real_bad[0]] if real_bad else None,
        "scratch_slot_finite": scratch_finite(engine),
        "requests_with_token_0": len(zeros),
        "first_token_0": zeros[:5],
        "preemptions": run.preemptions,
        "spot_check": check.as_dict(),
    }  # fmt: skip
    for key, value in doc.items():
        print(f"{key:40} {value}")
    print(json.dumps(doc))
    return 0 if check.passed else 1


if __name__ == "__main__":
    sys.exit(main())
