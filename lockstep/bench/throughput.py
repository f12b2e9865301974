"""`lockstep bench throughput`: offline end-to-end throughput, like `vllm bench throughput`.

Every request is queued at once and the engine loop runs until the last one finishes; the
wall time runs from queueing the first request to the last step's end (the device drained).
From it: requests/s, output tokens/s and total (prompt + output) tokens/s.

Phases come from the steps the engine loop runs, each timed from the previous step's return
to its own, and charged to the step that call completed (with overlapped decode the next
step is already on the device meanwhile, so in steady decode a call's time is one device
step). A step that samples nothing (only middle chunks of long prompts) returns before its
device work ends; its time lands in the next call, which continues the same prefills. So:

  * steps with prefill rows: prompt chunks (and recomputation after a preemption), usually
    with the decode rows of running requests beside them; prefill tok/s = their prefill rows
    over their time;
  * decode-only steps: one new token per running request; decode tok/s = their rows over
    their time, and the mean step time by context band (the batch's mean keys per row, in
    bands of `--context-band` tokens).

Where a phase's time goes on the host: the seconds its steps waited for their tokens to reach
the host (the rest is launching and the host's own work: scheduling, batch building, text; on
the CPU launching is the computation), the steps whose successor was not launched ahead
(overlapped decode), and over the run the seconds in Python's garbage collector. A phase whose
wait is near zero is paced by the host, not the device. `--step-log` writes every timed step
as a JSON line.

The step times add up to the wall time less the queueing. An optional warm-up first runs
requests of the same lengths with other tokens (Triton compilation and CUDA-graph capture,
which a server pays once), then flushes the cache; a spot check last re-runs a few requests
alone and compares bits (lockstep/bench/spot_check.py). Neither is in the figures.
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import math
import platform
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from lockstep.bench.spot_check import Generation, SpotCheckResult, choose_requests, spot_check
from lockstep.bench.workload import BenchRequest
from lockstep.engine.engine import Engine
from lockstep.engine.sampling_params import SamplingParams
from lockstep.errors import ConfigError

# Warm-up requests generate this many tokens past the steps their prefills take, so that the
# decode batch reaches the run's size (its CUDA-graph buckets) before they finish.
WARMUP_EXTRA_DECODE_STEPS = 8


@dataclass
class PhaseTotals:
    """Steps of one kind: how many, their time, and the rows they computed."""

    steps: int = 0
    seconds: float = 0.0
    prefill_rows: int = 0
    decode_rows: int = 0
    wait_s: float = 0.0  # of `seconds`, waiting for the device's tokens
    not_ahead: int = 0  # steps whose successor was not launched ahead

    def add(self, step: StepRecord) -> None:
        self.steps += 1
        self.seconds += step.seconds
        self.prefill_rows += step.prefill_rows
        self.decode_rows += step.decode_rows
        self.wait_s += step.wait_s
        self.not_ahead += not step.launched_ahead


@dataclass(frozen=True)
class StepRecord:
    """One timed step (`--step-log` writes these): its wall seconds, the seconds it waited for
    its tokens, the garbage collector's seconds within it, whether the next step was launched
    before it returned, and what it computed."""

    seconds: float
    wait_s: float
    gc_s: float
    launched_ahead: bool
    prefill_rows: int
    decode_rows: int
    decode_keys: int


@dataclass
class StepTimes:
    """Every step's time, by what the step computed (module docstring)."""

    band: int
    prefill: PhaseTotals = field(default_factory=PhaseTotals)
    decode: PhaseTotals = field(default_factory=PhaseTotals)
    by_context: dict[int, PhaseTotals] = field(default_factory=dict)

    def add(self, step: StepRecord) -> None:
        if step.prefill_rows:
            self.prefill.add(step)
        elif step.decode_rows:
            self.decode.add(step)
            band = (step.decode_keys // step.decode_rows) // self.band * self.band
            self.by_context.setdefault(band, PhaseTotals()).add(step)


@dataclass
class RunResult:
    """One run of the workload through the engine."""

    wall_s: float
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    preemptions: int
    kv_peak_tokens: int
    times: StepTimes
    generations: list[Generation]
    gc_s: float = 0.0  # in the garbage collector, over the run
    gc_collections: tuple[int, int, int] = (0, 0, 0)  # by generation
    steps: list[StepRecord] = field(default_factory=list)
    peak_allocated_bytes: int | None = None  # torch's peak over the run (CUDA only)


def request_params(
    requests: Sequence[BenchRequest], sampling: dict[str, Any], ignore_eos: bool, seed: int
) -> list[SamplingParams]:
    """Each request's sampling parameters: `sampling` (temperature, top_p, top_k), its own
    output length and the seed `seed + i` (unused when greedy)."""
    if not sampling.get("temperature") and (
        sampling.get("top_p", 1.0) < 1.0 or sampling.get("top_k", 0)
    ):
        raise ConfigError(f"throughput benchmark: top_p={sampling.get('top_p', 1.0)} / "
                          f"top_k={sampling.get('top_k', 0)} filter sampled tokens: give a "
                          "--temperature > 0 as well (0 is greedy)")  # fmt: skip
    return [
        SamplingParams(max_tokens=r.output_len, ignore_eos=ignore_eos, seed=seed + i, **sampling)
        for i, r in enumerate(requests)
    ]


def run_requests(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    context_band: int = 256,
    progress: bool = True,
    tag: str = "tput",
) -> RunResult:
    """Queue every prompt at once and step the engine until all finish, timing each step
    (and, through a `gc` callback, the garbage collector's share)."""
    if engine.has_unfinished():
        raise RuntimeError("the throughput benchmark needs an idle engine")
    stats = engine.stats()
    pool = engine.pool
    generations = [Generation() for _ in prompts]
    index = {}
    times = StepTimes(context_band)
    peak = pool.num_allocated
    # Output tokens, not finished requests: requests of similar lengths finish together at
    # the end, so a bar of requests would sit still all run. Left showing the total.
    bar = tqdm(total=sum(p.max_tokens for p in params), desc="output tokens", unit="tok",
               disable=not progress)  # fmt: skip
    collector = _CollectorClock()
    records: list[StepRecord] = []
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(engine.device)
    gc.callbacks.append(collector)
    t0 = time.perf_counter()
    try:
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            rid = f"{tag}-{i}"
            index[rid] = i
            engine.add_request(rid, list(prompt), p)
        last = time.perf_counter()
        while engine.has_unfinished():
            ahead = engine.steps_launched_ahead
            outputs = engine.step()
            now = time.perf_counter()
            shape = engine.last_step_shape()
            record = StepRecord(
                seconds=now - last, wait_s=engine.last_token_wait_s, gc_s=collector.take(),
                launched_ahead=engine.steps_launched_ahead > ahead,
                prefill_rows=shape.prefill_rows, decode_rows=shape.decode_rows,
                decode_keys=shape.decode_keys,
            )  # fmt: skip
            records.append(record)
            times.add(record)
            last = now
            peak = max(peak, pool.num_allocated)
            for out in outputs:
                g = generations[index[out.request_id]]
                g.token_ids.extend(out.new_token_ids)
                g.logprobs.extend(out.new_token_logprobs)
                bar.update(len(out.new_token_ids))
                if out.finished:  # an early stop: the tokens it will not generate count done
                    bar.update(params[index[out.request_id]].max_tokens - len(g.token_ids))
        if engine.device.type == "cuda":  # a step launched ahead may still be running
            torch.cuda.synchronize(engine.device)
        wall = time.perf_counter() - t0
    except BaseException:
        for rid in index:
            engine.abort_request(rid)
        raise
    finally:
        gc.callbacks.remove(collector)
        bar.close()
    after = engine.stats()
    return RunResult(
        wall_s=wall,
        input_tokens=sum(len(p) for p in prompts),
        output_tokens=sum(len(g.token_ids) for g in generations),
        cached_tokens=after["cached_tokens_total"] - stats["cached_tokens_total"],
        preemptions=after["num_preemptions"] - stats["num_preemptions"],
        kv_peak_tokens=peak,
        times=times,
        generations=generations,
        gc_s=collector.total,
        gc_collections=tuple(collector.collections),
        steps=records,
        peak_allocated_bytes=torch.cuda.max_memory_allocated(engine.device) if cuda else None,
    )


class _CollectorClock:
    """A `gc.callbacks` entry that times every collection: its total, and what has not been
    taken yet (the step in which the collections ran)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.collections = [0, 0, 0]
        self._pending = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        spent = time.perf_counter() - self._start
        self.total += spent
        self._pending += spent
        self.collections[info["generation"]] += 1

    def take(self) -> float:
        spent, self._pending = self._pending, 0.0
        return spent


def write_step_log(path: Path, run: RunResult) -> None:
    """The run's steps as JSON lines, in order (`StepRecord`'s fields)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for step in run.steps:
            f.write(json.dumps(asdict(step)) + "\n")


def warm_up(
    engine: Engine,
    requests: Sequence[BenchRequest],
    params: Sequence[SamplingParams],
    seed: int,
) -> float:
    """Run requests of the workload's first prompt lengths (as many as run at once) with
    other random tokens, each generating enough tokens for the decode batch to reach its
    size; then flush the prefix cache. Returns the seconds it took."""
    t0 = time.perf_counter()
    n = min(len(requests), engine.config.resolved_max_running)
    rng = random.Random(f"warm-up-{seed}")
    vocab = engine.decoder.spec.vocab_size
    prompts = [[rng.randrange(vocab) for _ in requests[i].prompt_ids] for i in range(n)]
    prefill_steps = math.ceil(sum(map(len, prompts)) / engine.config.resolved_max_batch_tokens)
    steps = prefill_steps + WARMUP_EXTRA_DECODE_STEPS
    warm = [replace(params[i], max_tokens=min(params[i].max_tokens, steps)) for i in range(n)]
    run_requests(engine, prompts, warm, progress=False, tag="warm-up")
    engine.flush_cache()
    return time.perf_counter() - t0


def bench_throughput(
    engine: Engine,
    requests: Sequence[BenchRequest],
    params: Sequence[SamplingParams],
    *,
    warmup: bool = True,
    spot_checks: int = 3,
    context_band: int = 256,
    seed: int = 0,
    progress: bool = True,
) -> tuple[RunResult, SpotCheckResult, float]:
    """Warm up (optional), run the workload timed, then spot-check `spot_checks` requests.
    Returns the run, the spot check and the warm-up's seconds (0 without)."""
    if context_band < 1:
        raise ConfigError(f"--context-band {context_band} is invalid: expected an integer >= 1")
    if spot_checks < 0:
        raise ConfigError(f"--spot-check {spot_checks} is invalid: expected an integer >= 0")
    warm_s = warm_up(engine, requests, params, seed) if warmup else 0.0
    prompts = [r.prompt_ids for r in requests]
    run = run_requests(engine, prompts, params, context_band, progress)
    chosen = choose_requests(len(requests), spot_checks, seed)
    check = spot_check(engine, prompts, params, run.generations, chosen)
    return run, check, warm_s


def summary(run: RunResult, num_requests: int) -> dict[str, Any]:
    """The figures of a run, as the JSON document holds them (rates are None where a phase
    has no steps)."""
    t = run.times

    def per_step(p: PhaseTotals) -> dict[str, Any]:
        return {"steps": p.steps, "seconds": p.seconds,
                "ms_per_step": 1000 * p.seconds / p.steps if p.steps else None,
                "device_wait_s": p.wait_s, "not_launched_ahead": p.not_ahead}  # fmt: skip

    prefill = per_step(t.prefill) | {
        "prefill_rows": t.prefill.prefill_rows,
        "decode_rows": t.prefill.decode_rows,  # decoding beside the prompt chunks
        "prefill_tok_s": t.prefill.prefill_rows / t.prefill.seconds if t.prefill.steps else None,
    }
    decode = per_step(t.decode) | {
        "decode_rows": t.decode.decode_rows,
        "mean_batch": t.decode.decode_rows / t.decode.steps if t.decode.steps else None,
        "decode_tok_s": t.decode.decode_rows / t.decode.seconds if t.decode.steps else None,
    }
    bands = [
        {"context_from": lo, "context_to": lo + t.band - 1, "steps": p.steps,
         "mean_batch": p.decode_rows / p.steps, "ms_per_step": 1000 * p.seconds / p.steps,
         "decode_tok_s": p.decode_rows / p.seconds if p.seconds else None}
        for lo, p in sorted(t.by_context.items())
    ]  # fmt: skip
    return {
        "num_requests": num_requests,
        "input_tokens": run.input_tokens,
        "output_tokens": run.output_tokens,
        "cached_tokens": run.cached_tokens,
        "wall_s": run.wall_s,
        "requests_per_s": num_requests / run.wall_s,
        "output_tok_s": run.output_tokens / run.wall_s,
        "total_tok_s": (run.input_tokens + run.output_tokens) / run.wall_s,
        "steps_s": t.prefill.seconds + t.decode.seconds,
        "prefill_steps": prefill,
        "decode_steps": decode,
        "decode_by_context": bands,
        "preemptions": run.preemptions,
        # Prompt positions computed again after a preemption (prefill rows beyond the
        # uncached prompt tokens), and their share of the prompt tokens.
        "recomputed_tokens": t.prefill.prefill_rows - (run.input_tokens - run.cached_tokens),
        "recomputed_share": (t.prefill.prefill_rows - (run.input_tokens - run.cached_tokens))
        / max(run.input_tokens, 1),
        "kv_peak_tokens": run.kv_peak_tokens,
        "peak_allocated_bytes": run.peak_allocated_bytes,
        "gc_s": run.gc_s,
        "gc_collections": list(run.gc_collections),
    }


def print_report(figures: dict[str, Any], kv_capacity: int, check: SpotCheckResult) -> None:
    """The human-readable table (the JSON document follows it on the last line)."""
    f = figures
    pre, dec = f["prefill_steps"], f["decode_steps"]
    print(
        f"requests          {f['num_requests']} ({f['input_tokens']} prompt tokens, "
        f"{f['output_tokens']} generated, {f['cached_tokens']} from the prefix cache)"
    )
    print(f"wall time         {f['wall_s']:.2f} s (steps {f['steps_s']:.2f} s)")
    print(
        f"throughput        {f['requests_per_s']:.2f} req/s, {f['output_tok_s']:.1f} output "
        f"tok/s, {f['total_tok_s']:.1f} total tok/s"
    )
    print(
        f"prefill steps     {pre['steps']} steps, {pre['seconds']:.2f} s: "
        f"{_rate(pre['prefill_tok_s'])} prompt tok/s ({pre['decode_rows']} decode rows beside "
        "the prompt chunks)"
    )
    print(
        f"decode-only steps {dec['steps']} steps, {dec['seconds']:.2f} s: "
        f"{_rate(dec['decode_tok_s'])} tok/s, {_ms(dec['ms_per_step'])} ms/step"
    )
    print(
        f"host              decode steps waited {dec['device_wait_s']:.2f} s for their tokens "
        f"(the rest: launching, host work), {dec['not_launched_ahead']} not overlapped; garbage "
        f"collection {f['gc_s']:.2f} s ({sum(f['gc_collections'])} collections, "
        f"{f['gc_collections'][2]} full)"
    )
    print(
        f"KV pool           {kv_capacity} tokens; peak {f['kv_peak_tokens']} in use "
        f"(running + prefix cache); {f['preemptions']} preemptions, "
        f"{f['recomputed_tokens']} prompt tokens recomputed ({100 * f['recomputed_share']:.1f}%)"
    )
    if f["peak_allocated_bytes"] is not None:
        print(f"device memory     peak allocated {f['peak_allocated_bytes'] / 2**30:.2f} GiB")
    if f["decode_by_context"]:
        print(f"{'mean context':>16}{'steps':>8}{'mean batch':>12}{'ms/step':>10}{'tok/s':>12}")
        for b in f["decode_by_context"]:
            print(f"{b['context_from']:>8}-{b['context_to']:<7}{b['steps']:>8}"
                  f"{b['mean_batch']:>12.1f}{b['ms_per_step']:>10.2f}"
                  f"{_rate(b['decode_tok_s']):>12}")  # fmt: skip
    if not check.requests:
        print("spot check        off")
    elif check.passed:
        print(
            f"spot check        passed: requests {check.requests} re-run alone gave the same "
            "tokens and logprobs, bit for bit"
        )
    else:
        print(
            f"spot check        FAILED: {len(check.mismatches)} of {len(check.requests)} "
            "requests re-run alone differ"
        )
        for m in check.mismatches:
            print(f"  {m.describe()}")


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def document(
    options: dict[str, Any],
    engine: Engine,
    figures: dict[str, Any],
    check: SpotCheckResult,
    warmup_s: float,
) -> dict[str, Any]:
    """The one JSON document of the last line."""
    budget = engine.kv_budget
    return {
        "benchmark": "throughput",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "options": options,
        "engine": engine.config.resolved_options(),
        "fingerprint": engine.fingerprint(),
        "kv": {
            "capacity_tokens": engine.pool.num_slots,
            "budget": budget.as_dict() if budget is not None else None,
            # Hybrid models: the radix snapshots' pool (0 for other models).
            "linear_snapshots": engine.stats()["state_snapshot_slots"],
        },
        "memory": engine.memory_bound(),
        "warmup_s": warmup_s,
        "results": figures,
        "spot_check": check.as_dict(),
    }
