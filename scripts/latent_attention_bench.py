"""Time the Triton latent-attention kernel (MLA, absorbed) on one GPU at DeepSeek shapes.

    python scripts/latent_attention_bench.py [--heads 16] [--sweep] [--out results.json]

Decode at batch 1 and 64 over 1k/4k/16k-key contexts (the wrapper's path and each decode path
forced) and a causal prefill of one 4k-token sequence, each timed as CUDA-graph replays, beside
the floors: decode reads every sequence's cache rows once (W = 576 bf16 values per key) at the
device's copy bandwidth; prefill does 2 * H * (W + 512) / 2 FLOP per (query, key) pair of the
causal triangle at the bf16 matmul peak. --sweep adds prefill tile configs (speed only: the
same block_n and split). Prints a table and ONE JSON document on the last line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench/

from bench.gpu_kernels import copy_bandwidth, graph_ms  # noqa: E402
from lockstep.ops.base import build_attention_meta  # noqa: E402
from lockstep.ops.triton.attention import attention_path  # noqa: E402
from lockstep.ops.triton.latent_attention import (  # noqa: E402
    DEFAULT_LATENT_CONFIG,
    LatentConfig,
    latent_attention,
)

W, DV = 576, 512


# Prefill tile candidates for --sweep: (rows, value_cols, num_warps, num_stages).
SWEEP_PREFILL = [(64, 512, 8, 2), (64, 256, 4, 2), (64, 128, 4, 2), (128, 256, 8, 1),
                 (128, 128, 8, 2), (64, 256, 8, 1), (32, 512, 4, 2)]  # fmt: skip


def time_latent(q, cache, meta, path: str | None,
                cfg: LatentConfig = DEFAULT_LATENT_CONFIG) -> float:  # fmt: skip
    """Milliseconds of one `latent_attention` call with `cfg` on `path` (`graph_ms`: the
    median CUDA-graph replay, each after an L2 flush)."""
    scale = q.shape[1] ** -0.5
    return graph_ms(lambda: latent_attention(q, cache, meta, scale, DV, cfg, path))


def case(batch: int, context: int, heads: int, new: int):
    """q, cache, meta of `batch` sequences of `context` keys, the last `new` of each queried."""
    g = torch.Generator(device="cuda").manual_seed(0)
    slots = torch.randperm(batch * context, device="cuda", generator=g).to(torch.int32)
    cache = torch.randn(batch * context, 1, W, device="cuda", generator=g).to(torch.bfloat16)
    q = torch.randn(batch * new, heads, W, device="cuda", generator=g).to(torch.bfloat16)
    tables = [slots[b * context : (b + 1) * context].tolist() for b in range(batch)]
    meta = build_attention_meta([new] * batch, [context - new] * batch, tables).to("cuda")
    return q, cache, meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    h, cfg = args.heads, DEFAULT_LATENT_CONFIG
    bw = copy_bandwidth()
    rows = []
    print(f"latent attention, H={h}, W={W}, copy {bw:.2f} TB/s", file=sys.stderr)
    print(f"{'case':<28}{'path':<9}{'ms':>9}{'floor ms':>10}{'of floor':>10}")
    for batch in (1, 64):
        for context in (1024, 4096, 16384):
            q, cache, meta = case(batch, context, h, 1)
            floor = batch * context * W * 2 / (bw * 1e9)  # ms
            auto = attention_path(cfg, meta, h, 1, q.device)
            for path in (None, "fold", "split"):
                ms = time_latent(q, cache, meta, path)
                name = f"decode b={batch} ctx={context}"
                shown = path or f"{auto}*"
                rows.append({"case": name, "path": shown, "ms": ms, "floor_ms": floor})
                print(f"{name:<28}{shown:<9}{ms:>9.4f}{floor:>10.4f}{floor / ms:>10.0%}")
    for context in (4096,):
        q, cache, meta = case(1, context, h, context)
        flops = 2 * h * (W + DV) * context * context / 2
        floor = flops / 790e12 * 1e3
        ms = time_latent(q, cache, meta, None)
        name = f"prefill ctx={context}"
        rows.append({"case": name, "path": "prefill", "ms": ms, "floor_ms": floor,
                     "tflops": flops / ms / 1e9})  # fmt: skip
        print(f"{name:<28}{'prefill':<9}{ms:>9.4f}{floor:>10.4f}{floor / ms:>10.0%}"
              f"  {flops / ms / 1e9:.0f} TFLOP/s")  # fmt: skip
        if not args.sweep:
            continue
        want = latent_attention(q, cache, meta, h**-0.5, DV, cfg)
        for r, cols, warps, stages in SWEEP_PREFILL:
            other = LatentConfig(rows=r, value_cols=cols, num_warps=warps, num_stages=stages)
            try:
                ms = time_latent(q, cache, meta, None, other)
                same = torch.equal(latent_attention(q, cache, meta, h**-0.5, DV, other), want)
            except Exception as exc:  # a config the device refuses (shared memory)
                print(f"  r{r} c{cols} w{warps} s{stages}: {type(exc).__name__}")
                continue
            shown = f"r{r}c{cols}w{warps}s{stages}"
            rows.append({"case": name, "path": shown, "ms": ms, "floor_ms": floor,
                         "same_bits": same})  # fmt: skip
            print(f"{name:<28}{shown:<14}{ms:>9.4f}{floor:>10.4f}{floor / ms:>10.0%}"
                  f"  bits {'same' if same else 'DIFFER'}")  # fmt: skip
    config = {k: None if v == math.inf else v for k, v in cfg.__dict__.items()}  # strict JSON
    doc = {"heads": h, "config": config, "copy_tb_s": bw,
           "device": torch.cuda.get_device_name(), "rows": rows}  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
