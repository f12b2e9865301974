"""Run the engine's real Scheduler over a workload with a stand-in for the model (each step
appends one token to every request that samples), and count what the plan costs: steps,
prompt rows, preemptions, positions computed twice, and the KV read by decode rows. No
device, no weights: a pool of N tokens is N slots of a few bytes.

    python scripts/admission_simulation.py --kv-tokens 403164 --num-prompts 256 \
        --input-len 1024 --output-len 1024 [--mixed-output] [--output-reserve 1.0]

`--mixed-output`: request i asks for 1 + (i x 2654435761 mod (2 x output-len - 1)) tokens, a
spread over 1..2 x output-len - 1 with the same mean. Defaults are CUDA's (8,192-token
steps, 4,096-token chunks, 256 running)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from lockstep.cache.kv_pool import KVPool  # noqa: E402
from lockstep.cache.radix import RadixCache  # noqa: E402
from lockstep.engine.outputs import TokenLogprob  # noqa: E402
from lockstep.engine.request import Request  # noqa: E402
from lockstep.engine.sampling_params import SamplingParams  # noqa: E402
from lockstep.engine.scheduler import Scheduler  # noqa: E402


def simulate(args: argparse.Namespace) -> dict[str, float]:
    pool = KVPool(args.kv_tokens, 1, 1, 1, torch.float16, "cpu")
    scheduler = Scheduler(
        pool,
        RadixCache(pool),
        max_batch_tokens=args.max_batch_tokens,
        chunk_size=args.chunk_size,
        max_running=args.max_running,
        output_reserve=args.output_reserve,
    )
    requests = []
    for i in range(args.num_prompts):
        out = args.output_len
        if args.mixed_output:
            out = 1 + (i * 2654435761) % (2 * args.output_len - 1)
        params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
        prompt = [(i * 7919 + j * 31) % 50_000 + 1 for j in range(args.input_len)]
        requests.append(Request(f"r{i}", prompt, params, seed=0, arrival=i))
        scheduler.add(requests[-1])
    steps = prompt_rows = decode_rows = kv_reads = rows = 0
    while scheduler.has_work():
        steps += 1
        for chunk in scheduler.schedule():
            request = chunk.request
            rows += chunk.end - chunk.start
            if chunk.start >= len(request.prompt_ids):
                decode_rows += 1
                kv_reads += chunk.end
            else:
                prompt_rows += chunk.end - chunk.start
            if chunk.end != request.num_tokens:
                continue
            request.output_ids.append(1)
            request.output_logprobs.append(TokenLogprob(1, -1.0))
            if chunk.completes_prompt:
                scheduler.cache_prefix(request)
            if len(request.output_ids) >= request.params.max_tokens:
                scheduler.finish(request)
    own = sum(len(r.prompt_ids) + len(r.output_ids) - 1 for r in requests)
    return {
        "steps": steps,
        "prompt_rows": prompt_rows,
        "decode_rows": decode_rows,
        "preemptions": scheduler.num_preemptions,
        "recomputed_positions": rows - own,
        "recomputed_share_of_prompts": (rows - own) / sum(len(r.prompt_ids) for r in requests),
        "kv_token_reads": kv_reads,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-tokens", type=int, default=403_164)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--mixed-output", action="store_true")
    parser.add_argument("--output-reserve", type=float, default=1.0)
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    parser.add_argument("--chunk-size", type=int, default=4096)
    parser.add_argument("--max-running", type=int, default=256)
    args = parser.parse_args()
    start = time.perf_counter()
    result = simulate(args)
    result["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps({"args": vars(args), **result}))


if __name__ == "__main__":
    main()
