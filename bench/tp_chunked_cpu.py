"""What the TP-invariant chunked reduction costs at TP 1 on the CPU: one decode step of the
default model (SmolLM2-135M, float32, one thread, 128 tokens of context per sequence), CPU time
per step with `tp_reduction=chunked` (the default) against `ranks` (at TP 1: the unchunked
linear), interleaved, median of 5 after a warm-up.

    python -m bench.tp_chunked_cpu [--batches 1,16,64]      (from the repository root)

CPU time, not wall time, so that other work on the machine moves the figure less. Prints a
table, then ONE JSON document on the last line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import torch

from lockstep.config import EngineConfig
from lockstep.models.decoder import ScratchKV
from lockstep.models.forward_batch import ForwardBatch
from lockstep.models.resolver import resolve_model
from lockstep.ops.base import build_attention_meta
from lockstep.parallel.worker import load_rank_decoder

CONTEXT = 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,16,64")
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = resolve_model(None)
    decoders = {
        r: load_rank_decoder(EngineConfig(device="cpu", tp_reduction=r), loaded, 0, 2048, None)
        for r in ("chunked", "ranks")
    }
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        kv = ScratchKV(loaded.spec, batch * (CONTEXT + 1), torch.float32, torch.device("cpu"))
        tables = [list(range(b * (CONTEXT + 1), (b + 1) * (CONTEXT + 1))) for b in range(batch)]
        meta = build_attention_meta([1] * batch, [CONTEXT] * batch, tables)
        step = ForwardBatch.from_lists([5] * batch, [CONTEXT] * batch,
                                       [t[CONTEXT] for t in tables], meta, range(batch))  # fmt: skip
        times: dict[str, list[float]] = {r: [] for r in decoders}
        for _ in range(6):
            for reduction, decoder in decoders.items():
                start = time.process_time()
                decoder.forward(step, kv)
                times[reduction].append(time.process_time() - start)
        chunked, plain = (statistics.median(times[r][1:]) * 1e3 for r in ("chunked", "ranks"))
        rows.append({"batch": batch, "chunked_ms": chunked, "unchunked_ms": plain,
                     "cost": chunked / plain - 1})  # fmt: skip
        print(f"batch {batch:>4}: chunked {chunked:8.1f} ms  unchunked {plain:8.1f} ms  "
              f"cost {chunked / plain - 1:+.1%}")  # fmt: skip
    print(json.dumps({
        "benchmark": "tp_chunked_cpu", "model": loaded.name, "threads": 1,
        "processor": platform.processor() or platform.machine(), "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "rows": rows,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
