"""`lockstep generate | chat | serve | check | bench`.

Errors meant for the user (bad options, a model that cannot load, a request that cannot be
served) print one line to stderr and exit with status 2, without a traceback; so does a
tensor-parallel worker that dies, with status 1.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lockstep import __version__
from lockstep.cli_options import (
    add_engine_arguments,
    engine_options_from_args,
    use_defaults_help,
)
from lockstep.errors import LockstepError

if TYPE_CHECKING:  # the engine is imported only by the commands that start one
    from lockstep.engine.engine import Engine
    from lockstep.engine.sampling_params import SamplingParams


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "takes_any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # The one-time kernel build takes about a minute: say so instead of sitting silent.
    logging.getLogger("lockstep.ops.cpu_build").setLevel(logging.INFO)
    try:
        return int(args.func(args) or 0)
    except LockstepError as e:
        print(f"lockstep: error: {e}", file=sys.stderr)
        return e.exit_status
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lockstep",
        description="LLM inference whose outputs are bit-identical however work is scheduled.",
    )
    parser.add_argument("--version", action="version", version=f"lockstep {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion and stream it to the terminal")
    gen.add_argument("prompt", help="the prompt (the chat template is applied unless --raw)")
    _add_sampling_arguments(gen)
    gen.add_argument("--raw", action="store_true", help="send the prompt without chat template")
    gen.add_argument("-v", "--verbose", action="store_true", help="log engine start-up")
    add_engine_arguments(gen)
    gen.set_defaults(func=_run_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    _add_sampling_arguments(chat)
    chat.add_argument("--system", default=None, help="system message")
    chat.add_argument("-v", "--verbose", action="store_true", help="log engine start-up")
    add_engine_arguments(chat)
    chat.set_defaults(func=_run_chat)

    _add_optional_subcommands(sub)
    use_defaults_help(parser)
    return parser


# The subcommands whose parsers live beside their code: (name, module, registering function).
_SUBCOMMANDS = (
    ("serve", "lockstep.server.cli", "add_serve_parser"),
    ("check", "lockstep.check.cli", "add_check_parser"),
    ("bench", "lockstep.bench.cli", "add_bench_parser"),
)


def _add_optional_subcommands(sub: argparse._SubParsersAction) -> None:
    """Register serve, check and bench. A subcommand whose module cannot be imported (a broken
    install) is still listed, and running it prints what is missing; it never takes the other
    subcommands down with it."""
    for name, module, register in _SUBCOMMANDS:
        try:
            getattr(importlib.import_module(module), register)(sub)
        except ImportError as e:
            _add_unavailable_subcommand(sub, name, e)


def _add_unavailable_subcommand(
    sub: argparse._SubParsersAction, name: str, error: ImportError
) -> None:
    missing = getattr(error, "name", None) or str(error)

    def fail(args: argparse.Namespace) -> int:
        raise LockstepError(
            f"`lockstep {name}` cannot run: the module {missing!r} is not installed; "
            "reinstall Lockstep with its dependencies (from the checkout: pip install -e .)"
        )

    p = sub.add_parser(name, help=f"(unavailable: {missing!r} is not installed)", add_help=False)
    p.set_defaults(func=fail, takes_any_arguments=True)


def _add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus filter (1: off)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k likeliest (0: off)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed")


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    from lockstep.engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )


def _stream(engine: Engine, request_id: str, token_ids: list[int], params: SamplingParams) -> str:
    engine.add_request(request_id, token_ids, params)
    text = []
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            text.append(out.new_text)
    sys.stdout.write("\n")
    return "".join(text)


def _start_engine(args: argparse.Namespace, **overrides: Any) -> Engine:
    """The engine of `generate` and `chat`. On a terminal, one line on stderr says what loads
    and, once it has, how long it took (the first load of a model takes seconds, a big one
    minutes); where stderr is not a terminal (scripts, pipes) nothing is said, so that an
    error stays the one line a script reads."""
    from lockstep.config import EngineConfig
    from lockstep.engine.engine import Engine

    config = EngineConfig.from_options(**{**engine_options_from_args(args), **overrides})
    if not sys.stderr.isatty():
        return Engine(config)
    from lockstep.models.resolver import DEFAULT_MODEL_NAME

    # Whole lines: the start-up's own log lines (-v, warnings) may come between the two.
    print(f"Loading {config.model or DEFAULT_MODEL_NAME} ...", file=sys.stderr, flush=True)
    started = time.monotonic()
    engine = Engine(config)
    print(f"Loaded in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    return engine


def _prompt_ids(tokenizer: Any, args: argparse.Namespace) -> list[int]:
    if args.raw:
        return tokenizer.encode(args.prompt)
    text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    return tokenizer.encode(text, add_special_tokens=False)


def _one_job_kv_tokens(args: argparse.Namespace) -> int | None:
    """The KV pool one `generate` needs: its prompt and --max-tokens, at least one prefill
    chunk, and the whole context where --max-model-len names one (the engine requires that
    much). None where the user sized the pool (--kv-tokens, --kv-memory-fraction). A pool
    sized from memory would reserve gigabytes (and take seconds to allocate) for one answer.
    The prompt is tokenized by a first resolution of the model, which reads its tokenizer
    and metadata, not its weights."""
    from lockstep.config import EngineConfig
    from lockstep.models.resolver import resolve_model

    options = engine_options_from_args(args)
    if options.get("kv_tokens") is not None or options.get("kv_memory_fraction") is not None:
        return None
    config = EngineConfig.from_options(**options)
    loaded = resolve_model(config.model, config.random_seed, config.revision)
    need = len(_prompt_ids(loaded.tokenizer, args)) + args.max_tokens
    return max(need, config.resolved_chunk_size, config.max_model_len or 0)


def _run_generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    kv_tokens = _one_job_kv_tokens(args)
    engine = _start_engine(args) if kv_tokens is None else _start_engine(args, kv_tokens=kv_tokens)
    _stream(engine, "generate-0", _prompt_ids(engine.tokenizer, args), params)
    return 0


def _run_chat(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    engine = _start_engine(args)
    tok = engine.tokenizer
    messages = [{"role": "system", "content": args.system}] if args.system else []
    turn = 0
    print("Chatting with", engine.model_name, "- an empty line or Ctrl-D ends the chat.")
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        reply = _stream(engine, f"chat-{turn}", ids, params)
        messages.append({"role": "assistant", "content": reply})
        turn += 1
