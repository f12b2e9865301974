"""Benchmark the deterministic FP8 GEMM against torch._scaled_mm and the bf16 matmul on one GPU.

    python -m bench.fp8_gemm [--no-sweep] [--out results.json]    (from the repository root)

Qwen3-8B projection shapes at M in {1, 16, 64, 128, 256, 1024, 4096, 8192}, every kernel timed
as CUDA-graph replays after an L2 flush (`bench.gpu_kernels.graph_ms`):

* ours, GEMM only, on pre-quantized operands: "tensor" (static activation scale) against
  `torch._scaled_mm` with per-tensor scales, "channel" (per-token activation, per-row weight
  scales) against `torch._scaled_mm` row-wise, and "block" (128 x 128 weight blocks, per token
  and 128-column group activations); efficiency = _scaled_mm time / ours (>= 0.95 is the
  target at M >= 128);
* ours, the whole linear ("block": activation quantization + GEMM) against the deterministic
  bf16 matmul (`lockstep.ops.triton.matmul`) at M <= 16 (target: <= 1.1x its time, aim 0.6x);
* with the sweep (default), candidate tile configs per M bucket for "block": the best one,
  and whether its bits equal the table's.

Bits: row 0 (fp32 out) of ours over every M and config, and of _scaled_mm over M (bf16 out).
Prints a table and ONE JSON document on the last line (times in us there); `--out` writes the
full document (every candidate's time) to a file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from functools import partial

import torch
import triton

from bench.gpu_kernels import copy_bandwidth, graph_ms, row_digest
from lockstep.ops import fp8 as spec
from lockstep.ops.triton import fp8_gemm as f8
from lockstep.ops.triton import matmul as mm

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
          "down": (4096, 12288)}  # fmt: skip
MS = (1, 16, 64, 128, 256, 1024, 4096, 8192)
DEVICE = "cuda"
C = f8.Fp8GemmConfig
# Candidates per M bucket (largest M of the bucket: configs). BM 16/32 compile to mma.sync,
# BM >= 64 to wgmma: the sweep reports whether their bits agree.
SWEEP = {
    16: [C(64, 64, 4, 6), C(64, 128, 4, 4), C(16, 32, 4, 8)],
    128: [C(64, 64, 4, 6), C(64, 128, 4, 4), C(128, 128, 8, 4)],
    1 << 62: [C(128, 128, 8, 4), C(64, 128, 4, 4), C(64, 64, 4, 4), C(128, 128, 8, 4, group_m=16),
              C(64, 128, 4, 4, group_m=16)],
}  # fmt: skip


def _scaled_mm(q: torch.Tensor, wt: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor):
    return torch._scaled_mm(q, wt, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


def _time_and_bits(fn, digests: set, log, what: str) -> float:
    """Graph-replay ms of fn and row 0's bits into `digests`; NaN (logged) if fn fails."""
    try:
        digests.add(row_digest(fn()[:1]))
        return graph_ms(fn)
    except Exception as exc:  # e.g. a scaling this torch build's _scaled_mm refuses
        log(f"{what}: failed: {str(exc).splitlines()[0][:160]}")
        return float("nan")


def run(sweep: bool, log) -> list[dict]:
    rows = []
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=DEVICE, generator=gen) * k**-0.5
        wb = w.to(torch.bfloat16)
        weights = {s: spec.quantize_weight(w, s) for s in f8.SCHEMES}
        xs = torch.randn(max(MS), k, device=DEVICE, generator=gen).to(torch.bfloat16)
        ins = weights["tensor"][2].to(DEVICE)
        digests: dict[str, set] = {"ours": set(), "smm_tensor": set(), "smm_row": set()}
        sweep_bits: dict[str, set] = {}
        for m in MS:
            x = xs[:m]
            rec = {"shape": name, "N": n, "K": k, "M": m}
            for scheme in f8.SCHEMES:
                wq, ws, _ = weights[scheme]
                scale_in = ins if scheme == "tensor" else None
                q, sx = f8.quantize_activation(x, scheme, scale_in)
                gemm = partial(f8.fp8_gemm, q, sx, wq, ws, scheme)  # the table's config
                rec[f"ours_{scheme}_ms"] = graph_ms(gemm)
                digests["ours"].add((scheme, row_digest(gemm(out_dtype=torch.float32)[:1])))
                if scheme == "tensor":
                    sa, sb = ins, ws[:1].contiguous()  # one weight scalar, repeated per row
                    smm = partial(_scaled_mm, q, wq.T, sa, sb)
                    rec["smm_tensor_ms"] = _time_and_bits(
                        smm, digests["smm_tensor"], log, f"{name} M={m} _scaled_mm per-tensor"
                    )
                if scheme == "channel":
                    smm = partial(_scaled_mm, q, wq.T, sx, ws.view(1, n))
                    rec["smm_row_ms"] = _time_and_bits(
                        smm, digests["smm_row"], log, f"{name} M={m} _scaled_mm row-wise"
                    )
            wq, ws, _ = weights["block"]
            rec["ours_block_linear_ms"] = graph_ms(partial(f8.fp8_linear, x, wq, ws, "block"))
            rec["eff_tensor"] = rec["smm_tensor_ms"] / rec["ours_tensor_ms"]
            rec["eff_channel"] = rec["smm_row_ms"] / rec["ours_channel_ms"]
            rec["eff_block_vs_row"] = rec["smm_row_ms"] / rec["ours_block_ms"]
            rec["table_cfg"] = f8.pick_config(m, n, k).__dict__
            if m <= 16:
                rec["bf16_ms"] = graph_ms(partial(mm.matmul, x, wb))
                rec["block_linear_vs_bf16"] = rec["ours_block_linear_ms"] / rec["bf16_ms"]
                rec["block_gemm_vs_bf16"] = rec["ours_block_ms"] / rec["bf16_ms"]
            if sweep:
                q, sx = f8.quantize_activation(x, "block")
                cands = next(v for b, v in SWEEP.items() if m <= b)
                times = {}
                for cfg in cands:
                    gemm = partial(f8.fp8_gemm, q, sx, wq, ws, "block", config=cfg)
                    try:
                        bits = row_digest(gemm(out_dtype=torch.float32)[:1])
                    except Exception as exc:  # a candidate that does not compile is reported
                        log(f"{name} M={m} {cfg}: failed: {str(exc).splitlines()[0][:120]}")
                        continue
                    flavour = "mma.sync" if cfg.bm < 64 else "wgmma"
                    sweep_bits.setdefault(flavour, set()).add(bits)
                    times[cfg] = graph_ms(gemm)
                best = min(times, key=times.get)
                rec["sweep"] = [{"cfg": c.__dict__, "ms": t} for c, t in times.items()]
                rec["best_block_ms"], rec["best_cfg"] = times[best], best.__dict__
            rows.append(rec)
            us = {key: v * 1e3 for key, v in rec.items() if key.endswith("_ms")}
            log(
                f"{name:7s} {m:5d} | {us['ours_tensor_ms']:7.1f} {us['smm_tensor_ms']:7.1f} "
                f"{rec['eff_tensor']:5.2f} | {us['ours_channel_ms']:7.1f} {us['smm_row_ms']:7.1f} "
                f"{rec['eff_channel']:5.2f} | {us['ours_block_ms']:7.1f} "
                f"{us['ours_block_linear_ms']:7.1f} | "
                + (f"{us['bf16_ms']:6.1f} {rec['block_linear_vs_bf16']:5.2f} | " if m <= 16
                   else "    -      - | ")
                + (f"{us['best_block_ms']:7.1f} {tuple(best.__dict__.values())}" if sweep else "")
            )  # fmt: skip
        per_scheme = {sc: sum(1 for t, _ in digests["ours"] if t == sc) for sc in f8.SCHEMES}
        bits = {
            "shape": name,
            "ours_row0_variants": per_scheme,  # 1 per scheme over every M: the contract
            "smm_tensor_row0_variants": len(digests["smm_tensor"]),
            "smm_row_row0_variants": len(digests["smm_row"]),
            "sweep_row0_variants": {fl: len(v) for fl, v in sweep_bits.items()},
        }
        rows.append(bits)
        log(f"{name}: bits {bits}")
        del xs, weights
        torch.cuda.empty_cache()
    return rows


def _min(values) -> float:
    finite = [v for v in values if v == v]
    return min(finite) if finite else float("nan")


def summarize(rows: list[dict]) -> dict:
    cells = [r for r in rows if "M" in r]
    big = [r for r in cells if r["M"] >= 128]
    small = [r for r in cells if r["M"] <= 16]
    return {
        "min_eff_tensor_m_ge_128": _min(r["eff_tensor"] for r in big),
        "min_eff_channel_m_ge_128": _min(r["eff_channel"] for r in big),
        "min_eff_block_vs_row_m_ge_128": _min(r["eff_block_vs_row"] for r in big),
        "max_block_linear_vs_bf16_m_le_16": max(r["block_linear_vs_bf16"] for r in small),
        "max_block_gemm_vs_bf16_m_le_16": max(r["block_gemm_vs_bf16"] for r in small),
        "ours_one_variant_per_scheme": all(
            set(r["ours_row0_variants"].values()) == {1} for r in rows if "ours_row0_variants" in r
        ),
        "bits": [r for r in rows if "ours_row0_variants" in r],
        "cells": [
            {
                key.replace("_ms", "_us"): (
                    round(v * 1e3, 1) if key.endswith("_ms") else round(v, 3)
                )
                for key, v in r.items()
                if key.endswith(
                    ("_ms", "eff_tensor", "eff_channel", "_vs_bf16", "eff_block_vs_row")
                )
            }
            | {"shape": r["shape"], "M": r["M"], "best_cfg": r.get("best_cfg")}
            for r in cells
        ],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-sweep", action="store_true", help="only the table's configs")
    parser.add_argument("--out", help="also write the JSON document to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench.fp8_gemm needs a CUDA GPU")

    def log(line: str) -> None:
        print(line, flush=True)

    log(
        "shape       M | tensor  smm-pt   eff | channel smm-row  eff | block   linear | "
        "bf16  lin/bf16 | best block (bm, bn, warps, stages, group_m, tma); times in us"
    )
    rows = run(not args.no_sweep, log)
    doc = {
        "bench": "fp8_gemm",
        "command": "python -m bench.fp8_gemm "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "copy_tb_s": copy_bandwidth(),
        "summary": summarize(rows),
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(json.dumps(doc) + "\n")
    # The last line: the summary and the bits (every time is in the table and in --out).
    summary = {key: v for key, v in doc["summary"].items() if key != "cells"}
    print(json.dumps({key: v for key, v in doc.items() if key != "rows"} | {"summary": summary}))


if __name__ == "__main__":
    main()
