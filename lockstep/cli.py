"""`lockstep generate | chat | serve | check | bench`.

Errors meant for the user (bad options, a model that cannot load, a request that cannot be
served) print one line to stderr and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lockstep.cli_options import add_engine_arguments, engine_options_from_args
from lockstep.errors import LockstepError

if TYPE_CHECKING:  # the engine is imported only by the commands that start one
    from lockstep.engine.engine import Engine
    from lockstep.engine.sampling_params import SamplingParams


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # The one-time kernel build takes half a minute: say so instead of sitting silent.
    logging.getLogger("lockstep.ops.cpu_build").setLevel(logging.INFO)
    try:
        return int(args.func(args) or 0)
    except LockstepError as e:
        print(f"lockstep: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lockstep",
        description="LLM inference whose outputs are bit-identical however work is scheduled.",
    )
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
    return parser


def _add_optional_subcommands(sub: argparse._SubParsersAction) -> None:
    from lockstep.bench.cli import add_bench_parser
    from lockstep.check.cli import add_check_parser
    from lockstep.server.cli import add_serve_parser

    add_serve_parser(sub)
    add_check_parser(sub)
    add_bench_parser(sub)


def _add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
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


def _start_engine(args: argparse.Namespace) -> Engine:
    from lockstep.config import EngineConfig
    from lockstep.engine.engine import Engine

    return Engine(EngineConfig.from_options(**engine_options_from_args(args)))


def _run_generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    engine = _start_engine(args)
    tok = engine.tokenizer
    if args.raw:
        ids = tok.encode(args.prompt)
    else:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}])
        ids = tok.encode(text, add_special_tokens=False)
    _stream(engine, "generate-0", ids, params)
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
