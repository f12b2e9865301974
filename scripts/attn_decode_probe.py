"""Probe why small decode attention (batch 1) runs far above its floor: time the split path's
two kernels for several split sizes and stage counts (timing only: the split size is part of
the numerics, so only the production value is a valid configuration).

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
    kc = torch.randn(70000, HKV, HD, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn_like(kc)
    for ctx in (64, 512, 1024, 4096, 32768):
        for batch in (1, 8):
            slots = paged_slots([ctx] * batch, seed=ctx)
            meta = build_attention_meta([1] * batch, [ctx - 1] * batch, slots).to("cuda")
            q = torch.randn(batch, HQ, HD, device="cuda", dtype=torch.bfloat16, generator=gen)
            line = f"ctx {ctx:6d} B {batch:2d}:"
            for split in (64, 128, 512):
                for stages in (2, 3):
                    cfg = replace(DEFAULT_CONFIG, split=split, num_stages_split=stages)

                    fn = partial(paged_attention, q, kc, vc, meta, HD**-0.5, cfg, "split")
                    line += f"  s{split}/st{stages} {graph_ms(fn) * 1e3:6.1f}"
            print(line, flush=True)
    # An empty-ish kernel's cost in a graph, for scale: one tiny copy.
    a = torch.zeros(16, device="cuda")
    b = torch.zeros(16, device="cuda")
    print(
        f"tiny copy in a graph: {graph_ms(lambda: b.copy_(a)) * 1e3:.1f} us; "
        f"eager {bench_ms(lambda: b.copy_(a)) * 1e3:.1f} us"
    )


if __name__ == "__main__":
    main()
