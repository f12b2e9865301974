"""Time loading a model: resolving it (metadata, spec, tokenizer), reading every weight
(dequantized, in canonical names) and, with --decoder, building the CPU Decoder.

    python scripts/time_load.py                    # the embedded default model
    python scripts/time_load.py --model random:tiny --decoder

Prints a table, then one JSON line (the last line) with the seconds of each phase. Run it in a
fresh process: the first import of torch and tokenizers is part of what a user waits for.
"""

from __future__ import annotations

import argparse
import json
import time

_START = time.perf_counter()

import torch  # noqa: E402

from lockstep.models.resolver import resolve_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="as lockstep's --model (default: SmolLM2)")
    parser.add_argument("--decoder", action="store_true", help="also time Decoder.load on CPU")
    args = parser.parse_args()
    timings: dict[str, float] = {"import": time.perf_counter() - _START}

    start = time.perf_counter()
    loaded = resolve_model(args.model)
    loaded.tokenizer.encode("warm up the tokenizer once")
    timings["resolve_and_tokenizer"] = time.perf_counter() - start

    start = time.perf_counter()
    count = sum(t.numel() for _, t in loaded.iter_weights(torch.float32, "cpu"))
    timings["read_weights"] = time.perf_counter() - start

    if args.decoder:
        from lockstep.models.decoder import Decoder
        from lockstep.ops import get_ops

        start = time.perf_counter()
        Decoder.load(loaded, get_ops("cpu", "deterministic"), torch.float32, "cpu")
        timings["decoder_load"] = time.perf_counter() - start

    timings["total_since_start"] = time.perf_counter() - _START
    print(
        f"model {loaded.name} ({count / 1e6:.1f} M parameters read), {torch.get_num_threads()} threads"
    )
    for phase, seconds in timings.items():
        print(f"  {phase:<24}{seconds:8.3f} s")
    print(
        json.dumps(
            {
                "model": loaded.name,
                "parameters": count,
                **{k: round(v, 3) for k, v in timings.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
