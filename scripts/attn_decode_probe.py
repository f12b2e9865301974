"""Probe why small decode attention (batch 1) runs far above its floor: time the split path
(production config and variants) over contexts of 1 to 512 key blocks; the slope is the cost of
one key block walked by one program.

    python scripts/attn_decode_probe.py [--variants s5=num_stages_split:5 ...] [--batches 1,8]
        [--kernels]   (each kernel's share of a replay: the split kernel vs the merge)

A variant is NAME=field:value[,field:value] over AttentionConfig's fields, plus
`path:split|fold|prefill` to force a path (otherwise the wrapper picks fold or split,
`decode_path`); the production config is always timed first, on the wrapper's path. (Runs
70-71 forced `path:prefill,rows:16,num_warps:2`, the fold path before it had a name, and
timed the production config on the split path.) Variants that change block_n or split
change the bits (timing only).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from functools import partial

import torch

from lockstep.bench.gpu_kernels import (
    HD,
    HKV,
    HQ,
    bench_ms,
    capture_graph,
    flush_l2,
    graph_ms,
    paged_slots,
)
from lockstep.bench.kernel_trace import charge_critical_path, kernel_events
from lockstep.ops.base import build_attention_meta
from lockstep.ops.triton.attention import DEFAULT_CONFIG, paged_attention


def parse_value(text: str) -> int | float | str:
    """An integer, a float (fold_programs_per_sm:1.5) or a word (row_sum:mma)."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_variant(text: str) -> tuple[str, dict]:
    """NAME=field:value[,field:value] (values: `parse_value`)."""
    name, _, fields = text.partition("=")
    pairs = (f.split(":") for f in fields.split(","))
    return name, {k: parse_value(v) for k, v in pairs}


def kernel_split(fn) -> str:
    """Each kernel's share of one CUDA-graph replay of fn (after an L2 flush): its end minus
    the latest end before it, so the split kernel and the merge are charged apart even
    though PDL overlaps them."""
    from torch.profiler import ProfilerActivity, profile

    graph = capture_graph(fn)
    graph.replay()
    flush_l2()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    events = kernel_events(prof)
    if not events:
        return "(no kernels traced)"
    charge_critical_path(events)
    return ", ".join(f"{e['name'].split('(')[0][-12:]} {e['contribution']:.1f}" for e in events)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="*", default=[])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="64,512,1024,4096,32768")
    ap.add_argument(
        "--kernels",
        action="store_true",
        help="also print each kernel's share of one replay (split vs merge)",
    )
    ap.add_argument(
        "--cache-tokens",
        type=int,
        default=32 * 32768 + 64,
        help="the K/V caches' tokens; above 2**21 (Hkv 8, D 128) the kernels take their "
        "64-bit offset path, as in the decode table of lockstep.bench.gpu_kernels",
    )
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache_tokens = args.cache_tokens
    kc = torch.randn(cache_tokens, HKV, HD, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn_like(kc)
    configs = {"prod": DEFAULT_CONFIG}
    paths = {"prod": None}  # the wrapper's own choice (fold or split, `decode_path`)
    for text in args.variants:
        name, fields = parse_variant(text)
        paths[name] = fields.pop("path", None)
        configs[name] = replace(DEFAULT_CONFIG, **fields)
    print("configs:", {k: v for k, v in configs.items()}, flush=True)
    for batch in map(int, args.batches.split(",")):
        for ctx in map(int, args.contexts.split(",")):
            need = batch * -(-ctx // 16) * 16  # whole pages of 16 (paged_slots)
            if need > cache_tokens:  # the slots would run past the cache
                print(f"B {batch:2d} ctx {ctx:6d}: skipped, {need} slots > the probe's "
                      f"{cache_tokens}-token cache", flush=True)  # fmt: skip
                continue
            slots = paged_slots([ctx] * batch, seed=ctx)
            meta = build_attention_meta([1] * batch, [ctx - 1] * batch, slots).to("cuda")
            q = torch.randn(batch, HQ, HD, device="cuda", dtype=torch.bfloat16, generator=gen)
            line = f"B {batch:2d} ctx {ctx:6d}:"
            for name, cfg in configs.items():
                fn = partial(paged_attention, q, kc, vc, meta, HD**-0.5, cfg, paths[name])
                line += f"  {name} {graph_ms(fn) * 1e3:7.1f}"
                if args.kernels:
                    line += f" [{kernel_split(fn)}]"
            print(line, flush=True)
    # An almost empty kernel's cost in a graph, for scale: one tiny copy.
    a = torch.zeros(16, device="cuda")
    b = torch.zeros(16, device="cuda")
    print(
        f"tiny copy in a graph: {graph_ms(lambda: b.copy_(a)) * 1e3:.1f} us; "
        f"eager {bench_ms(lambda: b.copy_(a)) * 1e3:.1f} us"
    )


if __name__ == "__main__":
    main()
