"""Where the time of a prefill goes (GPU): tokens/s of whole prefill steps and a per-kernel
table of one of them.

    python scripts/profile_prefill.py --model random:qwen3.5-9b --shapes 64x512,4x4096

For each shape BxL, prefills B prompts of L tokens once to compile and warm up, then the same
shapes with other prompts, timing each engine step with a device sync (tokens/s over the
prefill steps), then once more under torch.profiler (CUDA kernels, summed per name).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lockstep.config import EngineConfig  # noqa: E402
from lockstep.engine.engine import Engine  # noqa: E402
from lockstep.engine.sampling_params import SamplingParams  # noqa: E402


def prefill(engine: Engine, batch: int, prompt_len: int, salt: int) -> list[float]:
    """Submit the prompts (one generated token each) and run them out; seconds per step."""
    vocab = engine.decoder.spec.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for r in range(batch):
        prompt = [(7 * i + 3 + 11 * r + 101 * salt) % vocab for i in range(prompt_len)]
        engine.add_request(f"s{salt}-{r}", prompt, params)
    walls = []
    while engine.has_unfinished():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    engine.flush_cache()
    return walls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random:qwen3.5-9b")
    ap.add_argument("--mode", default="deterministic")
    ap.add_argument("--shapes", default="64x512", help="BxL[,BxL...]: B prompts of L tokens")
    ap.add_argument("--max-batch-tokens", type=int, default=None)
    ap.add_argument("--top", type=int, default=20, help="kernels in the table")
    ap.add_argument("--no-pdl", action="store_true",
                    help="launch without programmatic dependent launch (the same bits): each "
                    "kernel's time then excludes its wait for the one before")  # fmt: skip
    args = ap.parse_args()
    if args.no_pdl:
        from lockstep.ops.triton import launch

        launch.pdl_enabled = lambda device: False
    shapes = [tuple(int(x) for x in part.split("x")) for part in args.shapes.split(",")]
    most = max(b * (n + 64) for b, n in shapes)
    engine = Engine(EngineConfig(model=args.model, mode=args.mode, device="cuda",
                                 dtype="bfloat16", kv_tokens=most + 4096,
                                 max_model_len=max(4096, *(n + 64 for _, n in shapes)),
                                 max_running=max(b for b, _ in shapes),
                                 max_batch_tokens=args.max_batch_tokens))  # fmt: skip
    for batch, prompt_len in shapes:
        profile_shape(engine, args.model, batch, prompt_len, args.top)


def profile_shape(engine: Engine, model: str, batch: int, prompt_len: int, top: int) -> None:
    prefill(engine, batch, prompt_len, 0)
    walls = prefill(engine, batch, prompt_len, 1)
    tokens = batch * prompt_len
    print(f"{model} {batch} x {prompt_len} tokens in {len(walls)} steps, "
          f"{sum(walls) * 1e3:.1f} ms, {tokens / sum(walls):,.0f} tok/s "
          f"(steps ms: {', '.join(f'{w * 1e3:.1f}' for w in walls[:8])})")  # fmt: skip
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        prefill(engine, batch, prompt_len, 2)
    kernels: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            kernels.setdefault(ev.name[:60], []).append(ev.device_time_total)
    table = sorted(((sum(v), len(v), k) for k, v in kernels.items()), reverse=True)
    total = sum(t for t, _, _ in table)
    print(f"{'kernel':60s} {'calls':>6s} {'total ms':>9s} {'share':>6s}")
    for t, n, name in table[:top]:
        print(f"{name:60s} {n:6d} {t / 1e3:9.2f} {t / total:6.1%}")
    print(f"{'all kernels':60s} {'':6s} {total / 1e3:9.2f}")


if __name__ == "__main__":
    main()
