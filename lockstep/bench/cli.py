"""`lockstep bench decode` (prefill/decode throughput, deterministic vs the stock-PyTorch
reference mode), `lockstep bench throughput` (offline end-to-end throughput of a whole
workload, with a bitwise spot check) and `lockstep bench serve` (a load client against a
running server)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockstep.cli_options import add_engine_arguments, engine_flags, engine_options_from_args

if TYPE_CHECKING:  # the engine and the models are imported only by the commands that use them
    from lockstep.bench.workload import BenchRequest, LengthRange
    from lockstep.models.tokenizer import Tokenizer


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (table, then one JSON line)")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    decode = kinds.add_parser("decode", help="prefill and decode throughput through the engine")
    decode.add_argument("--modes", default="deterministic,reference",
                        help="comma-separated modes to compare (reference: stock PyTorch, the "
                        "negative control, not a speed target)")  # fmt: skip
    decode.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    decode.add_argument("--prompt-len", type=int, default=128,
                        help="prompt tokens per sequence (default 128)")  # fmt: skip
    decode.add_argument("--gen-len", type=int, default=64,
                        help="tokens generated per sequence (default 64)")  # fmt: skip
    decode.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    decode.add_argument("--temperature", type=float, default=0.0,
                        help="sample at this temperature (default 0: greedy)")  # fmt: skip
    decode.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus filter for sampled tokens (needs --temperature)")  # fmt: skip
    decode.add_argument("--top-k", type=int, default=0,
                        help="keep the k most likely tokens (needs --temperature; 0: off)")  # fmt: skip
    add_engine_arguments(decode)
    decode.set_defaults(func=run_bench_decode)
    _add_throughput_parser(kinds)
    _add_serve_parser(kinds)
    _add_speculative_parser(kinds)


def _add_speculative_parser(kinds: argparse._SubParsersAction) -> None:
    spec = kinds.add_parser(
        "speculative",
        help="batch-1 decode with and without exact speculative decoding on real text",
        description="Runs each prompt alone, greedy, on a plain engine and on a speculating "
        "one in turn (--speculative, default ngram), compares the outputs bit for bit, and "
        "reports acceptance and the decode speed-up (docs/speculative.md).",
    )
    spec.add_argument("--prompts-file", type=Path, required=True,
                      help="JSON lines of {name, prompt} or {name, user} (e.g. "
                      "bench/copy_prompts.jsonl)")  # fmt: skip
    spec.add_argument("--max-tokens", type=int, default=128,
                      help="tokens generated per prompt (greedy; EOS ends a run)")  # fmt: skip
    spec.add_argument("--repeats", type=int, default=3,
                      help="runs of each prompt on each engine, in turn")  # fmt: skip
    spec.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    add_engine_arguments(spec)
    spec.set_defaults(func=run_bench_speculative)


def _add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The requests of `bench throughput` and `bench serve` (lockstep/bench/workload.py)."""
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="requests (default 256; with --prompts-file: every line)")  # fmt: skip
    parser.add_argument("--input-len", default=None,
                        help="prompt tokens of random prompts: N or a range a:b (default 1024)")  # fmt: skip
    parser.add_argument("--output-len", default="1024",
                        help="most tokens each request generates: N or a range a:b")  # fmt: skip
    parser.add_argument("--prompts-file", type=Path, default=None,
                        help="JSONL prompts ({\"prompt\": text} or {\"prompt_token_ids\": [...]}, "
                        "optional \"output_len\") instead of random tokens")  # fmt: skip
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                        help="generate --output-len tokens whatever is sampled (default: on for "
                        "random prompts, off for --prompts-file)")  # fmt: skip


def _add_throughput_parser(kinds: argparse._SubParsersAction) -> None:
    tput = kinds.add_parser(
        "throughput", help="end-to-end throughput of a whole workload, then a bitwise spot check"
    )
    _add_workload_arguments(tput)
    tput.add_argument("--temperature", type=float, default=0.0,
                      help="sample at this temperature (default 0: greedy)")  # fmt: skip
    tput.add_argument("--top-p", type=float, default=1.0,
                      help="nucleus filter for sampled tokens (needs --temperature)")  # fmt: skip
    tput.add_argument("--top-k", type=int, default=0,
                      help="keep the k most likely tokens (needs --temperature; 0: off)")  # fmt: skip
    tput.add_argument("--seed", type=int, default=0,
                      help="draws the lengths, the random prompts and request i's sampling "
                      "seed (seed + i)")  # fmt: skip
    tput.add_argument("--spot-check", type=int, default=3,
                      help="requests re-run alone afterwards, compared bit for bit (0: off); "
                      "a difference exits with status 1")  # fmt: skip
    tput.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                      help="first run requests of the same lengths, untimed (kernel "
                      "compilation, CUDA-graph capture)")  # fmt: skip
    tput.add_argument("--context-band", type=int, default=256,
                      help="width of the context bands of the decode step times")  # fmt: skip
    tput.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    tput.add_argument("--step-log", type=Path, default=None,
                      help="write every timed step here, one JSON line each (seconds, device "
                      "wait, garbage collection, launched ahead, rows)")  # fmt: skip
    tput.add_argument("--no-progress", dest="progress", action="store_false",
                      help="no progress bar on stderr")  # fmt: skip
    add_engine_arguments(tput)
    tput.set_defaults(func=run_bench_throughput)


def _add_serve_parser(kinds: argparse._SubParsersAction) -> None:
    serve = kinds.add_parser(
        "serve", help="a load client against a running server (Lockstep, vLLM, SGLang)"
    )
    serve.add_argument("--url", default="http://127.0.0.1:8000",
                       help="the server's base URL (default http://127.0.0.1:8000)")  # fmt: skip
    serve.add_argument("--api", choices=("generate", "completions", "chat"),
                       default="completions",
                       help="SGLang-native POST /generate, /v1/completions or "
                       "/v1/chat/completions (default completions)")  # fmt: skip
    serve.add_argument("--model", default=None,
                       help="the model name to send (default: GET /v1/models' first)")  # fmt: skip
    serve.add_argument("--tokenizer", default=None,
                       help="where the client finds the served model's tokenizer (for random "
                       "prompts' vocabulary, text prompts' lengths and chat prompts' text), as "
                       "`lockstep serve --model` takes a model (default: --model)")  # fmt: skip
    _add_workload_arguments(serve)
    serve.add_argument("--max-concurrency", type=int, default=None,
                       help="requests in flight at most (default: no limit)")  # fmt: skip
    serve.add_argument("--request-rate", type=float, default=math.inf,
                       help="requests per second on average, Poisson arrivals drawn with "
                       "--seed (default inf: all at once)")  # fmt: skip
    serve.add_argument("--temperature", type=float, default=0.0,
                       help="sample at this temperature (default 0: greedy)")  # fmt: skip
    serve.add_argument("--logprobs", action=argparse.BooleanOptionalAction, default=False,
                       help="ask for the sampled tokens' logprobs")  # fmt: skip
    serve.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                       help="stream the responses (default; TTFT and ITL need it)")  # fmt: skip
    serve.add_argument("--warmup", type=int, default=0,
                       help="send this many requests of the first requests' lengths (other "
                       "random tokens) first, untimed")  # fmt: skip
    serve.add_argument("--seed", type=int, default=0,
                       help="draws the lengths, the random prompts and the arrivals")  # fmt: skip
    serve.add_argument("--timeout", type=float, default=3600.0,
                       help="seconds a request may wait for the server to connect, accept or "
                       "send its next bytes (default 3600)")  # fmt: skip
    serve.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    serve.add_argument("--no-progress", dest="progress", action="store_false",
                       help="no progress bar on stderr")  # fmt: skip
    serve.set_defaults(func=run_bench_serve)


_THROUGHPUT_OPTIONS = ("num_prompts", "input_len", "output_len", "prompts_file", "ignore_eos",
                       "temperature", "top_p", "top_k", "seed", "spot_check", "warmup",
                       "context_band")  # fmt: skip


def run_bench_throughput(args: argparse.Namespace) -> int:
    """Exit status 0, or 1 when the spot check found a difference."""
    from lockstep.bench import throughput
    from lockstep.config import EngineConfig
    from lockstep.engine.engine import Engine

    options = engine_options_from_args(args)
    lengths = _workload_lengths(args)
    engine = Engine(EngineConfig.from_options(**options))
    requests, ignore_eos = _workload(
        args, lengths, engine.decoder.spec.vocab_size, engine.tokenizer
    )
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    params = throughput.request_params(requests, sampling, ignore_eos, args.seed)
    run, check, warm_s = throughput.bench_throughput(
        engine, requests, params, warmup=args.warmup, spot_checks=args.spot_check,
        context_band=args.context_band, seed=args.seed, progress=args.progress,
    )  # fmt: skip
    figures = throughput.summary(run, len(requests))
    if args.step_log is not None:
        throughput.write_step_log(args.step_log, run)
    throughput.print_report(figures, engine.pool.num_slots, check)
    bench_options = {k: getattr(args, k) for k in _THROUGHPUT_OPTIONS} | {
        "num_prompts": len(requests),
        "input_len": None if args.prompts_file else str(lengths[0]),
        "prompts_file": None if args.prompts_file is None else str(args.prompts_file),
        "ignore_eos": ignore_eos,
    }
    doc = throughput.document(bench_options, engine, figures, check, warm_s)
    doc["command"] = _command("lockstep bench throughput", args, options)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc))
    return 0 if check.passed else 1


_SERVE_OPTIONS = ("url", "api", "model", "tokenizer", "num_prompts", "input_len", "output_len",
                  "prompts_file", "ignore_eos", "max_concurrency", "request_rate",
                  "temperature", "logprobs", "stream", "warmup", "seed", "timeout")  # fmt: skip


def run_bench_serve(args: argparse.Namespace) -> int:
    """Exit status 0, or 1 when a request failed."""
    import asyncio

    from lockstep.bench import serve
    from lockstep.bench.serve_client import RequestOptions, ServeClient, served_model
    from lockstep.errors import ConfigError

    lengths = _workload_lengths(args)
    arrivals = serve.Arrivals(args.max_concurrency, args.request_rate, args.seed)
    if not args.timeout > 0:
        raise ConfigError(f"--timeout {args.timeout} is invalid: expected seconds > 0")
    if not args.temperature >= 0:
        raise ConfigError(f"--temperature {args.temperature} is invalid: expected >= 0")
    model = args.model
    if model is None and not (args.api == "generate" and args.tokenizer):
        model = asyncio.run(served_model(args.url, args.timeout))
    tokenizer = serve.load_tokenizer(args.tokenizer or model)
    requests, ignore_eos = _workload(args, lengths, tokenizer.vocab_size, tokenizer)
    options = RequestOptions(api=args.api, model=model, stream=args.stream,
                             temperature=args.temperature, ignore_eos=ignore_eos,
                             logprobs=args.logprobs)  # fmt: skip
    warmup = serve.warmup_requests(requests, args.warmup, tokenizer.vocab_size, args.seed)

    async def both() -> tuple[serve.RunResult, serve.RunResult | None]:
        async with ServeClient(args.url, options, tokenizer, args.timeout) as client:
            return await serve.bench_serve(client, requests, warmup, arrivals, args.progress)

    run, warm = asyncio.run(both())
    figures = serve.summary(requests, run)
    serve.print_report(figures)
    bench_options = {k: getattr(args, k) for k in _SERVE_OPTIONS} | {
        "model": model,
        "num_prompts": len(requests),
        "input_len": None if args.prompts_file else str(lengths[0]),
        "prompts_file": None if args.prompts_file is None else str(args.prompts_file),
        "ignore_eos": ignore_eos,
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
    }
    warm_outcomes = warm.outcomes if warm else []
    warm_figures = {"requests": len(warmup), "seconds": warm.wall_s if warm else 0.0,
                    "failed": sum(o.error is not None for o in warm_outcomes)}  # fmt: skip
    server = {"url": args.url, "api": args.api, "model": model}
    doc = serve.document(bench_options, server, figures, warm_figures)
    doc["command"] = _command("lockstep bench serve", args, {}, _SERVE_OPTIONS)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc))
    return 0 if figures["failed"] == 0 else 1


def _workload_lengths(args: argparse.Namespace) -> tuple[LengthRange, LengthRange]:
    """`--input-len` and `--output-len`, checked before anything is started."""
    from lockstep.bench.workload import LengthRange
    from lockstep.errors import ConfigError

    if args.prompts_file is not None and args.input_len is not None:
        raise ConfigError("--input-len is for random prompts: a --prompts-file brings its own "
                          "prompts (leave --input-len out)")  # fmt: skip
    return (LengthRange.parse(args.input_len or "1024", "--input-len"),
            LengthRange.parse(args.output_len, "--output-len"))  # fmt: skip


def _workload(
    args: argparse.Namespace,
    lengths: tuple[LengthRange, LengthRange],
    vocab_size: int,
    tokenizer: Tokenizer,
) -> tuple[list[BenchRequest], bool]:
    """The requests `_add_workload_arguments`' options ask for, and whether they ignore EOS
    (default: on for random prompts, off for a prompts file)."""
    from lockstep.bench import workload

    input_len, output_len = lengths
    if args.prompts_file is None:
        num_prompts = 256 if args.num_prompts is None else args.num_prompts
        requests = workload.random_requests(
            num_prompts, input_len, output_len, vocab_size, args.seed
        )
        return requests, True if args.ignore_eos is None else args.ignore_eos
    requests = workload.file_requests(
        args.prompts_file, tokenizer, args.num_prompts, output_len, args.seed
    )
    return requests, bool(args.ignore_eos)


def _command(
    prefix: str,
    args: argparse.Namespace,
    engine_options: dict[str, Any],
    names: tuple[str, ...] = _THROUGHPUT_OPTIONS,
) -> str:
    """The command line that repeats this run: the benchmark's options `names` as given
    (defaults included) and the engine options that differ from their defaults."""
    words = [prefix]
    for name in names:
        value = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            words.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            words += [flag, str(value)]
    return " ".join(words + engine_flags(engine_options))


def run_bench_speculative(args: argparse.Namespace) -> int:
    """Exit status 0, or 1 when speculation changed an output."""
    from lockstep.bench import speculative
    from lockstep.config import EngineConfig
    from lockstep.engine.engine import Engine
    from lockstep.errors import ConfigError

    if args.max_tokens < 1 or args.repeats < 1:
        raise ConfigError(f"--max-tokens {args.max_tokens} and --repeats {args.repeats} are "
                          "invalid: expected both >= 1")  # fmt: skip
    options = engine_options_from_args(args)
    options["speculative"] = options.get("speculative") or "ngram"
    plain_config = EngineConfig.from_options(**dict(options, speculative=None, draft_model=None))
    if plain_config.kv_tokens is None and plain_config.kv_memory_fraction is None:
        # Two engines share the device: the first takes half its default share of the memory
        # left, and the second's default share is of what the first leaves.
        half = 0.5 * plain_config.resolved_kv_memory_fraction
        plain_config = dataclasses.replace(plain_config, kv_memory_fraction=half)
    plain = Engine(plain_config)
    speculating = Engine(EngineConfig.from_options(**options))
    prompts = speculative.load_prompts(args.prompts_file, plain)
    results = speculative.bench_speculative(
        plain, speculating, prompts, args.max_tokens, args.repeats
    )
    doc = speculative.report(results, options, args.repeats)
    doc["command"] = _command(
        "lockstep bench speculative", args, options, ("prompts_file", "max_tokens", "repeats")
    )
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc))
    return 0 if doc["identical"] else 1


def run_bench_decode(args: argparse.Namespace) -> int:
    from lockstep.bench.decode import bench_modes, print_json_last

    options = engine_options_from_args(args)
    options.pop("mode", None)
    doc = bench_modes(
        options,
        modes=[m.strip() for m in args.modes.split(",") if m.strip()],
        batches=[int(b) for b in args.batches.split(",")],
        prompt_len=args.prompt_len,
        gen_len=args.gen_len,
        sampling={"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k},
    )
    doc["command"] = "lockstep bench decode " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
        if k in ("modes", "batches", "prompt_len", "gen_len", "temperature", "top_p", "top_k")
    )  # fmt: skip
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(doc, indent=2) + "\n")
    print_json_last(doc)
    return 0
