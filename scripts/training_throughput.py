"""Forward+backward tokens/s of the training module (lockstep.training) beside transformers on
the same model, weights and tokens, and the bitwise check of its logprobs against LLM.score.

    python scripts/training_throughput.py                          # CUDA, bf16, 8 x 1024 tokens
    python scripts/training_throughput.py --device cpu --model random:tiny-qwen3 \\
        --batch 2 --seq-len 64 --steps 1 --warmup 0

Default model: `random:qwen3-8b,layers=4` (Qwen3-8B's shapes, its first 4 layers, embeddings
and head); `--model random:qwen3.5-9b,layers=4` runs the hybrid (Gated DeltaNet) one. One step of either implementation is a forward over `--batch` sequences of
`--seq-len` random tokens, the loss -sum(logprob of each next token), and its backward, timed
from the first op to the last gradient (CUDA synchronized); the median over `--steps` after
`--warmup` is reported. The training module runs them packed (one row per token);
transformers as a [batch, seq-len] tensor (every sequence of one length: no padding), in the
same dtype, with its default attention (SDPA). Before timing, the module's logprobs of the
same sequences are compared bit for bit with `LLM.score` on the same device and dtype
(`--mode reference` runs the module on the stock backend: the control, whose bits differ).

`--profile` then runs one more step of the module under torch.profiler, its forward and its
backward apart (each CUDA synchronized and timed), and prints the `--profile-top` kernels by
total device time (by CPU time on the CPU), each with its calls and its forward and backward
shares; the JSON document holds the same under "profile".

A table, then one JSON document on the last line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(step: Callable[[], None], device: str, warmup: int, steps: int) -> list[float]:
    """Seconds of each of `steps` calls of `step` after `warmup` untimed ones."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def _peak_gib(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


def _event_time_us(event: object, device: str) -> float:
    """The self time of one profiler row: device time of a kernel on CUDA, CPU time on the CPU
    (torch names the device field `self_device_time_total`, older `self_cuda_time_total`)."""
    if not device.startswith("cuda"):
        return float(getattr(event, "self_cpu_time_total", 0.0))
    for field in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, field):
            return float(getattr(event, field))
    return 0.0


def _phase_kernels(run: Callable[[], object], device: str) -> tuple[float, dict]:
    """Run `run` once under torch.profiler: its wall seconds (synchronized) and, per kernel
    name (per CPU op on the CPU), [calls, self microseconds]."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    want = DeviceType.CUDA if cuda else DeviceType.CPU
    _sync(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        run()
        _sync(device)
        seconds = time.perf_counter() - t0
    kernels: dict[str, list[float]] = {}
    for event in prof.key_averages():
        if event.device_type != want:
            continue
        row = kernels.setdefault(event.key, [0, 0.0])
        row[0] += event.count
        row[1] += _event_time_us(event, device)
    return seconds, kernels


def profile_step(policy: object, sequences: list[list[int]], device: str, top: int) -> dict:
    """One forward+backward of the training module (loss -sum(logprobs)), the forward and the
    backward profiled apart: their wall seconds, their summed kernel time, and the `top`
    kernels by total time with calls and each phase's share."""
    policy.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
    held: dict[str, torch.Tensor] = {}

    def forward() -> None:
        held["loss"] = -policy(sequences).logprobs.sum()  # type: ignore[operator]

    fwd_s, fwd = _phase_kernels(forward, device)
    bwd_s, bwd = _phase_kernels(lambda: held.pop("loss").backward(), device)
    names = set(fwd) | set(bwd)

    def total(name: str) -> float:
        return fwd.get(name, [0, 0.0])[1] + bwd.get(name, [0, 0.0])[1]

    rows = []
    for name in sorted(names, key=total, reverse=True)[:top]:
        f, b = fwd.get(name, [0, 0.0]), bwd.get(name, [0, 0.0])
        rows.append({"kernel": name, "calls": int(f[0] + b[0]), "total_ms": round(total(name) / 1e3, 3),
                     "forward_ms": round(f[1] / 1e3, 3), "backward_ms": round(b[1] / 1e3, 3)})  # fmt: skip
    return {
        "forward_s": round(fwd_s, 4),
        "backward_s": round(bwd_s, 4),
        "forward_kernel_ms": round(sum(t for _, t in fwd.values()) / 1e3, 3),
        "backward_kernel_ms": round(sum(t for _, t in bwd.values()) / 1e3, 3),
        "top_kernels": rows,
    }


def _print_profile(profile: dict, device: str) -> None:
    unit = "device" if device.startswith("cuda") else "CPU"
    print(f"profile of one step: forward {profile['forward_s']:.4f} s "
          f"({profile['forward_kernel_ms']:.1f} ms of {unit} time), backward "
          f"{profile['backward_s']:.4f} s ({profile['backward_kernel_ms']:.1f} ms)")  # fmt: skip
    print(f"{'total ms':>10}{'fwd ms':>10}{'bwd ms':>10}{'calls':>8}  kernel")
    for r in profile["top_kernels"]:
        name = r["kernel"] if len(r["kernel"]) <= 100 else r["kernel"][:97] + "..."
        print(f"{r['total_ms']:>10.3f}{r['forward_ms']:>10.3f}{r['backward_ms']:>10.3f}"
              f"{r['calls']:>8}  {name}")  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the JSON document it prints last."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:qwen3-8b,layers=4")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--mode",
        default="deterministic",
        choices=["deterministic", "reference"],
        help="the training module's backend (reference: stock torch, the bitwise control)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile one more step of the module: top kernels, fwd/bwd split",
    )
    parser.add_argument("--profile-top", type=int, default=25, help="kernels listed")
    args = parser.parse_args(argv)

    import transformers

    from lockstep import LLM
    from lockstep.training import LockstepForCausalLM

    dtype = DTYPES[args.dtype]
    device = args.device
    policy = LockstepForCausalLM.from_pretrained(
        args.model, device=device, dtype=dtype, mode=args.mode,
        gradient_checkpointing=args.gradient_checkpointing,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(args.seed)
    vocab = policy.spec.vocab_size
    tokens = torch.randint(0, vocab, (args.batch, args.seq_len), generator=gen)
    sequences = tokens.tolist()
    total = args.batch * args.seq_len

    # The bitwise check against the engine, on the same device and dtype.
    llm = LLM(args.model, device=device, dtype=args.dtype, kv_tokens=total + 256,
              max_model_len=max(args.seq_len + 1, 256))  # fmt: skip
    scored = llm.score(sequences, use_tqdm=False)
    with torch.no_grad():
        ours = policy(sequences).per_sequence()
    bitwise_equal = all(
        torch.equal(lp.cpu(), torch.tensor(s.logprobs[1:], dtype=torch.float32))
        for lp, s in zip(ours, scored, strict=True)
    )
    worst = max((lp.cpu() - torch.tensor(s.logprobs[1:])).abs().max().item()
                for lp, s in zip(ours, scored, strict=True) if len(s.logprobs) > 1)  # fmt: skip
    llm.close()
    del llm, scored
    if device.startswith("cuda"):
        torch.cuda.empty_cache()

    # transformers on the very weights (save_pretrained writes them; it loads them).
    with tempfile.TemporaryDirectory() as folder:
        policy.save_pretrained(folder)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    if args.gradient_checkpointing:
        hf.gradient_checkpointing_enable()
    hf.train()
    ids = tokens.to(device)

    def lockstep_step() -> None:
        policy.zero_grad(set_to_none=True)
        (-policy(sequences).logprobs.sum()).backward()

    def transformers_step() -> None:
        hf.zero_grad(set_to_none=True)
        logprobs = torch.log_softmax(hf(ids).logits[:, :-1].float(), -1)
        (-logprobs.gather(-1, ids[:, 1:, None]).sum()).backward()

    results = {}
    for name, step in (("lockstep", lockstep_step), ("transformers", transformers_step)):
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        times = _timed(step, device, args.warmup, args.steps)
        median = statistics.median(times)
        results[name] = {"step_s": round(median, 4), "tokens_per_s": round(total / median, 1),
                         "steps_s": [round(t, 4) for t in times],
                         "peak_gib": _peak_gib(device)}  # fmt: skip
    profile = profile_step(policy, sequences, device, args.profile_top) if args.profile else None

    doc = {
        "benchmark": "training_throughput",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python " + shlex.join(sys.argv if argv is None else ["script", *argv]),
        "model": args.model,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "dtype": args.dtype,
        "mode": args.mode,
        "torch": torch.__version__,
        "transformers_version": transformers.__version__,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "tokens": total,
        "gradient_checkpointing": args.gradient_checkpointing,
        "bitwise_equal_llm_score": bitwise_equal,
        "max_abs_diff_llm_score": worst,
        "implementations": results,
        "speed_ratio": round(
            results["lockstep"]["tokens_per_s"] / results["transformers"]["tokens_per_s"], 3
        ),  # fmt: skip
    }
    if profile is not None:
        doc["profile"] = profile
        _print_profile(profile, device)
    print(f"{'implementation':<15}{'step s':>10}{'tokens/s':>12}{'peak GiB':>10}")
    for name in ("lockstep", "transformers"):
        r = results[name]
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        print(f"{name:<15}{r['step_s']:>10.4f}{r['tokens_per_s']:>12.1f}{peak:>10}")
    print(f"logprobs == LLM.score bit for bit: {bitwise_equal} (largest difference {worst:.3g})")
    print(json.dumps(doc))
    return doc


if __name__ == "__main__":
    main()
