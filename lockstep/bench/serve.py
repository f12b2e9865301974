"""`lockstep bench serve`: a load client against a running server, like `vllm bench serve`.

The requests (random token prompts or a JSONL file: lockstep/bench/workload.py) go to any
server that speaks one of the APIs of serve_client.py: Lockstep, vLLM or SGLang. They arrive
all at once or as a Poisson process of `--request-rate` per second (its gaps drawn from a
generator seeded by `--seed`), with at most `--max-concurrency` in flight.

The wall time runs from sending the first request to the end of the last response. Over the
requests that succeeded: requests/s, input and output tokens/s; per request the time to first
token (TTFT), the time per output token after the first (TPOT: (latency - TTFT) / (output
tokens - 1)) and the end-to-end latency; over every gap between streamed output events, the
inter-token latency (ITL). TTFT, TPOT and ITL exist for streams only. The client's own CPU
seconds are reported too: a client near one CPU second per wall second paces the figures
itself.

Warm-up requests first (`--warmup N`, untimed, not in the figures): other random prompts of
the first N requests' lengths, so that no timed prompt is already in the server's cache.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import platform
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from lockstep.bench.serve_client import Outcome, ServeClient
from lockstep.bench.workload import BenchRequest
from lockstep.errors import ConfigError, ModelLoadError
from lockstep.models.tokenizer import Tokenizer

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Arrivals:
    """When requests are sent: at `request_rate` per second on average (Poisson; inf: all at
    once), with at most `max_concurrency` in flight (None: no limit)."""

    max_concurrency: int | None = None
    request_rate: float = math.inf
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ConfigError(f"--max-concurrency {self.max_concurrency} is invalid: expected "
                              "an integer >= 1 (leave it out for no limit)")  # fmt: skip
        if not self.request_rate > 0:
            raise ConfigError(f"--request-rate {self.request_rate} is invalid: expected a rate "
                              "> 0 per second, or inf (all at once)")  # fmt: skip

    def gaps(self, count: int) -> list[float]:
        """The seconds to wait before each of `count` requests (the first is sent at once)."""
        if math.isinf(self.request_rate):
            return [0.0] * count
        rng = random.Random(f"arrivals-{self.seed}")
        return [0.0] + [rng.expovariate(self.request_rate) for _ in range(count - 1)]


@dataclass
class RunResult:
    """One run of the requests: each one's outcome, in order, and the run's clocks."""

    outcomes: list[Outcome]
    wall_s: float
    client_cpu_s: float  # the client process's CPU seconds over the run
    peak_in_flight: int


async def run_load(
    client: ServeClient,
    requests: Sequence[BenchRequest],
    arrivals: Arrivals,
    progress: bool = True,
) -> RunResult:
    """Send every request as `arrivals` says and wait for all of them."""
    limit = asyncio.Semaphore(arrivals.max_concurrency or len(requests))
    in_flight = peak = 0
    # Output tokens, not finished requests: requests sent together finish together, so a bar
    # of requests would sit still all run.
    bar = tqdm(total=sum(r.output_len for r in requests), desc="output tokens", unit="tok",
               disable=not progress)  # fmt: skip

    async def one(request: BenchRequest) -> Outcome:
        nonlocal in_flight, peak
        seen = 0

        def on_output(tokens: int) -> None:
            nonlocal seen
            seen += tokens
            bar.update(tokens)

        async with limit:
            in_flight += 1
            peak = max(peak, in_flight)
            outcome = await client.send(request, on_output)
            in_flight -= 1
        bar.update(max(request.output_len - seen, 0))  # an early stop, a failure, no stream
        return outcome

    cpu0, t0 = time.process_time(), time.perf_counter()
    tasks = []
    try:
        for request, gap in zip(requests, arrivals.gaps(len(requests)), strict=True):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.ensure_future(one(request)))
        outcomes = list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        bar.close()
    return RunResult(outcomes, time.perf_counter() - t0, time.process_time() - cpu0, peak)


def load_tokenizer(name: str) -> Tokenizer:
    """The tokenizer of `name` as `lockstep serve --model` would load it (reading metadata
    only); the embedded default model's served name stands for that model."""
    from lockstep.models.resolver import DEFAULT_MODEL_NAME, resolve_model

    try:
        return resolve_model(None if name == DEFAULT_MODEL_NAME else name).tokenizer
    except ModelLoadError as exc:
        raise ConfigError(f"--tokenizer {name!r} does not load ({exc}); name the served "
                          "model's tokenizer with --tokenizer: a .gguf file, a Hugging Face "
                          "folder or hub id, or a random: preset") from None  # fmt: skip


async def bench_serve(
    client: ServeClient,
    requests: Sequence[BenchRequest],
    warmup: Sequence[BenchRequest],
    arrivals: Arrivals,
    progress: bool = True,
) -> tuple[RunResult, RunResult | None]:
    """The warm-up requests (all at once, within the concurrency limit; None without any),
    then the timed run."""
    warm = None
    if warmup:
        warm = await run_load(client, warmup, Arrivals(arrivals.max_concurrency), False)
    return await run_load(client, requests, arrivals, progress), warm


def warmup_requests(requests: Sequence[BenchRequest], count: int, vocab_size: int,
                    seed: int) -> list[BenchRequest]:  # fmt: skip
    """`count` requests of the first requests' prompt and output lengths (cycling through
    them when there are fewer), with other random tokens."""
    if count < 0:
        raise ConfigError(f"--warmup {count} is invalid: expected an integer >= 0")
    rng = random.Random(f"warm-up-{seed}")
    shapes = [requests[i % len(requests)] for i in range(count)]
    return [
        BenchRequest([rng.randrange(vocab_size) for _ in r.prompt_ids], r.output_len)
        for r in shapes
    ]


def distribution_ms(seconds: Sequence[float]) -> dict[str, float] | None:
    """Mean, percentiles (linear interpolation between samples, as numpy's default) and
    maximum of `seconds`, in milliseconds; None when there are none."""
    if not seconds:
        return None
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    figures = {"count": int(ms.size), "mean": float(ms.mean())}
    for p in PERCENTILES:
        figures[f"p{p}"] = float(np.percentile(ms, p))
    return figures | {"max": float(ms.max())}


def summary(requests: Sequence[BenchRequest], run: RunResult) -> dict[str, Any]:
    """The figures of a run, as the JSON document holds them."""
    done = [(r, o) for r, o in zip(requests, run.outcomes, strict=True) if o.error is None]
    failed = [o for o in run.outcomes if o.error is not None]
    input_tokens = sum(len(r.prompt_ids) if o.prompt_tokens is None else o.prompt_tokens
                       for r, o in done)  # fmt: skip
    output_tokens = sum(o.output_tokens for _, o in done)
    wall = run.wall_s
    tpot = [(o.latency_s - o.ttft_s) / (o.output_tokens - 1) for _, o in done
            if o.ttft_s is not None and o.output_tokens > 1]  # fmt: skip
    return {
        "num_requests": len(requests),
        "completed": len(done),
        "failed": len(failed),
        "first_error": failed[0].error if failed else None,
        "wall_s": wall,
        "requests_per_s": len(done) / wall,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "requested_output_tokens": sum(r.output_len for r, _ in done),
        # Requests whose output tokens the server counted (the others: streamed events).
        "output_counted_by_server": sum(o.counted_by_server for _, o in done),
        "input_tok_s": input_tokens / wall,
        "output_tok_s": output_tokens / wall,
        "total_tok_s": (input_tokens + output_tokens) / wall,
        "peak_in_flight": run.peak_in_flight,
        "client_cpu_s": run.client_cpu_s,
        "ttft_ms": distribution_ms([o.ttft_s for _, o in done if o.ttft_s is not None]),
        "tpot_ms": distribution_ms(tpot),
        "itl_ms": distribution_ms([gap for _, o in done for gap in o.itl_s]),
        "e2e_latency_ms": distribution_ms([o.latency_s for _, o in done]),
    }


def print_report(figures: dict[str, Any]) -> None:
    """The human-readable table (the JSON document follows it on the last line)."""
    f = figures
    print(f"requests          {f['completed']} completed, {f['failed']} failed of "
          f"{f['num_requests']}; at most {f['peak_in_flight']} in flight")  # fmt: skip
    print(f"wall time         {f['wall_s']:.2f} s (client CPU {f['client_cpu_s']:.2f} s)")
    print(f"throughput        {f['requests_per_s']:.2f} req/s; input {f['input_tok_s']:.1f} "
          f"tok/s, output {f['output_tok_s']:.1f} tok/s, "
          f"total {f['total_tok_s']:.1f} tok/s")  # fmt: skip
    print(f"tokens            {f['input_tokens']} input, {f['output_tokens']} output "
          f"({f['requested_output_tokens']} asked for; counted by the server for "
          f"{f['output_counted_by_server']} of {f['completed']} requests)")  # fmt: skip
    header = "".join(f"{'p' + str(p):>10}" for p in PERCENTILES)
    print(f"{'(ms)':<18}{'mean':>10}{header}{'max':>10}")
    for label, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"),
                       ("E2E latency", "e2e_latency_ms")):  # fmt: skip
        d = f[key]
        if d is None:
            why = "no request completed" if not f["completed"] else "no samples: streams only"
            print(f"{label:<18}{'-':>10}  ({why})")
            continue
        cells = "".join(f"{d[name]:>10.2f}" for name in ["mean", *[f"p{p}" for p in PERCENTILES]])
        print(f"{label:<18}{cells}{d['max']:>10.2f}")
    if f["first_error"] is not None:
        print(f"first error       {f['first_error']}")


def document(
    options: dict[str, Any], server: dict[str, Any], figures: dict[str, Any], warmup: dict
) -> dict[str, Any]:
    """The one JSON document of the last line."""
    return {
        "benchmark": "serve",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "options": options,
        "server": server,
        "warmup": warmup,
        "results": figures,
    }
