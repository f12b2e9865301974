"""Decode step time with a structured output (or penalties) against without, at batch sizes
1 and 32 (issue target: within 10%).

Runs the engine directly (no server imports). Each configuration adds `batch` requests with
the same prompts and seeds, steps until every request is decoding, then times `steps` decode
steps (`Engine.step`, which includes the host work: llguidance's masks, the eager logits
processing, and the loss of overlapped decode for processed requests). Configurations:
  plain          no processing (overlapped decode on, the default)
  plain-serial   no processing, overlapped decode off (isolates what the overlap hides)
  json           a JSON schema whose one string field runs long
  regex          words and spaces, never complete before max_tokens
  penalties      presence + frequency + repetition penalties

    python scripts/grammar_step_time.py                      # GPU, random:qwen3-8b
    python scripts/grammar_step_time.py --device cpu --model random:tiny --steps 8
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.engine.sampling_params import SamplingParams
from lockstep.engine.structured_output import StructuredOutput

JSON_SPEC = StructuredOutput.json_schema(
    {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
)
REGEX_SPEC = StructuredOutput.regex(r"[A-Za-z ]{1,100000}")
CONFIGS = {
    "plain": {},
    "plain-serial": {},
    "json": {"structured_output": JSON_SPEC},
    "regex": {"structured_output": REGEX_SPEC},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(engine: Engine, config: str, batch: int, steps: int, device: str) -> dict:
    """Mean and median decode step time (ms) of `batch` requests under `config`."""
    rng = random.Random(0)
    vocab = engine.decoder.spec.vocab_size
    max_tokens = steps + 16
    for i in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(64)]
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True,
                                **CONFIGS[config])  # fmt: skip
        engine.add_request(f"{config}-{batch}-{i}", prompt, params)
    while any(r.num_computed < len(r.prompt_ids) for r in engine.requests.values()):
        engine.step()
    for _ in range(3):  # warm-up decode steps (graph capture for this batch)
        engine.step()
    times, tokens = [], 0
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        outs = engine.step()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
        tokens += sum(len(o.new_token_ids) for o in outs)
    running = len(engine.requests)
    for rid in list(engine.requests):
        engine.abort_request(rid)
    while engine.has_unfinished():
        engine.step()
    return {
        "config": config,
        "batch": batch,
        "mean_ms": statistics.fmean(times),
        "median_ms": statistics.median(times),
        "tokens_per_step": tokens / steps,
        "still_running": running,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:qwen3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    engines: dict[bool, Engine] = {}
    rows = []
    for config in args.configs.split(","):
        overlap = config != "plain-serial"
        if overlap not in engines:
            engines.clear()  # one engine at a time (memory)
            if args.device == "cuda":
                torch.cuda.empty_cache()
            engines[overlap] = Engine(EngineConfig(
                model=args.model, device=args.device, dtype=dtype, kv_tokens=65536,
                max_model_len=4096, max_running=64, overlap_decode=overlap,
            ))  # fmt: skip
        for batch in (int(b) for b in args.batches.split(",")):
            row = measure(engines[overlap], config, batch, args.steps, args.device)
            rows.append(row)
            print(json.dumps(row), flush=True)
    base = {r["batch"]: r["median_ms"] for r in rows if r["config"] == "plain"}
    print(f"\n{'config':<14}{'batch':>6}{'median ms':>11}{'mean ms':>10}{'vs plain':>10}")
    for r in rows:
        ratio = r["median_ms"] / base[r["batch"]] - 1 if r["batch"] in base else float("nan")
        print(f"{r['config']:<14}{r['batch']:>6}{r['median_ms']:>11.2f}{r['mean_ms']:>10.2f}"
              f"{ratio:>+10.1%}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "device": args.device, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
