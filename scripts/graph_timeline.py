"""Where the time of a captured decode step goes, kernel by kernel, inside the CUDA graph.

    python scripts/graph_timeline.py --model random:qwen3-8b [--batch 1] [--variants ...]

`profile_decode.py` breaks down an EAGER forward; with PDL each kernel there includes its wait
for the previous one, and the graph's overlaps are missing. This script captures the decode
forward of the engine's static batch as a graph, replays it under torch.profiler (kernels in a
graph are traced one by one) and charges every kernel the time by which it pushed the end of
the step's critical path: contribution = end - (latest end of any kernel before it), >= 0. The
contributions add up to the replay's span. Kernels on other streams (prefetch) are listed apart.

Variants (each captured and timed in turn, logits compared bit for bit with the first):
  name:proj=BM-BN-BK-WARPS-STAGES[-s],...   proj one of qkv, o, gate_up, down: that
  projection's matmul config at M <= 16 (TMA; a trailing -s: one program per K split),
  instead of the table's; attn_stages=N, attn_ahead_per_sm=N: the decode attention's
  num_stages_split and slots_ahead_programs_per_sm; merge_cols=N: the merge's column chunk;
  attn_fold=X: the decode path's fold_programs_per_sm (a number; a large one keeps
  multi-split decodes on the split path); attn_warps=N: the decode tile's warps;
  attn_ahead=0|1: the decode tiles' slots_ahead_split; merge_warps=N: the merge's warps.
  None of these changes a bit (the logits check says so again).
JSON on the last line.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench/

import torch  # noqa: E402

from bench.kernel_trace import charge_critical_path, kernel_events  # noqa: E402
from lockstep.config import EngineConfig  # noqa: E402
from lockstep.engine.engine import Engine  # noqa: E402
from lockstep.engine.sampling_params import SamplingParams  # noqa: E402
from lockstep.ops.triton import matmul as mm  # noqa: E402
from lockstep.ops.triton.attention import DEFAULT_CONFIG  # noqa: E402

LAYER_MATMULS = ("qkv", "o", "gate_up", "down")
ATTENTION_KEYS = {  # variant key: AttentionConfig field
    "attn_stages": "num_stages_split",
    "attn_ahead_per_sm": "slots_ahead_programs_per_sm",
    "merge_cols": "merge_cols",
    "attn_warps": "num_warps_split",
    "attn_fold": "fold_programs_per_sm",
    "attn_ahead": "slots_ahead_split",
    "merge_warps": "merge_warps",
}
FLOAT_KEYS = {"attn_fold"}
BOOL_KEYS = {"attn_ahead"}


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, rest = text.partition(":")
    opts = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in (*LAYER_MATMULS, *ATTENTION_KEYS) or not value:
            raise SystemExit(f"bad item {item!r} in {text!r}: want KEY=VALUE, KEY one of "
                             f"{LAYER_MATMULS} or {tuple(ATTENTION_KEYS)}")  # fmt: skip
        if key in LAYER_MATMULS:
            parse_config(value)  # refuse a malformed config before any engine is built
        elif key in FLOAT_KEYS:
            try:
                float(value)
            except ValueError:
                raise SystemExit(f"{key}={value!r} in {text!r}: want a number") from None
        elif not value.isdigit():
            raise SystemExit(f"{key}={value!r} in {text!r}: want a non-negative integer")
        opts[key] = value
    return name, opts


def parse_config(text: str) -> mm.MatmulConfig:
    """BM-BN-BK-WARPS-STAGES, optionally -s (one program per K split)."""
    parts = text.split("-")
    split_programs = len(parts) == 6 and parts[5] == "s"
    if len(parts) not in (5, 6) or (len(parts) == 6 and not split_programs):
        raise SystemExit(f"matmul config {text!r}: want BM-BN-BK-WARPS-STAGES[-s]")
    try:
        bm, bn, bk, warps, stages = map(int, parts[:5])
    except ValueError:
        raise SystemExit(
            f"matmul config {text!r}: want integers BM-BN-BK-WARPS-STAGES[-s]"
        ) from None
    return mm.MatmulConfig(bm, bn, bk, warps, stages, tma=True, split_programs=split_programs)


_TABLE_PICK = mm.pick_config


def _field_value(key: str, value: str) -> float | int | bool:
    if key in FLOAT_KEYS:
        return float(value)
    return bool(int(value)) if key in BOOL_KEYS else int(value)


def apply_variant(decoder, opts: dict) -> None:
    """Route the named projections' small-M matmuls to the given configs (by weight shape),
    and the decode attention to the table's config with the given fields."""
    w = decoder.layers[0]
    owners = {"qkv": w.mixer, "o": w.mixer, "gate_up": w.mlp, "down": w.mlp}
    shapes = {name: tuple(getattr(owners[name], name).shape) for name in LAYER_MATMULS}
    overrides = {shapes[p]: parse_config(c) for p, c in opts.items() if p in LAYER_MATMULS}
    fields = {ATTENTION_KEYS[k]: _field_value(k, v) for k, v in opts.items() if k in ATTENTION_KEYS}
    decoder.ops.attention_config = replace(DEFAULT_CONFIG, **fields)

    def pick(m: int, n: int, k: int) -> mm.MatmulConfig:
        if m <= 16 and (n, k) in overrides:
            return overrides[(n, k)]
        return _TABLE_PICK(m, n, k)

    mm.pick_config = pick


def short_name(name: str) -> str:
    for key in ("_matmul_persistent", "_matmul_kernel", "_attn_fwd", "_merge", "_add_rms_norm",
                "_rms_norm", "_silu_mul", "_attention_input", "log_softmax", "index_select",
                "embedding", "copy", "fill"):  # fmt: skip
        if key in name:
            return key.strip("_")
    return name[:40]


def critical_path(events: list[dict], num_layers: int) -> tuple[list[dict], list[dict], float]:
    """Main-stream kernels (the stream with the most) with their contribution; others apart.
    Matmuls are named by their order (qkv, o, gate_up, down per layer, then the LM head);
    if the count is not 4 per layer + 1, they are left unnamed rather than misnamed."""
    if not events:
        raise SystemExit("the profiler recorded no kernel of the graph replay (no CUPTI tracing "
                         "of graph kernels here?)")  # fmt: skip
    streams: dict[int, int] = {}
    for e in events:
        streams[e["stream"]] = streams.get(e["stream"], 0) + 1
    main_stream = max(streams, key=streams.get)
    main = [e for e in events if e["stream"] == main_stream]
    side = [e for e in events if e["stream"] != main_stream]
    span = charge_critical_path(main)
    mm_count = 0
    for e in main:
        e["label"] = short_name(e["name"])
        if e["label"].startswith("matmul"):
            e["label"] = f"matmul {LAYER_MATMULS[mm_count % 4]}"
            mm_count += 1
    matmuls = [e for e in main if e["label"].startswith("matmul")]
    if mm_count == 4 * num_layers + 1:
        matmuls[-1]["label"] = "matmul lm_head"
    else:
        print(f"warning: {mm_count} matmul kernels, not 4 per layer + 1: left unnamed")
        for e in matmuls:
            e["label"] = "matmul"
    return main, side, span


def capture(decoder, batch, kv):
    decoder.forward(batch, kv)  # compile, allocate
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = decoder.forward(batch, kv)
    graph.replay()
    torch.cuda.synchronize()
    return graph, logits


def replay_ms(graph, reps: int = 40) -> float:
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random:qwen3-8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--variants", nargs="*", default=["base:"])
    ap.add_argument("--layer", type=int, default=17, help="the layer whose kernels are listed")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kv_tokens = max(8192, args.batch * (args.prompt_len + 128))  # every request at once
    engine = Engine(EngineConfig(model=args.model, device="cuda", dtype="bfloat16",
                                 kv_tokens=kv_tokens, max_model_len=4096,
                                 max_running=args.batch, cuda_graphs=True))  # fmt: skip
    vocab = engine.decoder.spec.vocab_size
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for r in range(args.batch):
        engine.add_request(f"p{r}", [(7 * i + 3 + 11 * r) % vocab for i in range(args.prompt_len)],
                           params)  # fmt: skip
    while engine.runner.graphs.num_graphs == 0:
        engine.step()
    for _ in range(8):  # past the first split boundary of the keys
        engine.step()
    torch.cuda.synchronize()
    bucket, entry = max(engine.runner.graphs._graphs.items(), key=lambda kv: kv[0][0])
    print(f"timing the graph of bucket (batch, context) {bucket}")
    batch, kv, decoder = entry.inputs.batch, engine.runner.kv, engine.decoder
    doc = {"command": "python scripts/graph_timeline.py " + " ".join(
               f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}"
               for k, v in vars(args).items() if v is not None),
           "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(), "bucket": list(bucket),
           "variants": {}}  # fmt: skip
    saved_attention = decoder.ops.attention_config
    try:
        run_variants(args, decoder, batch, kv, doc)
    finally:  # the table's configs back, whatever happened
        mm.pick_config = _TABLE_PICK
        decoder.ops.attention_config = saved_attention
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    print(json.dumps(doc))


def run_variants(args, decoder, batch, kv, doc: dict) -> None:
    """Capture, time and profile the decode step once per variant; results into doc."""
    from torch.profiler import ProfilerActivity, profile

    reference = None
    for text in args.variants:
        name, opts = parse_variant(text)
        apply_variant(decoder, opts)
        try:
            graph, logits = capture(decoder, batch, kv)
        except Exception as exc:  # a config out of shared memory, say: report, go on
            print(f"\n== {name} {opts}: failed: {type(exc).__name__}: {str(exc)[:300]}")
            doc["variants"][name] = {"options": opts, "error": str(exc)[:300]}
            torch.cuda.synchronize()
            continue
        same = None
        if reference is None:
            reference = logits.clone()
        else:
            same = bool(torch.equal(logits, reference))
        ms = replay_ms(graph)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        main, side, span = critical_path(kernel_events(prof), len(decoder.layers))
        by_label: dict[str, list[float]] = {}
        for e in main:
            by_label.setdefault(e["label"], []).append(e["contribution"])
        table = sorted(((sum(v), len(v), k) for k, v in by_label.items()), reverse=True)
        print(f"\n== {name} {opts}: replay {ms:.3f} ms (events), profiled span {span / 1e3:.3f}"
              f" ms, logits equal to the first variant: {same}")  # fmt: skip
        print(f"{'kernel':24s} {'calls':>5s} {'on path us':>10s} {'us/call':>8s}")
        for total, n, label in table:
            print(f"{label:24s} {n:5d} {total:10.1f} {total / n:8.2f}")
        if side:
            print(f"other streams: {len(side)} kernels, {sum(e['dur'] for e in side):.1f} us busy")
        layer_starts = [i for i, e in enumerate(main) if e["label"] == "attention_input"]
        rows = []
        if len(layer_starts) > args.layer + 1:
            lo, hi = layer_starts[args.layer] - 2, layer_starts[args.layer + 1] - 2
            t0 = main[lo]["start"]
            print(f"layer {args.layer}: kernel, start, duration, gap before, on path (us)")
            for e in main[lo:hi]:
                rows.append({k: e[k] for k in ("label", "start", "dur", "gap_before",
                                                "contribution")})  # fmt: skip
                print(
                    f"  {e['label']:22s} {e['start'] - t0:8.1f} {e['dur']:8.1f} "
                    f"{e['gap_before']:6.1f} {e['contribution']:8.1f}"
                )
        doc["variants"][name] = {
            "options": opts, "replay_ms": ms, "span_ms": span / 1e3, "logits_equal": same,
            "on_path_us": {k: t for t, _, k in table}, "calls": {k: n for _, n, k in table},
            "side_busy_us": sum(e["dur"] for e in side), "layer": rows,
        }  # fmt: skip
        del graph


if __name__ == "__main__":
    main()
