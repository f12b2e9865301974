"""Benchmark the deterministic GPU MoE on Qwen3-30B-A3B shapes: the layer, and batch-1 decode.

    python -m bench.gpu_moe [--fp8] [--sweep] [--skip-decode] [--out results.json]   (repo root)

Layer (128 experts, top 8, hidden 2048, expert width 768, bf16, random weights): at T tokens
in {1, 8, 32, 256, 2048, 8192}, `GpuDeterministicOps.moe` (routing kernel, device grouping,
grouped GEMMs, combine) against `GpuStockOps.moe` (torch's grouped GEMM) and, up to T 32, the
dense every-expert path, all timed as CUDA-graph replays after a clean L2; the floor is the
bytes the layer must read (router, the distinct experts the tokens chose, x and out) at the
measured copy rate. With --sweep, candidate tile configs of each grouped GEMM per T bucket.

Decode: `random:qwen3-30b-a3b` through the engine (CUDA graphs, greedy, batch 1, 512-token
prompt, 64 timed steps), deterministic and reference (stock torch), against the batch-1 floor: the bytes one
token must read at the mean context (`decode_floor`), at the measured copy rate.

--fp8: the same with block-FP8 experts (`lockstep/ops/triton/fp8_moe.py`; every expert part
quantized in 128x128 blocks, the router bf16) and `random:qwen3-30b-a3b-fp8`; the floors
count one byte per FP8 weight (block scales, under 0.03% of the bytes, left out). Reference mode
dequantizes every expert at each call there: a control, not a yardstick. --sweep is for the
bf16 layer only.

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
from lockstep.ops import fp8
from lockstep.ops.gpu_deterministic import GpuDeterministicOps
from lockstep.ops.gpu_stock import GpuStockOps, grouped_mm_runs
from lockstep.ops.moe import MoeLayer, experts_dense, prepare_expert_weights, prepare_fp8_experts
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
    positions in every layer. FP8 models (`spec.fp8`): one byte per projection weight."""
    h, d = spec.hidden_size, spec.head_dim
    w = 1 if spec.fp8 is not None else 2  # bytes per projection weight
    attn = h * (spec.num_heads + 2 * spec.num_kv_heads) * d + spec.num_heads * d * h
    norms = 4 * (2 * h + (2 * d if spec.qk_norm else 0))
    layers = {"attention": 0, "norms": 0, "router": 0, "experts": 0, "dense_mlp": 0}
    for i in range(spec.num_layers):
        layers["attention"] += w * attn
        layers["norms"] += norms
        if spec.moe is not None and i in spec.moe.sparse_layers:
            layers["router"] += 2 * spec.moe.num_experts * h
            layers["experts"] += w * spec.moe.top_k * 3 * spec.moe.intermediate_size * h
        else:
            layers["dense_mlp"] += w * 3 * spec.intermediate_size * h
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


def make_fp8_layer(seed: int = 0) -> MoeLayer:
    """Block-FP8 experts of the same shapes: every expert's gate, up and down quantized in
    128x128 blocks (`fp8.quantize_weight`), prepared as `Decoder.load` does; router bf16."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    det = GpuDeterministicOps()
    shapes = {"gate": (INTER, H), "up": (INTER, H), "down": (H, INTER)}

    def stacked(parts: tuple[str, ...]):
        weights, scales = [], []
        for _ in range(E):
            for p in parts:
                n, k = shapes[p]
                w = torch.randn(n, k, generator=g, device="cuda") / k**0.5
                q, s, _ = fp8.quantize_weight(w, "block")
                weights.append(q)
                scales.append(s)
        return prepare_fp8_experts(det.prepare_fp8_linear, weights, scales, E)

    gate_up, down = stacked(("gate", "up")), stacked(("down",))
    router = (torch.randn(E, H, generator=g, device="cuda") / H**0.5).to(torch.bfloat16)
    return MoeLayer(det.prepare_linear_weight(router), gate_up.weight, down.weight, TOP_K, True,
                    gate_up.scale, down.scale)  # fmt: skip


def _try_graph_ms(fn, log) -> float | None:
    """graph_ms, or None (logged) where the yardstick cannot be captured or run."""
    try:
        return graph_ms(fn)
    except Exception as exc:  # the stock path on a torch without graph-safe grouped GEMM
        log(f"  {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        return None


def run_layer(layer: MoeLayer, bandwidth: float, log) -> list[dict]:
    """bandwidth: TB/s."""
    det, stock = GpuDeterministicOps(), GpuStockOps()
    rows = []
    for t in TS:
        x = torch.randn(t, H, device="cuda").to(torch.bfloat16)
        experts = gm.route(gm.router_logits(x, layer), TOP_K, True).experts
        distinct = int(experts.unique().numel())
        expert_bytes = 1 if layer.fp8 else 2
        floor_bytes = 2 * (E * H + 2 * t * H) + expert_bytes * distinct * 3 * INTER * H
        row = {
            "tokens": t,
            "distinct_experts": distinct,
            "floor_ms": floor_bytes / bandwidth / 1e9,
            "det_ms": graph_ms(lambda x=x: det.moe(x, layer)),
            "stock_ms": _try_graph_ms(lambda x=x: stock.moe(x, layer), log),
            "stock_impl": "dequantized every call" if layer.fp8
            else "torch._grouped_mm" if grouped_mm_runs(x, layer) else "every expert",
        }  # fmt: skip
        if t <= DENSE_MAX_T and not layer.fp8:
            routed = experts

            def dense(x=x, routed=routed):
                return experts_dense(x, routed, layer, det.linear, det.silu_mul)

            row["dense_every_expert_ms"] = graph_ms(dense)
        row["tflops_det"] = 2 * t * TOP_K * 3 * INTER * H / row["det_ms"] / 1e9
        rows.append(row)
        log(f"T {t:>5}  experts {distinct:>3}  det {row['det_ms']:.4f} ms  stock "
            f"{row['stock_ms'] or float('nan'):.4f} ms ({row['stock_impl']})  "
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


def run_decode(bandwidth: float, log, model: str = MODEL) -> list[dict]:
    """bandwidth: TB/s."""

    rows = []
    for mode in ("deterministic", "reference"):
        try:
            rows.append(_decode_mode(mode, bandwidth, log, model))
        except Exception as exc:  # report the other mode anyway
            log(f"decode batch 1 {mode}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            rows.append({"mode": mode, "error": f"{type(exc).__name__}: {exc}"[:500]})
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def _decode_mode(mode: str, bandwidth: float, log, model: str) -> dict:
    from lockstep.bench.decode import run_decode_bench
    from lockstep.config import EngineConfig
    from lockstep.engine.engine import Engine

    engine = Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16", mode=mode,
                                 kv_tokens=16384, max_model_len=4096, max_running=1))  # fmt: skip
    run_decode_bench(engine, 1, PROMPT_LEN, 2, seed=99)  # compile, capture
    result = run_decode_bench(engine, 1, PROMPT_LEN, GEN_LEN)
    floor = decode_floor(engine.decoder.spec, PROMPT_LEN + GEN_LEN // 2)
    floor_ms = sum(floor.values()) / bandwidth / 1e9
    log(f"decode batch 1 {model} {mode:<13} {result.decode_ms_per_step:.3f} ms/token  floor "
        f"{floor_ms:.3f} ms ({sum(floor.values()) / 1e9:.3f} GB)  "
        f"{100 * floor_ms / result.decode_ms_per_step:.0f}% of the floor")  # fmt: skip
    ms = result.decode_ms_per_step
    return {"model": model, "mode": mode, "ms_per_token": ms, "floor_ms": floor_ms, "floor_bytes": floor,
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
    parser.add_argument("--fp8", action="store_true", help="block-FP8 experts (module doc)")
    parser.add_argument("--sweep", action="store_true", help="time candidate tile configs")
    parser.add_argument("--skip-decode", action="store_true", help="layer figures only")
    parser.add_argument("--out", default=None, help="also write the JSON document here")
    args = parser.parse_args(argv)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    bandwidth = copy_bandwidth()
    log(f"device copy {bandwidth:.2f} TB/s ({torch.cuda.get_device_name()})")
    if args.fp8 and args.sweep:
        parser.error("--sweep times the bf16 grouped GEMM's candidates; drop --fp8 or --sweep")
    layer = make_fp8_layer() if args.fp8 else make_layer()
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
        doc["decode"] = run_decode(bandwidth, log, MODEL + ("-fp8" if args.fp8 else ""))
    text = json.dumps(_rounded(doc))
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(doc, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
