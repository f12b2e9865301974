"""CPU ops benchmark: deterministic C++ kernels against plain torch on SmolLM2-135M shapes.

    python -m bench.ops_cpu [--threads N] [--repeats R]    (from the repository root)

Measures each linear of the model (fp32 and bf16 weights) at M = 1, 16, 512, 1500, attention
at decode and prefill shapes, and a whole random-weight decoder step (decode at batch 1 and 16,
prefill of 512 and 1500 tokens) built from the ops. Prints a table, then one JSON document on
the last line. Timings are the best of --repeats samples.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from functools import partial

import torch

from lockstep.ops.base import AttentionMeta, LayerKV, Ops, build_attention_meta
from lockstep.ops.cpu_deterministic import CpuDeterministicOps
from lockstep.ops.cpu_stock import CpuStockOps

# SmolLM2-135M
HIDDEN, INTER, LAYERS, HQ, HKV, HEAD_DIM, VOCAB = 576, 1536, 30, 9, 3, 64, 49152
LINEARS = {  # name: (N, K); q/k/v and gate/up fused as the decoder is expected to run them
    "qkv": ((HQ + 2 * HKV) * HEAD_DIM, HIDDEN),
    "o": (HIDDEN, HQ * HEAD_DIM),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
    "lm_head": (VOCAB, HIDDEN),
}


def best_time(fn: Callable[[], object], repeats: int, min_seconds: float = 0.05) -> float:
    """Fastest seconds per call over `repeats` batches (each at least min_seconds long): the
    minimum, not the median, because the CPU may be shared and interference only adds."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-6)
    inner = max(1, int(min_seconds / once))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - start) / inner)
    return min(samples)


def bench_linears(ops: dict[str, Ops], repeats: int) -> list[dict]:
    rows = []
    for wdtype in (torch.float32, torch.bfloat16):
        for name, (n, k) in LINEARS.items():
            weight = torch.randn(n, k).to(wdtype)
            for m in (1, 16, 512, 1500):
                if name == "lm_head" and m > 16:
                    continue  # the decoder only projects the rows it samples from
                x = torch.randn(m, k)
                row = {"op": f"linear.{name}", "wdtype": str(wdtype)[6:], "M": m, "N": n, "K": k}
                for label, backend in ops.items():
                    w = backend.prepare_linear_weight(weight)
                    sec = best_time(partial(backend.linear, x, w), repeats)
                    row[f"{label}_ms"] = sec * 1e3
                    row[f"{label}_GBps"] = w.numel() * w.element_size() / sec / 1e9
                    row[f"{label}_GFLOPs"] = 2 * m * n * k / sec / 1e9
                rows.append(row)
    return rows


def paged_batch(
    counts: list[int], starts: list[int], num_slots: int
) -> tuple[AttentionMeta, torch.Tensor]:
    """Metadata with every sequence's slots scattered over the cache, and its positions."""
    perm = torch.randperm(num_slots)
    tables, used = [], 0
    for n, s in zip(counts, starts, strict=True):
        tables.append(perm[used : used + n + s].to(torch.int32))
        used += n + s
    meta = build_attention_meta(counts, starts, tables)
    positions = torch.cat([torch.arange(s, s + n) for n, s in zip(counts, starts, strict=True)])
    return meta, positions


def bench_attention(ops: dict[str, Ops], repeats: int) -> list[dict]:
    rows = []
    cases = {
        "decode b1 ctx 512": ([1], [511]),
        "decode b16 ctx 512": ([1] * 16, [511] * 16),
        "prefill 512": ([512], [0]),
        "prefill 1500": ([1500], [0]),
    }
    for cache_dtype in (torch.float32, torch.bfloat16):
        for label, (counts, starts) in cases.items():
            slots = sum(counts) + sum(starts) + 16
            k_cache = torch.randn(slots, HKV, HEAD_DIM).to(cache_dtype)
            v_cache = torch.randn(slots, HKV, HEAD_DIM).to(cache_dtype)
            kv = LayerKV(k_cache, v_cache)
            meta, _ = paged_batch(counts, starts, slots)
            q = torch.randn(sum(counts), HQ, HEAD_DIM)
            row = {"op": f"attention {label}", "cache": str(cache_dtype)[6:]}
            for name, backend in ops.items():
                sec = best_time(partial(backend.attention, q, kv, meta, HEAD_DIM**-0.5), repeats)
                row[f"{name}_ms"] = sec * 1e3
            rows.append(row)
    return rows


class RandomDecoder:
    """SmolLM2-135M-shaped decoder with random weights, run through one `Ops` backend."""

    def __init__(self, ops: Ops, wdtype: torch.dtype, num_slots: int) -> None:
        self.ops = ops
        gen = torch.Generator().manual_seed(0)

        def w(n: int, k: int) -> torch.Tensor:
            return ops.prepare_linear_weight((torch.randn(n, k, generator=gen) * 0.05).to(wdtype))

        self.layers = [
            {name: w(n, k) for name, (n, k) in LINEARS.items() if name != "lm_head"}
            for _ in range(LAYERS)
        ]
        self.lm_head = w(VOCAB, HIDDEN)
        self.norm = torch.ones(HIDDEN)
        kv = (LAYERS, num_slots, HKV, HEAD_DIM)
        self.k_cache, self.v_cache = torch.zeros(kv), torch.zeros(kv)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
        angles = torch.arange(8192, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.cos, self.sin = angles.cos().float(), angles.sin().float()

    def step(self, hidden: torch.Tensor, meta: AttentionMeta, positions: torch.Tensor) -> None:
        ops, t = self.ops, hidden.shape[0]
        slots = torch.cat(
            [
                meta.slot_table[int(meta.cu_kv[b]) + int(meta.q_start[b]) : int(meta.cu_kv[b + 1])]
                for b in range(meta.num_seqs)
            ]
        )
        residual = torch.zeros_like(hidden)
        for i, layer in enumerate(self.layers):
            x, residual = ops.add_rms_norm(hidden, residual, self.norm, 1e-5)
            qkv = ops.linear(x, layer["qkv"])
            q, k, v = qkv.split([HQ * HEAD_DIM, HKV * HEAD_DIM, HKV * HEAD_DIM], dim=1)
            q = ops.rope(q.reshape(t, HQ, HEAD_DIM), positions, self.cos, self.sin)
            k = ops.rope(k.reshape(t, HKV, HEAD_DIM), positions, self.cos, self.sin)
            ops.write_kv(self.k_cache[i], self.v_cache[i], k, v.reshape(t, HKV, HEAD_DIM), slots)
            a = ops.attention(q, LayerKV(self.k_cache[i], self.v_cache[i]), meta, HEAD_DIM**-0.5)
            hidden = ops.linear(a.reshape(t, HQ * HEAD_DIM), layer["o"])
            x, residual = ops.add_rms_norm(hidden, residual, self.norm, 1e-5)
            hidden = ops.linear(ops.silu_mul(ops.linear(x, layer["gate_up"])), layer["down"])
        x, _ = ops.add_rms_norm(hidden, residual, self.norm, 1e-5)
        last = (meta.cu_q[1:] - 1).long()  # logits only for the last row of each sequence
        ops.log_softmax(ops.linear(x[last], self.lm_head))


def bench_model(ops: dict[str, Ops], repeats: int) -> list[dict]:
    rows = []
    cases = {  # label: (query rows per sequence, cached prefix per sequence)
        "decode b1 ctx 128": ([1], [127]),
        "decode b16 ctx 128": ([1] * 16, [127] * 16),
        "prefill 512": ([512], [0]),
        "prefill 1500": ([1500], [0]),
    }
    for wdtype in (torch.float32, torch.bfloat16):
        for name, backend in ops.items():
            model = RandomDecoder(backend, wdtype, num_slots=4096)
            for label, (counts, starts) in cases.items():
                meta, positions = paged_batch(counts, starts, 4096)
                hidden = torch.randn(sum(counts), HIDDEN)
                reps = repeats if sum(counts) < 100 else max(3, repeats // 3)
                sec = best_time(partial(model.step, hidden, meta, positions), reps, 0.0)
                tokens = sum(counts)
                rows.append(
                    {
                        "op": f"model {label}",
                        "wdtype": str(wdtype)[6:],
                        "backend": name,
                        "ms_per_step": sec * 1e3,
                        "tok_per_s": tokens / sec,
                    }
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--repeats", type=int, default=7, help="timing samples per case")
    parser.add_argument("--skip-model", action="store_true", help="skip whole-model steps")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ops: dict[str, Ops] = {"det": CpuDeterministicOps(), "stock": CpuStockOps()}

    linears = bench_linears(ops, args.repeats)
    print(
        f"{'op':16s} {'w':8s} {'M':>5s} {'det ms':>9s} {'det GB/s':>9s} {'det GF/s':>9s}"
        f" {'torch ms':>9s} {'torch GF/s':>10s}"
    )
    for r in linears:
        print(
            f"{r['op']:16s} {r['wdtype']:8s} {r['M']:5d} {r['det_ms']:9.3f} {r['det_GBps']:9.1f}"
            f" {r['det_GFLOPs']:9.1f} {r['stock_ms']:9.3f} {r['stock_GFLOPs']:10.1f}"
        )
    attention = bench_attention(ops, args.repeats)
    print(f"\n{'op':32s} {'cache':9s} {'det ms':>9s} {'torch ms':>9s}")
    for r in attention:
        print(f"{r['op']:32s} {r['cache']:9s} {r['det_ms']:9.3f} {r['stock_ms']:9.3f}")
    model = [] if args.skip_model else bench_model(ops, args.repeats)
    if model:
        print(f"\n{'step':26s} {'w':9s} {'backend':8s} {'ms/step':>9s} {'tok/s':>9s}")
        for r in model:
            print(
                f"{r['op']:26s} {r['wdtype']:9s} {r['backend']:8s} {r['ms_per_step']:9.2f}"
                f" {r['tok_per_s']:9.1f}"
            )
    print(
        json.dumps(
            {
                "benchmark": "ops_cpu",
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "machine": platform.processor() or platform.machine(),
                "linear": linears,
                "attention": attention,
                "model": model,
            }
        )
    )


if __name__ == "__main__":
    main()
