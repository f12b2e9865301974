"""End-to-end throughput benchmark: prefill and decode through the real engine.

For each mode and batch size it starts one engine, runs `batch` requests of `prompt_len`
random-token prompts with `gen_len` tokens (ignore_eos; greedy unless `sampling` sets a
temperature, optionally with top-k / top-p, each request then seeded by its index), and reports
prefill tokens/s, decode tokens/s (aggregate and per request) and the deterministic/reference
ratio (`RATIO_MEANING`). A human table first, then ONE JSON document on the last line.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import random
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from lockstep.config import canonical_mode
from lockstep.engine.engine import Engine
from lockstep.engine.sampling_params import SamplingParams
from lockstep.errors import ConfigError

# What the deterministic / reference ratio is, printed beside it and kept in the JSON: the
# reference mode is stock PyTorch, the negative control of the determinism tests, and not a
# speed target; the ratio is therefore not what determinism costs.
RATIO_MEANING = (
    "deterministic / reference = deterministic decode tok/s over reference decode tok/s. "
    "Reference mode is stock PyTorch (cuBLAS/oneDNN, SDPA), the negative control that shows "
    "determinism tests can fail; it is not a speed target, and the ratio is not the cost of "
    "determinism (above 1: deterministic mode decodes faster than stock PyTorch)"
)


@dataclass
class DecodeResult:
    mode: str
    batch: int
    prompt_len: int
    gen_len: int
    prefill_tok_s: float
    decode_tok_s: float  # aggregate over the batch
    decode_ms_per_step: float


def run_decode_bench(
    engine: Engine,
    batch: int,
    prompt_len: int,
    gen_len: int,
    seed: int = 0,
    sampling: dict[str, Any] | None = None,
) -> DecodeResult:
    """Prefill `batch` prompts, then time `gen_len` decode steps during which all `batch`
    requests decode (the steady window). Requests finish their prefills at different steps,
    so each may generate more than gen_len tokens; none reaches its limit inside the window
    (no batch shrinking, no new CUDA-graph bucket captured while timing), and all are
    aborted after it."""
    if gen_len < 1 or prompt_len < 1 or batch < 1:
        raise ConfigError(f"decode benchmark: batch={batch}, prompt_len={prompt_len} and "
                          f"gen_len={gen_len} must all be >= 1")  # fmt: skip
    rng = random.Random(seed)
    vocab = engine.decoder.spec.vocab_size
    # Steps until the last prompt is prefilled, at most: each step's budget, less one token
    # per decoding request, goes to prompts. A request decodes from its first token on.
    per_step = max(1, engine.config.resolved_max_batch_tokens - batch)
    prefill_steps = -(-batch * prompt_len // per_step) + 1
    choice = {"temperature": 0.0, **(sampling or {})}
    if not choice["temperature"] and (choice.get("top_p", 1.0) < 1.0 or choice.get("top_k", 0)):
        raise ConfigError(f"decode benchmark: top_p={choice.get('top_p', 1.0)} / "
                          f"top_k={choice.get('top_k', 0)} filter sampled tokens: give a "
                          "--temperature > 0 as well (0 is greedy)")  # fmt: skip
    params = SamplingParams(max_tokens=gen_len + prefill_steps + 2, ignore_eos=True, **choice)
    need = batch * (prompt_len + params.max_tokens - 1)  # the engine's bound per request
    if need > engine.pool.num_slots:
        raise ConfigError(
            f"batch {batch} of {prompt_len}-token prompts decoding {params.max_tokens} tokens "
            f"needs {need} KV slots to run together; the pool holds {engine.pool.num_slots}: "
            "raise --kv-tokens"
        )
    # Distinct first tokens so no request hits another's prefix in the cache.
    ids = [f"bench-{seed}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        engine.add_request(
            rid, prompt, replace(params, seed=i) if choice["temperature"] else params
        )
    t0 = time.perf_counter()
    window_start = None
    steps = 0
    while steps < gen_len:
        if not engine.has_unfinished():
            raise AssertionError("the requests finished before the timed window ended")
        outs = engine.step()
        if window_start is None:
            if len(outs) == batch:  # every request has its first token: decoding from here
                # No sync here: a step launched ahead (overlapped decode) is in flight, and
                # the window's end is at the same point of the pipeline.
                window_start = time.perf_counter()
            elif _is_cuda(engine):  # prefill steps: charge each its own device time
                torch.cuda.synchronize()
            continue
        # No per-step device sync: with overlapped decode a step launched ahead would be
        # drained and the host's work could not overlap it (plain steps sync on their own).
        if len(outs) != batch or any(o.finished for o in outs):
            raise AssertionError("the batch shrank inside the timed window (a request stopped "
                                 "or was preempted)")  # fmt: skip
        steps += 1
    window_end = time.perf_counter()
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished():
        engine.step()
    if _is_cuda(engine):
        torch.cuda.synchronize()
    assert window_start is not None
    decode_s = window_end - window_start
    return DecodeResult(
        mode=engine.config.mode,
        batch=batch,
        prompt_len=prompt_len,
        gen_len=gen_len,
        prefill_tok_s=batch * prompt_len / (window_start - t0),
        decode_tok_s=batch * steps / decode_s,
        decode_ms_per_step=1000 * decode_s / steps,
    )


def _is_cuda(engine: Engine) -> bool:
    return engine.device.type == "cuda"


def bench_modes(
    options: dict[str, Any],
    modes: list[str],
    batches: list[int],
    prompt_len: int,
    gen_len: int,
    sampling: dict[str, Any] | None = None,
) -> dict[str, Any]:
    from lockstep.config import EngineConfig

    results: list[DecodeResult] = []
    overlap = None
    modes = [canonical_mode(m) for m in modes]
    for mode in modes:
        opts = dict(options, mode=mode, max_running=max(max(batches), 1))
        given = EngineConfig.from_options(**dict(opts, max_running=None))  # device defaults
        # Room for the whole batch's decode tokens plus prompt tokens in every step.
        opts["max_batch_tokens"] = max(given.resolved_max_batch_tokens, prompt_len,
                                       2 * max(batches))  # fmt: skip
        opts["chunk_size"] = min(given.resolved_chunk_size, opts["max_batch_tokens"])
        engine = Engine(EngineConfig.from_options(**opts))
        overlap = engine.config.use_overlap_decode  # the same for every mode (device only)
        for b in batches:
            # Warm-up with the measured shapes (other prompts): kernel compilation for the
            # prefill chunks and CUDA-graph capture for the decode bucket happen once per
            # process and belong to neither timed column.
            run_decode_bench(engine, b, prompt_len, 2, seed=99 + b, sampling=sampling)
            engine.flush_cache()
            r = run_decode_bench(engine, b, prompt_len, gen_len, seed=b, sampling=sampling)
            print(
                f"# {r.mode} batch {r.batch}: decode {r.decode_ms_per_step:.3f} ms/step", flush=True
            )
            results.append(r)
            engine.flush_cache()
        del engine
    print(f"{'mode':<14}{'batch':>6}{'prefill tok/s':>15}{'decode tok/s':>14}{'ms/step':>10}")
    for r in results:
        print(
            f"{r.mode:<14}{r.batch:>6}{r.prefill_tok_s:>15.1f}{r.decode_tok_s:>14.1f}"
            f"{r.decode_ms_per_step:>10.2f}"
        )
    ratios = {}
    by = {(r.mode, r.batch): r for r in results}
    for b in batches:
        det, ref = by.get(("deterministic", b)), by.get(("reference", b))
        if det and ref:
            ratios[str(b)] = det.decode_tok_s / ref.decode_tok_s
            print(f"batch {b}: deterministic / reference decode throughput = {ratios[str(b)]:.3f}")
    if ratios:
        print(RATIO_MEANING)
    return {
        "benchmark": "decode",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "options": {k: v for k, v in options.items() if v is not None}
        | {"overlap_decode": overlap, "sampling": sampling or {"temperature": 0.0}},
        "results": [asdict(r) for r in results],
        "det_over_reference_decode": ratios,
        "det_over_reference_meaning": RATIO_MEANING,
    }


def print_json_last(doc: dict[str, Any]) -> None:
    print(json.dumps(doc))
