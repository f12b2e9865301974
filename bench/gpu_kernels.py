"""Benchmark the deterministic Triton kernels against cuBLAS and torch SDPA on one GPU.

    python -m bench.gpu_kernels [--sweep] [--out results.json]    (from the repository root)

Matmul: Qwen3-8B projection shapes at M in {1, 8, 32, 128, 512, 2048, 8192}, the table's
config (and with --sweep, candidate configs) against cuBLAS F.linear, both timed as CUDA-graph
replays, plus a bit check (float32 output) that row 0 is identical for every M and config.
Attention: causal prefill of one 4k/16k/32k sequence against torch SDPA (flash), and decode at
batch 1/32/128 over 1k/8k/32k contexts against the HBM floor (bytes of K and V read over the
measured device copy bandwidth), plus a bit check that decode rows equal prefill rows. Prints a
table and ONE JSON document on the last line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from lockstep.ops.base import build_attention_meta
from lockstep.ops.triton import matmul as mm
from lockstep.ops.triton.attention import (
    DEFAULT_CONFIG,
    AttentionConfig,
    attention_path,
    needs_wide_offsets,
    paged_attention,
)

SHAPES = {  # name: (N, K), Qwen3-8B
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (24576, 4096),
    "down": (4096, 12288),
    "lm_head": (151936, 4096),
}
MS = (1, 8, 32, 128, 512, 2048, 8192)
HQ, HKV, HD = 32, 8, 128

C = mm.MatmulConfig
SWEEP_MM = {
    16: [
        C(16, 32, 256, 4, 5, tma=True),
        C(16, 32, 256, 4, 5, tma=True, split_programs=True),
        C(16, 64, 256, 4, 4, tma=True, split_programs=True),
        C(16, 64, 128, 4, 6, tma=True, split_programs=True),
        C(16, 128, 128, 4, 4, tma=True, split_programs=True),
        C(16, 32, 256, 4, 4, split_programs=True),
    ],
    32: [
        C(32, 32, 256, 4, 5, tma=True),
        C(32, 32, 256, 4, 5, tma=True, split_programs=True),
        C(32, 64, 256, 4, 4, tma=True, split_programs=True),
        C(32, 64, 128, 4, 5, tma=True, split_programs=True),
        C(32, 64, 128, 4, 6, tma=True),
        C(32, 128, 128, 4, 4, tma=True),
        C(32, 128, 64, 4, 6, tma=True),
        C(64, 64, 128, 4, 4, tma=True),
        C(64, 128, 64, 4, 5, tma=True),
        C(32, 32, 128, 2, 8, tma=True),
    ],
    128: [
        C(64, 64, 256, 4, 3, tma=True),
        C(64, 64, 256, 4, 3, tma=True, split_programs=True),
        C(128, 64, 128, 4, 3, tma=True, split_programs=True),
        C(64, 128, 128, 4, 4, tma=True, split_programs=True),
        C(128, 128, 64, 8, 4, tma=True, split_programs=True),
        C(64, 128, 64, 4, 5, tma=True),
        C(64, 256, 64, 8, 4, tma=True),
        C(128, 64, 64, 4, 5, tma=True),
        C(128, 128, 64, 8, 4, tma=True, persistent=True),
        C(128, 128, 128, 8, 3, tma=True),
        C(64, 128, 128, 4, 4, tma=True),
        C(128, 256, 64, 8, 3, tma=True),
        C(64, 64, 128, 4, 4, tma=True),
    ],
    # Decode at batch 129-256 (RL rollouts): the waves of 132 SMs matter as much as the tile.
    256: [
        C(256, 128, 64, 8, 3, tma=True),
        C(128, 128, 64, 8, 4, tma=True),
        C(128, 128, 64, 8, 4, tma=True, persistent=True),
        C(128, 128, 64, 8, 4, tma=True, persistent=True, warp_specialize=True),
        C(128, 256, 64, 8, 3, tma=True, persistent=True),
        C(128, 256, 64, 8, 3, tma=True, persistent=True, warp_specialize=True),
        C(256, 128, 64, 8, 3, tma=True, persistent=True),
        C(128, 64, 64, 4, 4, tma=True),
        C(128, 64, 128, 4, 4, tma=True),
        C(128, 64, 64, 4, 5, tma=True, persistent=True),
        C(64, 128, 64, 4, 5, tma=True),
        C(64, 128, 128, 4, 4, tma=True),
        C(64, 128, 64, 4, 5, tma=True, persistent=True),
        C(64, 256, 64, 4, 4, tma=True),
        C(64, 256, 64, 8, 4, tma=True, persistent=True),
        C(64, 64, 128, 4, 4, tma=True),
        C(128, 128, 64, 8, 4, tma=True, split_programs=True),
        C(64, 128, 128, 4, 4, tma=True, split_programs=True),
    ],
    512: [
        C(128, 128, 64, 8, 4, tma=True),
        C(128, 128, 64, 8, 4, tma=True, split_programs=True),
        C(128, 128, 64, 8, 4, tma=True, persistent=True),
        C(128, 64, 64, 4, 4, tma=True, split_programs=True),
        C(128, 256, 64, 8, 3, tma=True),
        C(128, 256, 64, 8, 4, tma=True, persistent=True),
        C(64, 256, 64, 8, 4, tma=True),
        C(256, 128, 64, 8, 3, tma=True),
        C(128, 128, 128, 8, 3, tma=True),
        C(64, 128, 64, 4, 5, tma=True),
    ],
    1 << 62: [
        C(128, 128, 64, 8, 4, tma=True, persistent=True),
        C(128, 128, 64, 8, 5, tma=True),
        C(128, 256, 64, 8, 3, tma=True),
        C(128, 256, 64, 8, 4, tma=True, persistent=True),
        C(256, 128, 64, 8, 3, tma=True),
        C(128, 128, 64, 8, 4, tma=True, persistent=True, group_m=16),
        C(128, 128, 64, 8, 4, tma=True, persistent=True, group_m=16, warp_specialize=True),
        C(128, 256, 64, 8, 3, tma=True, persistent=True, warp_specialize=True),
    ],
}
# The table (DEFAULT_CONFIG): "r128n64w8s3mma" and "r16n64w2s3mma" below.
SWEEP_ATTN_PREFILL = {
    "r128n64w8s3mma": AttentionConfig(rows=128, num_warps=8, num_stages=3),
    "r128n64w8s4mma": AttentionConfig(rows=128, num_warps=8, num_stages=4),
    "r64n64w4s3mma": AttentionConfig(rows=64, num_warps=4, num_stages=3),
    # Slot ids loaded in the block's own iteration instead of a block ahead.
    "r128n64w8s3mmaplain": AttentionConfig(rows=128, num_warps=8, num_stages=3, slots_ahead=False),
    # Other split sizes (other numerics): timing, and their own decode = prefill check.
    "r128n64w8s3sp256": AttentionConfig(rows=128, num_warps=8, num_stages=3, split=256),
    "r128n64w8s3sp128": AttentionConfig(rows=128, num_warps=8, num_stages=3, split=128),
}
# Each decode config's bits are compared with the first prefill config of its split size.
SWEEP_ATTN_DECODE = {
    "r16n64w1s3mma": AttentionConfig(rows_split=16, num_warps_split=1),
    "r16n64w2s3mma": AttentionConfig(rows_split=16, num_warps_split=2),
    # Slot ids ahead at any grid size (the bits run's programs are above the table's
    # residency limit, so the table row runs without) and never.
    "r16n64w2s3mmaahead": AttentionConfig(slots_ahead_programs_per_sm=1 << 30),
    "r16n64w2s3mmaplain": AttentionConfig(slots_ahead_split=False),
    "r16n64w2s4mma": AttentionConfig(rows_split=16, num_stages_split=4),
    "r64n64w4s3mma": AttentionConfig(rows_split=64, num_warps_split=4),
    "r16n64w4s3mma": AttentionConfig(rows_split=16, num_warps_split=4),
    "r16n64w8s3mma": AttentionConfig(rows_split=16, num_warps_split=8),
    "r16n64w2s3sp256": AttentionConfig(rows_split=16, num_warps_split=2, split=256),
    "r16n64w2s3sp128": AttentionConfig(rows_split=16, num_warps_split=2, split=128),
}


_FLUSH: list[torch.Tensor] = []


def flush_l2() -> None:
    """Evict L2 by READING a buffer larger than it. Writing one (triton's do_bench zeroes a
    256 MiB buffer) leaves L2 full of dirty lines whose write-back the next kernel pays (about
    11 us on an H200), which would make every small-M matmul, ours and cuBLAS alike, look
    slower than in a real decode step."""
    if not _FLUSH:
        _FLUSH.append(torch.ones(512 << 20, dtype=torch.int8, device="cuda"))
    _FLUSH[0].sum(dtype=torch.int32)


def bench_ms(fn, rep: int = 60, warmup: int = 10) -> float:
    """Median ms of fn over `rep` calls, each after a clean L2 flush, timed by CUDA events."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    for start, end in zip(starts, ends, strict=True):
        flush_l2()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return float(np.median([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]))


def copy_bandwidth() -> float:
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a), rep=100)
    return 2 * a.numel() / ms / 1e9  # TB/s, bytes read + written


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """fn run once eagerly (compilation, warm-up), then captured as a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_ms(fn) -> float:
    """Median ms of CUDA-graph replays of fn: how decode-sized work runs in the engine, and
    free of host launch cost (Triton's launcher and TMA descriptor encoding take tens of us,
    which eager timing of short kernels would count)."""
    graph = capture_graph(fn)
    ms = bench_ms(graph.replay)
    del graph
    return ms


def graph_span_ms(fn, rep: int = 30) -> float:
    """Median ms, over CUDA-graph replays of fn each after a clean L2 flush, of the span from
    the replay's first kernel start to its last kernel end (the profiler's timestamps): the
    GPU's time on the work, without the graph launch that `graph_ms` also counts
    (`graph_launch_cost`; a decode step's graph of ~400 kernels pays it once, not per
    kernel). With PDL the kernels overlap; the span counts the overlap once
    (`charge_critical_path`). Only kernels count: memcpy and memset nodes are not in the
    profiler's kernel list (`kernel_events`)."""
    from torch.profiler import ProfilerActivity, profile

    from bench.kernel_trace import charge_critical_path, kernel_events

    graph = capture_graph(fn)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    sequence = [e["name"] for e in kernel_events(prof)]
    names, per_replay = set(sequence), len(sequence)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(rep):
            flush_l2()
            graph.replay()
        torch.cuda.synchronize()
    del graph
    # The flush's reduction is not one of the graph's kernels, so what is left falls into
    # runs of per_replay kernels, one per replay, in start order, each in the order of the
    # replay traced alone.
    events = [e for e in kernel_events(prof) if e["name"] in names]
    replays = [events[i : i + per_replay] for i in range(0, len(events), per_replay)]
    if (
        not per_replay
        or len(events) != rep * per_replay
        or any([e["name"] for e in r] != sequence for r in replays)
    ):
        raise RuntimeError(f"traced {len(events)} graph kernels over {rep} replays of "
                           f"{per_replay}: cannot tell the replays apart")  # fmt: skip
    spans = [charge_critical_path(r) for r in replays]
    return float(np.median(spans)) / 1e3


def row_digest(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).cpu().numpy().tobytes()


def run_matmul(sweep: bool, log, ms: tuple[int, ...] = MS,
               split_counts: tuple[int | None, ...] = (None,)) -> list[dict]:  # fmt: skip
    """Every shape x split count (None: the table's) x M: cuBLAS, the table config and (with
    sweep) the bucket's candidates, timed as graph replays; row 0's bits (float32 out) are
    collected per split count over all M and configs: one variant each is the contract."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k**-0.5
        xs = torch.randn(max(ms), k, device="cuda", dtype=torch.bfloat16, generator=gen)
        cublas_rows = set()
        cublas_ms = {}
        for m in ms:
            cublas_ms[m] = graph_ms(partial(F.linear, xs[:m], w))
            cublas_rows.add(row_digest(F.linear(xs[:m], w)[:1]))  # bf16: no fp32 out in cuBLAS
        for splits in split_counts:
            s_eff = splits or mm.split_count(k)
            ours_rows = set()
            for m in ms:
                x, t_cublas = xs[:m], cublas_ms[m]
                table_cfg = mm.pick_config(m, n, k)
                cands = [table_cfg]
                if sweep:
                    bucket = next(v for b, v in SWEEP_MM.items() if m <= b)
                    cands += [c for c in bucket if c != table_cfg]
                times = {}
                for cfg in cands:
                    run = partial(mm.matmul, x, w, config=cfg, splits=s_eff)
                    try:
                        y = run(out_dtype=torch.float32)
                    except Exception as exc:  # a candidate that does not compile is reported
                        log(f"mm {name} M={m} {cfg}: failed: {str(exc).splitlines()[0][:120]}")
                        continue
                    ours_rows.add(row_digest(y[:1]))
                    times[cfg] = graph_ms(run)
                if table_cfg not in times:
                    times[table_cfg] = float("nan")
                best = min((c for c in times if times[c] == times[c]), key=times.get)
                rec = {
                    "shape": name, "N": n, "K": k, "M": m, "splits": s_eff,
                    "cublas_ms": t_cublas, "table_ms": times[table_cfg],
                    "table_cfg": table_cfg.__dict__, "best_ms": times[best],
                    "best_cfg": best.__dict__, "table_vs_cublas": times[table_cfg] / t_cublas,
                    "best_vs_cublas": times[best] / t_cublas,
                    "tflops_table": 2 * m * n * k / times[table_cfg] / 1e9,
                    "all": [{"cfg": c.__dict__, "ms": t} for c, t in times.items()],
                }  # fmt: skip
                rows.append(rec)
                log(
                    f"mm {name:8s} S={s_eff} M={m:5d} cublas {t_cublas * 1e3:9.1f} us  table "
                    f"{times[table_cfg] * 1e3:9.1f} ({rec['table_vs_cublas']:.3f}x)  best "
                    f"{times[best] * 1e3:9.1f} ({rec['best_vs_cublas']:.3f}x) {best}"
                )
            rows.append({"shape": name, "splits": s_eff, "row0_variants_triton": len(ours_rows),
                         "row0_variants_cublas": len(cublas_rows)})  # fmt: skip
            log(f"mm {name} S={s_eff}: distinct bits of row 0 over M x configs: triton "
                f"{len(ours_rows)}, cublas over M {len(cublas_rows)}")  # fmt: skip
        torch.cuda.empty_cache()
    return rows


def paged_slots(lengths: list[int], page: int = 16, seed: int = 0) -> list[torch.Tensor]:
    """Token slots of each sequence: pages of `page` tokens in a shuffled pool."""
    n_pages = [(n + page - 1) // page for n in lengths]
    perm = torch.randperm(sum(n_pages), generator=torch.Generator().manual_seed(seed))
    out, at = [], 0
    for n, p in zip(lengths, n_pages, strict=True):
        pages = perm[at : at + p]
        at += p
        slots = (pages[:, None] * page + torch.arange(page)[None, :]).reshape(-1)[:n]
        out.append(slots.to(torch.int32))
    return out


def run_attention_bits(log) -> dict:
    """Float32 outputs of every position: one-row decodes (all positions as one batch of
    one-query sequences, split path) against full prefills, for every pair of configs."""
    length = 2100
    gen = torch.Generator(device="cuda").manual_seed(1)
    k = torch.randn(length + 64, HKV, HD, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    q = torch.randn(length, HQ, HD, device="cuda", dtype=torch.bfloat16, generator=gen)
    slots = paged_slots([length])[0]
    meta = build_attention_meta([length], [0], [slots]).to("cuda")
    f32 = torch.float32
    dmeta = build_attention_meta([1] * length, list(range(length)), [slots] * length).to("cuda")
    runs = {f"prefill:{n}": (c, "prefill", meta) for n, c in SWEEP_ATTN_PREFILL.items()}
    runs |= {f"decode:{n}": (c, "split", dmeta) for n, c in SWEEP_ATTN_DECODE.items()}
    # The decode tiles with the splits folded in-kernel (the path a full GPU of programs
    # takes): the table's config, with slot ids ahead forced on (this run's programs are
    # above the residency limit), and one-warp tiles.
    runs |= {f"fold:{n}": (SWEEP_ATTN_DECODE[n], "fold", dmeta)
             for n in ("r16n64w2s3mma", "r16n64w2s3mmaahead", "r16n64w1s3mma")}  # fmt: skip
    outs = {name: paged_attention(q, k, v, m, HD**-0.5, cfg, path, f32)
            for name, (cfg, path, m) in runs.items()}  # fmt: skip
    configs = {name: cfg for name, (cfg, _, _) in runs.items()}
    bases = {}
    for name, cfg in configs.items():
        bases.setdefault(cfg.split, name)
    result = {}
    for other, cfg in configs.items():
        base = bases[cfg.split]
        if other == base:
            continue
        diff = int((outs[base] != outs[other]).any(dim=-1).sum())
        result[f"{base}|{other}"] = {"differing_head_rows": diff, "of": length * HQ}
        log(f"bits {base} vs {other:24s}: {diff} of {length * HQ} head-rows differ (fp32 out)")
    return result


def run_prefill(sweep: bool, log) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    cfgs = SWEEP_ATTN_PREFILL if sweep else {"table": DEFAULT_CONFIG}
    for length in (4096, 16384, 32768):
        gen = torch.Generator(device="cuda").manual_seed(2)
        q = torch.randn(length, HQ, HD, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(length, HKV, HD, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        slots = paged_slots([length])[0]
        kc = torch.empty_like(k)
        vc = torch.empty_like(v)
        kc[slots.long().cuda()] = k
        vc[slots.long().cuda()] = v
        meta = build_attention_meta([length], [0], [slots]).to("cuda")
        qs = q.transpose(0, 1)[None]
        ks = k.repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)[None].contiguous()
        vs = v.repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)[None].contiguous()
        qs = qs.contiguous()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            t_sdpa = bench_ms(partial(F.scaled_dot_product_attention, qs, ks, vs, is_causal=True))
            ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)[0].transpose(0, 1)
        flops = 2 * length * length * HD * HQ
        for name, cfg in cfgs.items():
            out = paged_attention(q, kc, vc, meta, HD**-0.5, cfg, "prefill")
            err = float((out.float() - ref.float()).norm() / ref.float().norm())
            t = bench_ms(partial(paged_attention, q, kc, vc, meta, HD**-0.5, cfg, "prefill"))
            rec = {"len": length, "cfg": name, "ms": t, "sdpa_ms": t_sdpa, "vs_sdpa": t / t_sdpa,
                   "tflops": flops / t / 1e9, "sdpa_tflops": flops / t_sdpa / 1e9,
                   "rel_err_vs_sdpa": err}  # fmt: skip
            rows.append(rec)
            log(f"prefill L={length:6d} {name:11s} {t:8.3f} ms ({rec['tflops']:5.0f} TF/s)  "
                f"sdpa {t_sdpa:8.3f} ms ({rec['sdpa_tflops']:5.0f})  {t / t_sdpa:.3f}x  "
                f"err {err:.1e}")  # fmt: skip
        torch.cuda.empty_cache()
    return rows


def graph_launch_cost(log) -> dict:
    """What a CUDA-graph replay costs beyond its kernels, for reading the decode table's two
    columns: a 16-element add (a kernel; a same-dtype copy_ would be a memcpy node, which
    the profiler's kernel list leaves out) timed both ways."""
    a = torch.zeros(16, device="cuda")
    b = torch.zeros(16, device="cuda")

    def tiny() -> None:
        torch.add(a, 1.0, out=b)

    rec = {"graph_ms": graph_ms(tiny), "span_ms": graph_span_ms(tiny)}
    log(f"16-element add: graph replay {rec['graph_ms'] * 1e3:.1f} us, kernel span "
        f"{rec['span_ms'] * 1e3:.1f} us")  # fmt: skip
    return rec


def run_decode(sweep: bool, bandwidth: float, log) -> list[dict]:
    """Decode attention against its floor, timed two ways: graph replays (`graph_ms`) and
    the kernels' span within a replay (`graph_span_ms`, without the graph launch, which an
    engine's decode graph pays once per step). Each cell on a cache of its own tokens, as an
    engine's cache holds them: the offset width follows (`needs_wide_offsets`; 64-bit above
    2**21 tokens at Hkv 8 / D 128, here only batch 128 at 32k keys, which no engine on one
    H200 holds for 36 layers). `graph_ms_wide` times every cell on one 128 x 32k-token cache,
    so on 64-bit offsets (the same bits:
    `test_attention_64_bit_gather_offsets_give_the_same_bits`)."""
    rows = []
    cfgs = SWEEP_ATTN_DECODE if sweep else {"table": DEFAULT_CONFIG}
    max_tokens = 128 * 32768
    gen = torch.Generator(device="cuda").manual_seed(3)
    kc_all = torch.randn(max_tokens + 16, HKV, HD, device="cuda", dtype=torch.bfloat16,
                         generator=gen)  # fmt: skip
    vc_all = torch.randn_like(kc_all)
    for batch in (1, 32, 128):
        for ctx in (1024, 8192, 32768):
            slots = paged_slots([ctx] * batch, seed=batch + ctx)
            meta = build_attention_meta([1] * batch, [ctx - 1] * batch, slots).to("cuda")
            q = torch.randn(batch, HQ, HD, device="cuda", dtype=torch.bfloat16, generator=gen)
            cell_tokens = batch * ctx + 16  # paged_slots fills whole pages, a permutation
            kc, vc = kc_all[:cell_tokens], vc_all[:cell_tokens]
            wide = needs_wide_offsets(kc)
            kv_bytes = 2 * batch * ctx * HKV * HD * 2
            floor_ms = kv_bytes / (bandwidth * 1e12) * 1e3  # copy rate counts read+write bytes
            for name, cfg in cfgs.items():
                # The wrapper's own choice of path (fold or split), as in the engine; the
                # record names it (the wrapper's rule, asked with the call's own meta).
                path = attention_path(cfg, meta, HQ // HKV, HKV, kc.device)
                fn = partial(paged_attention, q, kc, vc, meta, HD**-0.5, cfg)
                t_eager = bench_ms(fn)
                t = graph_ms(fn)
                span = graph_span_ms(fn)
                wide_fn = partial(paged_attention, q, kc_all, vc_all, meta, HD**-0.5, cfg)
                t_wide = t if wide else graph_ms(wide_fn)
                rec = {"batch": batch, "ctx": ctx, "cfg": name, "path": path, "graph_ms": t,
                       "eager_ms": t_eager, "floor_ms": floor_ms, "floor_frac": floor_ms / t,
                       "span_ms": span, "floor_frac_span": floor_ms / span,
                       "cache_tokens": cell_tokens, "wide_offsets": wide,
                       "graph_ms_wide": t_wide,
                       "floor_frac_wide": floor_ms / t_wide}  # fmt: skip
                rows.append(rec)
                log(f"decode B={batch:3d} ctx={ctx:6d} {name:11s} {path:5s} "
                    f"{'64' if wide else '32'}-bit graph {t * 1e3:7.1f} us ({rec['floor_frac']:.2f}"
                    f" of floor {floor_ms * 1e3:6.1f})  kernels' span {span * 1e3:7.1f} "
                    f"({rec['floor_frac_span']:.2f})  eager {t_eager * 1e3:7.1f}  64-bit graph "
                    f"{t_wide * 1e3:7.1f} ({rec['floor_frac_wide']:.2f})")  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true", help="time candidate configs too")
    ap.add_argument("--only", default="bits,matmul,prefill,decode")
    ap.add_argument("--out", default=None, help="also write the JSON document here")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="matmul M values")
    ap.add_argument(
        "--splits",
        default="table",
        help="matmul K split counts to time, e.g. 1,2,4 (default: the table's)",
    )
    ap.add_argument("--shapes", default=",".join(SHAPES), help="matmul shapes")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("gpu_kernels needs CUDA")
    import triton

    lines: list[str] = []

    def log(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    only = set(args.only.split(","))
    doc = {
        "command": "python -m bench.gpu_kernels " + " ".join(argv or sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{torch.cuda.get_device_name()} ({platform.node()})",
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    # Bring the clocks up before the first timing, or the first shape times slow.
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(150):
        a @ a
    torch.cuda.synchronize()
    doc["copy_tb_s"] = bw = copy_bandwidth()
    log(f"device copy bandwidth {bw:.2f} TB/s")

    def save() -> None:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(doc, f, indent=1)

    if "bits" in only:
        doc["attention_bits"] = run_attention_bits(log)
        save()
    if "matmul" in only:
        splits = (None,) if args.splits == "table" else tuple(map(int, args.splits.split(",")))
        for name in set(SHAPES) - set(args.shapes.split(",")):
            del SHAPES[name]
        doc["matmul"] = run_matmul(
            args.sweep, log, tuple(int(m) for m in args.ms.split(",")), splits
        )
        save()
    if "prefill" in only:
        doc["prefill"] = run_prefill(args.sweep, log)
        save()
    if "decode" in only:
        doc["graph_launch"] = graph_launch_cost(log)
        doc["decode"] = run_decode(args.sweep, bw, log)
        save()
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
