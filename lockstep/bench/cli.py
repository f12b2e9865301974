"""`lockstep bench decode`: end-to-end prefill/decode throughput, deterministic vs fast."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lockstep.cli_options import add_engine_arguments, engine_options_from_args


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (table, then one JSON line)")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    decode = kinds.add_parser("decode", help="prefill and decode throughput through the engine")
    decode.add_argument("--modes", default="deterministic,fast",
                        help="comma-separated modes to compare")  # fmt: skip
    decode.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    decode.add_argument("--prompt-len", type=int, default=128)
    decode.add_argument("--gen-len", type=int, default=64)
    decode.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    decode.add_argument("--temperature", type=float, default=0.0,
                        help="sample at this temperature (default 0: greedy)")  # fmt: skip
    decode.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus filter for sampled tokens (needs --temperature)")  # fmt: skip
    decode.add_argument("--top-k", type=int, default=0,
                        help="keep the k most likely tokens (needs --temperature; 0: off)")  # fmt: skip
    add_engine_arguments(decode)
    decode.set_defaults(func=run_bench_decode)


def run_bench_decode(args: argparse.Namespace) -> int:
    from lockstep.bench.decode import bench_modes, print_json_last

    options = engine_options_from_args(args)
    options.pop("mode", None)
    doc = bench_modes(
        options,
        modes=[m.strip() for m in args.modes.split(",") if m.strip()],
        batches=[int(b) for b in args.batches.split(",")],
        prompt_len=args.prompt_len,
        gen_len=args.gen_len,
        sampling={"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k},
    )
    doc["command"] = "lockstep bench decode " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
        if k in ("modes", "batches", "prompt_len", "gen_len", "temperature", "top_p", "top_k")
    )  # fmt: skip
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(doc, indent=2) + "\n")
    print_json_last(doc)
    return 0
