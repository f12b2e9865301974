"""How long the host takes to launch the batch-1 decode graph, and whether the GPU waits for it.

    python scripts/graph_launch_probe.py [--model random:qwen3-8b] [--reps 30]

After a few engine decode steps (which capture the graph of bucket (1, 2048)), times the same
graph's replay three ways: the host wall time of the `replay()` call alone; GPU time from an
event recorded just before the replay on an idle GPU to one just after (launch latency the GPU
waits for is included); and the same with the GPU kept busy by a sleep kernel first, so that
the launch is done before the graph can start (pure execution). The difference of the last two
is the launch latency on a decode step's critical path. Prints medians and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.engine.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-8b")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    engine = Engine(EngineConfig(model=args.model, device="cuda", dtype="bfloat16",
                                 kv_tokens=8192, max_model_len=2048, max_running=1,
                                 cuda_graphs=True))  # fmt: skip
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("p", list(range(3, 515)), params)
    while engine.has_unfinished():
        engine.step()
    graphs = engine.runner.graphs
    (entry,) = graphs._graphs.values()
    host, idle, busy = [], [], []
    for _ in range(args.reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        entry.graph.replay()
        host.append(1e6 * (time.perf_counter() - t0))
        torch.cuda.synchronize()
        for out, sleep in ((idle, 0), (busy, 20_000_000)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            if sleep:
                torch.cuda._sleep(sleep)  # ~10 ms of GPU work: the launch finishes meanwhile
            start.record()
            entry.graph.replay()
            end.record()
            torch.cuda.synchronize()
            out.append(1e3 * start.elapsed_time(end))
    doc = {
        "pdl": os.environ.get("LOCKSTEP_PDL", "1"),
        "host_replay_call_us": statistics.median(host),
        "gpu_us_idle_start": statistics.median(idle),
        "gpu_us_busy_start": statistics.median(busy),
    }
    doc["launch_latency_on_critical_path_us"] = doc["gpu_us_idle_start"] - doc["gpu_us_busy_start"]
    print(", ".join(f"{k} {v}" if isinstance(v, str) else f"{k} {v:.1f}" for k, v in doc.items()))
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
