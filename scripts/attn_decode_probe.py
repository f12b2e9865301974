"""Probe why small decode attention (batch 1) runs far above its floor: time the split path
(production config, a few stage counts) over contexts of 1 to 64 key blocks; the slope is the
cost of one key block walked by one program.

    python scripts/attn_decode_probe.py
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from lockstep.bench.gpu_kernels import HD, HKV, HQ, bench_ms, graph_ms, paged_slots
from lockstep.ops.base import build_attention_meta
from lockstep.ops.triton.attention import DEFAULT_CONFIG, paged_attention


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    kc = torch.randn(32 * 32768 + 64, HKV, HD, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn_like(kc)
    configs = {
        "r16w1": DEFAULT_CONFIG,
        "r64w4": replace(DEFAULT_CONFIG, rows_split=64, num_warps_split=4),
        "r64w4s4": replace(DEFAULT_CONFIG, rows_split=64, num_warps_split=4, num_stages_split=4),
        "r128w8": replace(DEFAULT_CONFIG, rows_split=128, num_warps_split=8),
    }
    for batch in (1, 8, 32):
        for ctx in (64, 512, 1024, 4096, 32768):
            slots = paged_slots([ctx] * batch, seed=ctx)
            meta = build_attention_meta([1] * batch, [ctx - 1] * batch, slots).to("cuda")
            q = torch.randn(batch, HQ, HD, device="cuda", dtype=torch.bfloat16, generator=gen)
            line = f"B {batch:2d} ctx {ctx:6d}:"
            for name, cfg in configs.items():
                fn = partial(paged_attention, q, kc, vc, meta, HD**-0.5, cfg, "split")
                line += f"  {name} {graph_ms(fn) * 1e3:7.1f}"
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
