"""Benchmark the deterministic GPU MoE on Qwen3-30B-A3B shapes: the layer, and batch-1 decode.

    python -m bench.gpu_moe [--sweep] [--skip-decode] [--out results.json]   (repository root)

Layer (128 experts, top 8, hidden 2048, expert width 768, bf16, random weights): at T tokens
in {1, 8, 32, 256, 2048, 8192}, `GpuDeterministicOps.moe` (routing kernel, device grouping,
grouped GEMMs, combine) against `GpuFastOps.moe` (torch's grouped GEMM) and, up to T 32, the
dense every-expert path, all timed as CUDA-graph replays after a clean L2; the floor is the
bytes the layer must read (router, the distinct experts the tokens chose, x and out) at the
measured copy rate. With --sweep, candidate tile configs of each grouped GEMM per T bucket.

Decode: `random:qwen3-30b-a3b` through the engine (CUDA graphs, greedy, batch 1, 512-token
prompt, 64 timed steps), deterministic and fast, against the batch-1 floor: the bytes one
token must read at the mean context (`decode_floor`), at the measured copy rate.

Prints a table and ONE JSON document on the last line. torch + triton only (no server).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import sys

import torch
import triton

from bench.gpu_kernels import copy_bandwidth, graph_ms
from lockstep.models.spec import ModelSpec
from lockstep.ops.gpu_deterministic import GpuDeterministicOps
from lockstep.ops.gpu_fast import GpuFastOps, grouped_mm_runs
from lockstep.ops.moe import MoeLayer, experts_dense, prepare_expert_weights
from lockstep.ops.triton import moe as gm

E, TOP_K, H, INTER = 128, 8, 2048, 768
TS = (1, 8, 32, 256, 2048, 8192)
DENSE_MAX_T = 32  # the every-expert path costs E/k times the arithmetic: small T only
MODEL = "random:qwen3-30b-a3b"
PROMPT_LEN, GEN_LEN = 512, 64

_G = gm.GroupedConfig
SWEEP = {  # T: candidates, tried for both grouped GEMMs
    1: [_G(16, 64, 256, 4, 3), _G(16, 64, 256, 2, 3), _G(16, 64, 256, 8, 3), _G(16, 128, 256, 4, 2),
        _G(16, 32, 256, 2, 4), _G(16, 64, 128, 2, 5), _G(16, 128, 128, 8, 3)],
    256: [_G(32, 64, 128, 4, 4), _G(32, 128, 128, 4, 3), _G(32, 64, 256, 4, 3),
          _G(16, 128, 128, 4, 4)],
    2048: [_G(64, 128, 64, 4, 4), _G(128, 256, 64, 8, 3), _G(64, 256, 64, 8, 3),
           _G(128, 128, 64, 8, 4), _G(64, 128, 128, 4, 3)],
    8192: [_G(64, 128, 64, 4, 4), _G(128, 256, 64, 8, 3), _G(128, 128, 64, 8, 3),
           _G(64, 256, 64, 8, 3)],
}  # fmt: skip


def decode_floor(spec: ModelSpec, context: int) -> dict[str, int]:
    """Bytes one batch-1 decode step must read (bf16 weights, fp32 norm weights): every
    layer's attention projections, q/k norms, two norms, and MLP (a sparse layer: its router
    and top_k experts' gate, up and down; a dense layer: its MLP); the final norm, one
    embedding row, the LM head (the embedding matrix when tied); the K and V of `context`
    positions in every layer."""
    h, d = spec.hidden_size, spec.head_dim
    attn = h * (spec.num_heads + 2 * spec.num_kv_heads) * d + spec.num_heads * d * h
    norms = 4 * (2 * h + (2 * d if spec.qk_norm else 0))
    layers = {"attention": 0, "norms": 0, "router": 0, "experts": 0, "dense_mlp": 0}
    for i in range(spec.num_layers):
        layers["attention"] += 2 * attn
        layers["norms"] += norms
        if spec.moe is not None and i in spec.moe.sparse_layers:
            layers["router"] += 2 * spec.moe.num_experts * h
            layers["experts"] += 2 * spec.moe.top_k * 3 * spec.moe.intermediate_size * h
        else:
            layers["dense_mlp"] += 2 * 3 * spec.intermediate_size * h
    return layers | {
        "final_norm_embedding_row": 4 * h + 2 * h,
        "lm_head": 2 * spec.vocab_size * h,
        "kv": 2 * 2 * spec.num_layers * spec.num_kv_heads * d * context,
    }


def make_layer(seed: int = 0) -> MoeLayer:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int, fan_in: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda") / fan_in**0.5).to(torch.bfloat16)

    prep = GpuDeterministicOps().prepare_linear_weight
    gate_up = prepare_expert_weights(prep, randn(E, 2 * INTER, H, fan_in=H))
    down = prepare_expert_weights(prep, randn(E, H, INTER, fan_in=INTER))
    return MoeLayer(prep(randn(E, H, fan_in=H)), gate_up, down, TOP_K, True)


def _try_graph_ms(fn, log) -> float | None:
    """graph_ms, or None (logged) where the yardstick cannot be captured or run."""
    try:
        return graph_ms(fn)
    except Exception as exc:  # the stock path on a torch without graph-safe grouped GEMM
        log(f"  {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        return None


def run_layer(layer: MoeLayer, bandwidth: float, log) -> list[dict]:
    """bandwidth: TB/s."""
    det, fast = GpuDeterministicOps(), GpuFastOps()
    rows = []
    for t in TS:
        x = torch.randn(t, H, device="cuda").to(torch.bfloat16)
        experts = gm.route(gm.router_logits(x, layer), TOP_K, True).experts
        distinct = int(experts.unique().numel())
        floor_bytes = 2 * (E * H + distinct * 3 * INTER * H + 2 * t * H)
        row = {
            "tokens": t,
            "distinct_experts": distinct,
            "floor_ms": floor_bytes / bandwidth / 1e9,
            "det_ms": graph_ms(lambda x=x: det.moe(x, layer)),
            "fast_ms": _try_graph_ms(lambda x=x: fast.moe(x, layer), log),
            "fast_impl": "torch._grouped_mm" if grouped_mm_runs(x, layer) else "every expert",
        }
        if t <= DENSE_MAX_T:
            routed = experts

            def dense(x=x, routed=routed):
                return experts_dense(x, routed, layer, det.linear, det.silu_mul)

            row["dense_every_expert_ms"] = graph_ms(dense)
        row["tflops_det"] = 2 * t * TOP_K * 3 * INTER * H / row["det_ms"] / 1e9
        rows.append(row)
        log(f"T {t:>5}  experts {distinct:>3}  det {row['det_ms']:.4f} ms  fast "
            f"{row['fast_ms'] or float('nan'):.4f} ms ({row['fast_impl']})  "
            f"floor {row['floor_ms']:.4f} ms  "
            f"{row.get('dense_every_expert_ms', float('nan')):.4f} ms every-expert  "
            f"{row['tflops_det']:.1f} TFLOP/s")  # fmt: skip
    return rows


def _short(cfg: gm.GroupedConfig) -> str:
    return f"{cfg.bm}x{cfg.bn}x{cfg.bk}w{cfg.num_warps}s{cfg.num_stages}"


def kernel_breakdown(layer: MoeLayer, t: int, log) -> list[dict]:
    """The kernels of one deterministic layer call at T tokens, replayed from a CUDA graph
    (warm L2: the weights of the chosen experts may stay resident between replays), with
    each kernel's duration in us, in launch order."""
    from torch.profiler import ProfilerActivity, profile

    from bench.gpu_kernels import capture_graph
    from bench.kernel_trace import kernel_events

    det = GpuDeterministicOps()
    x = torch.randn(t, H, device="cuda").to(torch.bfloat16)
    graph = capture_graph(lambda: det.moe(x, layer))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    events = [{"kernel": e["name"][:48], "us": round(e["dur"], 2)} for e in kernel_events(prof)]
    log(f"kernels T {t}: " + " | ".join(f"{e['kernel'][:28]} {e['us']:.1f}" for e in events))
    return events


def run_sweep(layer: MoeLayer, log) -> dict[str, dict[str, float | None]]:
    """Each grouped GEMM alone, per candidate config, at T tokens (graph replays):
    {"gate_up T1": {"16x64x256w4s3": us, ...}, ...}."""
    rows: dict[str, dict[str, float | None]] = {}
    for t, configs in SWEEP.items():
        x = torch.randn(t, H, device="cuda").to(torch.bfloat16)
        routing = gm.route(gm.router_logits(x, layer), TOP_K, True)
        order, offsets = gm.group_slots(routing.experts, E)
        h = gm.grouped_gemm(x, layer.gate_up, order, offsets, TOP_K, gather=True,
                            scatter=False, silu=True, config=configs[0])  # fmt: skip
        for name, a, w, gather, silu in (("gate_up", x, layer.gate_up, True, True),
                                         ("down", h, layer.down, False, False)):  # fmt: skip
            cells = []
            for cfg in configs:

                def call(a=a, w=w, gather=gather, silu=silu, cfg=cfg, o=order, off=offsets):
                    gm.grouped_gemm(a, w, o, off, TOP_K, gather=gather,
                                    scatter=not gather, silu=silu, config=cfg)  # fmt: skip

                try:
                    ms = graph_ms(call)
                except Exception as exc:  # a candidate that does not compile (shared memory)
                    ms, cells = None, [*cells, f"{_short(cfg)} {type(exc).__name__}"]
                else:
                    cells.append(f"{_short(cfg)} {1e3 * ms:.1f}us")
                rows.setdefault(f"{name} T{t}", {})[_short(cfg)] = ms and 1e3 * ms
            log(f"sweep {name:<7} T {t:>4}: " + " | ".join(cells))
    return rows


def run_decode(bandwidth: float, log) -> list[dict]:
    """bandwidth: TB/s."""

    rows = []
    for mode in ("deterministic", "fast"):
        try:
            rows.append(_decode_mode(mode, bandwidth, log))
        except Exception as exc:  # report the other mode anyway
            log(f"decode batch 1 {mode}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            rows.append({"mode": mode, "error": f"{type(exc).__name__}: {exc}"[:500]})
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def _decode_mode(mode: str, bandwidth: float, log) -> dict:
    from lockstep.bench.decode import run_decode_bench
    from lockstep.config import EngineConfig
    from lockstep.engine.engine import Engine

    engine = Engine(EngineConfig(model=MODEL, device="cuda", dtype="bfloat16", mode=mode,
                                 kv_tokens=16384, max_model_len=4096, max_running=1))  # fmt: skip
    run_decode_bench(engine, 1, PROMPT_LEN, 2, seed=99)  # compile, capture
    result = run_decode_bench(engine, 1, PROMPT_LEN, GEN_LEN)
    floor = decode_floor(engine.decoder.spec, PROMPT_LEN + GEN_LEN // 2)
    floor_ms = sum(floor.values()) / bandwidth / 1e9
    log(f"decode batch 1 {mode:<13} {result.decode_ms_per_step:.3f} ms/token  floor "
        f"{floor_ms:.3f} ms ({sum(floor.values()) / 1e9:.3f} GB)  "
        f"{100 * floor_ms / result.decode_ms_per_step:.0f}% of the floor")  # fmt: skip
    ms = result.decode_ms_per_step
    return {"mode": mode, "ms_per_token": ms, "floor_ms": floor_ms, "floor_bytes": floor,
            "fraction_of_floor": floor_ms / ms}  # fmt: skip


def _rounded(value):
    """Floats to 4 significant digits (the JSON line stays short)."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time candidate tile configs")
    parser.add_argument("--skip-decode", action="store_true", help="layer figures only")
    parser.add_argument("--out", default=None, help="also write the JSON document here")
    args = parser.parse_args(argv)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    bandwidth = copy_bandwidth()
    log(f"device copy {bandwidth:.2f} TB/s ({torch.cuda.get_device_name()})")
    layer = make_layer()
    doc = {
        "benchmark": "gpu_moe",
        "command": " ".join(["python -m bench.gpu_moe", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "copy_tb_s": bandwidth,
        "layer": run_layer(layer, bandwidth, log),
    }  # fmt: skip
    doc["kernels"] = {t: kernel_breakdown(layer, t, log) for t in (1, 256)}
    if args.sweep:
        doc["sweep"] = run_sweep(layer, log)
    del layer
    torch.cuda.empty_cache()
    if not args.skip_decode:
        doc["decode"] = run_decode(bandwidth, log)
    text = json.dumps(_rounded(doc))
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(doc, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
