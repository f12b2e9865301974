"""Where the time of a decode step goes (GPU, CUDA graphs), against the weight-stream floor.

    python scripts/profile_decode.py --model random:qwen3-8b [--prompt-len 512] [--steps 48]

Prints, for --batch requests decoding after a prompt: the engine's wall time per token (host
work included), the GPU time of the captured decode graph replayed alone (CUDA events), the
memory floor (parameter bytes read per token over the measured copy bandwidth), and a
per-kernel table of one eager decode forward (torch.profiler). JSON on the last line.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench/

import torch  # noqa: E402

from bench.gpu_kernels import copy_bandwidth  # noqa: E402
from lockstep.config import EngineConfig  # noqa: E402
from lockstep.engine.engine import Engine  # noqa: E402
from lockstep.engine.sampling_params import SamplingParams  # noqa: E402
from lockstep.ops.fp8 import Fp8Weight  # noqa: E402
from lockstep.ops.moe import MoeLayer  # noqa: E402


def step_weight_bytes(engine: Engine, batch: int = 1) -> int:
    """Bytes of weights one decode step of `batch` rows must read: every tensor of every layer
    (its blocks' weights objects walked through), the final norm and the LM head (the
    embedding table contributes one row per token, left out). Of an MoE layer's routed experts
    only the expected number a step touches: E * (1 - (1 - k / E) ** batch) of E, k at
    batch 1, as if routing were uniform (shared experts and the router are read whole)."""
    dec = engine.decoder
    tensors = {id(t): t for t in [dec.final_norm, dec.lm_head]}
    fraction: dict[int, float] = {}  # id -> the share of a routed expert tensor read

    def walk(obj: object, depth: int = 0) -> None:
        if isinstance(obj, torch.Tensor):
            tensors[id(obj)] = obj
        elif isinstance(obj, Fp8Weight):  # e4m3 weight and its scales
            tensors.update((id(part), part) for part in obj.tensors())
        elif isinstance(obj, MoeLayer):
            e, k = obj.num_experts, obj.top_k
            share = (1 - (1 - k / e) ** batch) if e > k else 1.0
            for part in (obj.gate_up, obj.down, obj.gate_up_scale, obj.down_scale):
                if isinstance(part, torch.Tensor) and part.dim() >= 1 and part.shape[0] == e:
                    tensors[id(part)] = part
                    fraction[id(part)] = share
            walk(obj.router, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item, depth + 1)
        elif hasattr(obj, "__dict__") and depth < 4:
            for item in vars(obj).values():
                walk(item, depth + 1)

    for layer in dec.layers:
        walk(layer)
    return int(sum(t.numel() * t.element_size() * fraction.get(i, 1.0)
                   for i, t in tensors.items()))  # fmt: skip


def time_phases(
    engine: Engine, vocab: int, prompt_len: int, params: SamplingParams, batch: int = 1
) -> dict:
    """Median microseconds per decode step of each phase of Engine.step, with a device sync
    after every phase so that each is charged its own time (steps run slower this way)."""
    import functools

    spent: dict[str, list[float]] = {}

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            torch.cuda.synchronize()
            spent.setdefault(name, []).append(1e6 * (time.perf_counter() - t0))
            return out

        return wrapper

    sched, runner = engine.scheduler, engine.runner
    saved = (sched.schedule, runner.build, runner.graphs.run, engine.ops.log_softmax,
             engine._complete)  # fmt: skip
    sched.schedule = timed("schedule", sched.schedule)
    runner.build = timed("build", runner.build)
    runner.graphs.run = timed("graph fill+replay", runner.graphs.run)
    engine.ops.log_softmax = timed("log_softmax", engine.ops.log_softmax)
    engine._complete = timed("read tokens+advance", engine._complete)
    for r in range(batch):
        engine.add_request(f"t{r}", [(3 * i + 2 + r) % vocab for i in range(prompt_len)], params)
    for _ in range(4):
        engine.step()
    steps = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        steps.append(1e6 * (time.perf_counter() - t0))
    (sched.schedule, runner.build, runner.graphs.run, engine.ops.log_softmax,
     engine._complete) = saved  # fmt: skip
    out = {k: statistics.median(v[2:]) for k, v in spent.items()}
    out["whole step"] = statistics.median(steps)
    out["rest"] = out["whole step"] - sum(v for k, v in out.items() if k != "whole step")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random:qwen3-8b")
    ap.add_argument("--mode", default="deterministic")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together")
    ap.add_argument("--out", default=None)
    ap.add_argument("--host-profile", action="store_true", help="cProfile the engine's steps")
    ap.add_argument(
        "--mla-fused-input",
        action="store_true",
        help="MLA's input as two Triton kernels (EngineConfig.mla_fused_input)",
    )
    ap.add_argument("--overlap-decode", action=argparse.BooleanOptionalAction, default=None,
                    help="launch each decode step before the previous one's tokens are read"
                    " (default: the engine's, on for CUDA)")  # fmt: skip
    ap.add_argument("--no-pdl", action="store_true",
                    help="launch without programmatic dependent launch (the same bits): each "
                    "kernel's eager time then excludes its wait for the one before")  # fmt: skip
    args = ap.parse_args()
    if args.no_pdl:
        from lockstep.ops.triton import launch

        launch.pdl_enabled = lambda device: False  # before any kernel is launched or captured
    # Room for every request's prompt and generation at once: a smaller pool would preempt
    # requests and profile a smaller batch than asked for.
    kv_tokens = max(8192, args.batch * (args.prompt_len + args.steps + 64))
    engine = Engine(EngineConfig(model=args.model, mode=args.mode, device="cuda",
                                 dtype="bfloat16", kv_tokens=kv_tokens, max_model_len=4096,
                                 max_running=args.batch, cuda_graphs=True,
                                 mla_fused_input=args.mla_fused_input,
                                 overlap_decode=args.overlap_decode))  # fmt: skip
    vocab = engine.decoder.spec.vocab_size
    params = SamplingParams(max_tokens=args.steps + 1, temperature=0.0, ignore_eos=True)
    for r in range(args.batch):
        prompt = [(7 * i + 3 + 11 * r) % vocab for i in range(args.prompt_len)]
        engine.add_request(f"p{r}", prompt, params)
    while engine.runner.graphs.num_graphs == 0:  # prefill (+ first tokens)
        engine.step()
    torch.cuda.synchronize()
    # Time between consecutive step returns, no device sync per step: a plain step waits for
    # its own tokens anyway, and a sync would drain a step launched ahead (--overlap-decode).
    # The time a step spends waiting for its tokens is the host's slack: near zero means the
    # host, not the device, sets the pace.
    from lockstep.engine.model_runner import LaunchedStep

    waits: list[float] = []
    chosen = LaunchedStep.chosen

    def timed_chosen(self):
        t0 = time.perf_counter()
        out = chosen(self)
        waits.append(time.perf_counter() - t0)
        return out

    LaunchedStep.chosen = timed_chosen
    stamps = [time.perf_counter()]
    while engine.has_unfinished():
        engine.step()
        stamps.append(time.perf_counter())
    torch.cuda.synchronize()
    LaunchedStep.chosen = chosen
    walls = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    walls = walls[2:]  # the first decode steps capture the graph
    wait_ms = 1e3 * statistics.median(waits[2:])
    print(f"engine step {1e3 * statistics.median(walls):.3f} ms, of which waiting for the "
          f"device's tokens {wait_ms:.3f} ms (host work {1e3 * statistics.median(walls) - wait_ms:.3f} ms)")  # fmt: skip
    phases = time_phases(engine, vocab, args.prompt_len, params, args.batch)
    print("engine step phases (each synchronized; us per step): "
          + ", ".join(f"{k} {v:.0f}" for k, v in phases.items()))  # fmt: skip
    if args.host_profile:  # where the host's time goes in the engine's steps
        import cProfile
        import pstats

        for r in range(args.batch):  # the same batch again, its prefill and graph done first
            engine.add_request(f"h{r}", [(5 * i + 1 + 13 * r) % vocab
                                         for i in range(args.prompt_len)], params)  # fmt: skip
        while any(not q.output_ids for q in engine.requests.values()):
            engine.step()
        engine.step()
        prof_host = cProfile.Profile()
        prof_host.enable()
        while engine.has_unfinished():
            engine.step()
        prof_host.disable()
        pstats.Stats(prof_host).sort_stats("tottime").print_stats(25)
    graphs = engine.runner.graphs
    entry = max(graphs._graphs.items(), key=lambda kv: kv[0][0])[1]  # the full batch's
    replays = []
    for _ in range(30):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        entry.graph.replay()
        e.record()
        torch.cuda.synchronize()
        replays.append(s.elapsed_time(e))
    param_bytes = step_weight_bytes(engine, args.batch)
    bw = copy_bandwidth()
    floor_ms = param_bytes / (bw * 1e12) * 1e3
    # One eager forward of the same static batch, profiled per kernel.
    from torch.profiler import ProfilerActivity, profile

    engine.decoder.forward(entry.inputs.batch, engine.runner.kv)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.decoder.forward(entry.inputs.batch, engine.runner.kv)
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            kernels.setdefault(ev.name[:60], []).append(ev.device_time_total)
    table = sorted(((sum(v), len(v), k) for k, v in kernels.items()), reverse=True)
    print(f"{'kernel':60s} {'calls':>6s} {'total us':>10s} {'us/call':>9s}")
    for total, n, name in table[:20]:
        print(f"{name:60s} {n:6d} {total:10.1f} {total / n:9.2f}")
    kernel_ms = sum(t for t, _, _ in table) / 1e3
    # The step's work after the forward: log-softmax of the sampled row and the sampler.
    from lockstep.engine.sampler import RowSampling, choose_token_tensor

    row = torch.randn(1, vocab, device="cuda") * 4
    greedy = [RowSampling(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, position=0)]
    post = {}
    for name, fn in (("log_softmax", lambda: engine.ops.log_softmax(row)),
                     ("argmax", lambda: choose_token_tensor(row, greedy))):  # fmt: skip
        with profile(activities=[ProfilerActivity.CUDA]) as prof_post:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
        post[name] = (
            sum(ev.device_time_total for ev in prof_post.events() if ev.device_type.name == "CUDA")
            / 10
        )
    print("after the forward, GPU us per step: "
          + ", ".join(f"{k} {v:.1f}" for k, v in post.items()))  # fmt: skip
    doc = {
        "command": "python scripts/profile_decode.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "mode": args.mode,
        "model": args.model,
        "overlap_decode": engine.config.use_overlap_decode,
        "copy_tb_s": bw,
        "param_bytes": param_bytes,
        "floor_ms": floor_ms,
        "engine_ms_per_token": 1e3 * statistics.median(walls),
        "token_wait_ms": wait_ms,
        "graph_replay_ms": statistics.median(replays),
        "eager_kernel_sum_ms": kernel_ms,
        "post_forward_gpu_us": post,
        "kernels": [{"name": k, "calls": n, "total_us": t} for t, n, k in table],
    }  # fmt: skip
    print(f"floor {floor_ms:.3f} ms ({param_bytes / 1e9:.2f} GB at {bw:.2f} TB/s); engine "
          f"{doc['engine_ms_per_token']:.3f} ms/token; graph replay {doc['graph_replay_ms']:.3f} "
          f"ms; eager kernel sum {kernel_ms:.3f} ms; floor fraction (engine) "
          f"{floor_ms / doc['engine_ms_per_token']:.2f}, (graph) "
          f"{floor_ms / doc['graph_replay_ms']:.2f}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
