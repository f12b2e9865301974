"""The `lockstep check` subcommand: argument parsing and the command itself.

`add_check_parser` registers the subcommand on the main CLI's subparsers; the parsed
arguments' `func` is `run_check_command`, which returns the exit code: 0 when every scenario
passed (or was skipped with a reason), 1 when any failed, 2 when the server could not be
started or reached at all.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from lockstep.check.client import APIS
from lockstep.check.compare import FAIL
from lockstep.check.report import render_table, write_json, write_plot
from lockstep.check.runner import CheckReport, CheckSetupError, run_checks
from lockstep.check.scenarios import (
    CHECK_DRAFTERS,
    SCENARIOS,
    ScenarioSettings,
    speculative_serve_args,
)
from lockstep.check.serve import LockstepServer, ServeError
from lockstep.config import MODE_ALIASES, MODES, canonical_mode

EXAMPLES = """\
examples:
  lockstep check --serve                                  # start Lockstep on a free port
  lockstep check --serve --port 8123                      # ... on this port
  lockstep check --serve --mode reference --scenarios batch   # expect a FAIL: stock torch
  lockstep check --serve --scenarios speculative          # a second server speculates
  lockstep check --url http://127.0.0.1:8000 --json out.json --plot deltas.png
  lockstep check --url http://gpu-box:8000/v1 --model Qwen/Qwen3-8B --atol 1e-6
  lockstep check --url URL --scenarios restart --save before.json     # then restart it,
  lockstep check --url URL --scenarios restart --against before.json  # and compare
"""


def _scenario_list(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if names == ["all"]:
        return list(SCENARIOS)
    for name in names:
        if name not in SCENARIOS:
            raise argparse.ArgumentTypeError(
                f"unknown scenario {name!r}: expected a comma-separated list of"
                f" {', '.join(SCENARIOS)} (or all)"
            )
    if not names:
        raise argparse.ArgumentTypeError("no scenario named")
    return names


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is invalid: expected an integer >= 1")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is invalid: expected a port in 1..65535")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is invalid: expected a number > 0")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def add_check_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `check` on the main CLI's subparsers."""
    p = subparsers.add_parser(
        "check",
        help="check that a server's outputs do not depend on scheduling (Lockstep or any "
        "OpenAI-compatible server)",
        description="Determinism harness: sends the same sequences alone and in bursts, cold "
        "and from the prefix cache, generated and teacher-forced, and compares tokens and "
        "logprobs bitwise. Scenarios: " + ", ".join(SCENARIOS) + ".",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="base URL of a running OpenAI-compatible server")
    target.add_argument(
        "--serve",
        action="store_true",
        help="start Lockstep (python -m lockstep serve) and check it",
    )
    p.add_argument(
        "--model",
        help="model name in requests (default: the first of /v1/models); with --serve, the "
        "model Lockstep loads",
    )
    p.add_argument(
        "--scenarios",
        type=_scenario_list,
        default=list(SCENARIOS),
        help=f"comma-separated subset of {','.join(SCENARIOS)} (default: all)",
    )
    p.add_argument(
        "--api",
        choices=APIS,
        default="openai",
        help="drive the OpenAI routes (/v1/completions, /v1/score) or SGLang's native /generate",
    )
    p.add_argument("--concurrency", type=_positive_int, default=8, help="requests in flight")
    p.add_argument(
        "--budget-s", type=_positive_float, default=120.0, help="time budget for all scenarios"
    )
    p.add_argument(
        "--atol", type=float, default=0.0, help="allowed |delta logprob| (default 0: bitwise)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the harness's random prompts")
    p.add_argument("--max-tokens", type=_positive_int, default=16, help="tokens per probe")
    p.add_argument(
        "--max-model-len",
        type=_positive_int,
        help="context limit for the long scenario when the server has no /v1/engine; with "
        "--serve, also passed to Lockstep",
    )
    p.add_argument("--json", type=Path, metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", type=Path, metavar="FILE.png", help="plot |Δlogprob| by position")
    p.add_argument("--save", type=Path, metavar="FILE", help="restart: write fingerprints")
    p.add_argument("--against", type=Path, metavar="FILE", help="restart: compare with FILE")
    p.add_argument("--request-timeout-s", type=float, default=300.0, help="per-request timeout")
    p.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default: $OPENAI_API_KEY)",
    )
    p.add_argument(
        "--extra-body",
        type=_json_object,
        default={},
        metavar="JSON",
        help="fields merged into every completion request, e.g. '{\"return_token_ids\": true}'",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    engine = p.add_argument_group("engine options (with --serve, passed to lockstep serve)")
    engine.add_argument(
        "--mode",
        choices=MODES + tuple(MODE_ALIASES),
        help="the server's mode (default: deterministic); reference (stock PyTorch) is the "
        "negative control that must FAIL the invariance scenarios ('fast' is its old name)",
    )
    engine.add_argument(
        "--kv-tokens", type=_positive_int, help="the server's KV pool in tokens (default: its own)"
    )
    engine.add_argument(
        "--no-prefix-cache", action="store_true", help="serve without the prefix cache"
    )
    engine.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), help="the server's device (default: auto)"
    )
    engine.add_argument("--dtype", choices=("auto", "float32", "bfloat16"),
                        help="the server's dtype (default: auto)")  # fmt: skip
    engine.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="any other argument for lockstep serve (repeatable), e.g. --serve-arg=--chunk-size=64",
    )
    engine.add_argument(
        "--serve-timeout-s", type=float, default=600.0, help="wait this long for /health"
    )
    engine.add_argument(
        "--speculative-drafter",
        choices=CHECK_DRAFTERS,
        default="ngram",
        help="the speculative scenario's second server drafts with this: prompt lookup, or "
        "the model's own multi-token-prediction layer (default: ngram)",
    )
    engine.add_argument(
        "--port", type=_port, help="the port the server listens on (default: a free one)"
    )
    p.set_defaults(func=run_check_command)


# Where output goes to a pipe or a file, rich would wrap it at 80 columns, mid-sentence; the
# table is laid out this wide instead and text lines are never wrapped.
PIPED_WIDTH = 200


def output_console(stderr: bool = False) -> Console:
    """rich's console for stdout (the report) or stderr (progress, errors). Lines are never
    wrapped (soft wrap), so an error or a path stays whole when copied out of a log; on a
    terminal the table fits the terminal, elsewhere it is laid out PIPED_WIDTH wide."""
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else PIPED_WIDTH
    return Console(stderr=stderr, soft_wrap=True, width=width)


def serve_args(args: argparse.Namespace) -> list[str]:
    """The `lockstep serve` arguments that `--serve` passes through."""
    out: list[str] = []
    for flag, value in (
        ("--model", args.model),
        ("--mode", args.mode and canonical_mode(args.mode)),
        ("--kv-tokens", args.kv_tokens),
        ("--max-model-len", args.max_model_len),
        ("--device", args.device),
        ("--dtype", args.dtype),
    ):
        if value is not None:
            out += [flag, str(value)]
    if args.no_prefix_cache:
        out.append("--no-prefix-cache")
    return out + list(args.serve_arg)


def run_check_command(args: argparse.Namespace) -> int:
    """Run `lockstep check`; returns the exit code (0 all pass, 1 a FAIL, 2 cannot check)."""
    console, err = output_console(), output_console(stderr=True)
    if not args.serve:
        engine_only = [
            flag
            for flag, value in (
                ("--mode", args.mode),
                ("--kv-tokens", args.kv_tokens),
                ("--no-prefix-cache", args.no_prefix_cache or None),
                ("--device", args.device),
                ("--dtype", args.dtype),
                ("--serve-arg", args.serve_arg or None),
                ("--port", args.port),
            )
            if value is not None
        ]
        if engine_only:
            err.print(f"{engine_only[0]} is an engine option: it needs --serve, not --url")
            return 2
    settings = ScenarioSettings(
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        atol=args.atol,
        seed=args.seed,
        max_model_len=args.max_model_len,
        save=args.save,
        against=args.against,
    )
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        err.print(
            "--plot needs matplotlib, which is optional: pip install 'lockstep-llm[plot]' (from "
            "a checkout: pip install -e '.[plot]')",
            markup=False,
            highlight=False,
        )
        return 2
    if args.against is not None and not args.against.is_file():
        err.print(f"--against {args.against}: no such file")
        return 2

    def check(
        url: str, model: str | None, settings: ScenarioSettings, scenarios: list[str]
    ) -> CheckReport:
        return asyncio.run(
            run_checks(
                url,
                scenarios,
                settings,
                model=model,
                budget_s=args.budget_s,
                request_timeout_s=args.request_timeout_s,
                api_key=args.api_key,
                extra_body=args.extra_body,
                api=args.api,
                show_progress=not args.no_progress and sys.stderr.isatty(),
                console=err,
            )
        )

    try:
        if args.serve:
            report = _check_served(args, settings, check, err)
        else:
            report = check(args.url, args.model, settings, args.scenarios)
    except (ServeError, CheckSetupError) as e:
        err.print(f"lockstep check: {e}", highlight=False)
        return 2
    render_table(report, console)
    if args.json is not None:
        write_json(report, args.json)
    if args.plot is not None:
        write_plot(report, args.plot)
    return 0 if report.passed else 1


def _check_served(
    args: argparse.Namespace,
    settings: ScenarioSettings,
    check: Callable[[str, str | None, ScenarioSettings, list[str]], CheckReport],
    err: Console,
) -> CheckReport:
    """Start Lockstep, check it, stop it. With the restart scenario and no --against, the
    restart is real: the first server saves the fingerprints (to --save, or a file of its
    own), a second server with the same options starts once the first has stopped, and its
    answers are compared with them; that comparison is the restart scenario's result."""
    restart = "restart" in args.scenarios and args.against is None
    with tempfile.TemporaryDirectory(prefix="lockstep-check-") as scratch:
        if restart and settings.save is None:
            settings = dataclasses.replace(settings, save=Path(scratch) / "before.json")
        if "speculative" in args.scenarios:
            plain = Path(scratch) / "plain.json"
            settings = dataclasses.replace(settings, speculative_save=plain)
        report = _serve_and_check(args, err, lambda url: check(url, None, settings, args.scenarios))
        if restart and settings.save is not None:
            again = dataclasses.replace(settings, save=None, against=settings.save)
            _second_server(args, err, report, "restart", again, (), check,
                           "restarting the server for the restart scenario",
                           "compared across a restart of the server")  # fmt: skip
        if settings.speculative_save is not None:
            again = dataclasses.replace(
                settings, speculative_save=None, speculative_against=settings.speculative_save
            )
            extra = speculative_serve_args(args.speculative_drafter)
            flags = " ".join(extra)
            after = _second_server(
                args, err, report, "speculative", again, extra, check,
                f"starting a second server with {flags} for the speculative scenario",
                f"compared with a second server started with {flags}",
            )  # fmt: skip
            if after is not None:  # how much it speculated: a comparison of nothing proves little
                counters = after.engine_counters
                drafted = counters.get("spec_drafted_tokens_total", 0)
                accepted = counters.get("spec_accepted_tokens_total", 0)
                after.results[0].note(f"the second server kept {accepted} of {drafted} drafts")
    return report


def _second_server(
    args: argparse.Namespace,
    err: Console,
    report: CheckReport,
    scenario: str,
    settings: ScenarioSettings,
    extra_args: tuple[str, ...],
    check: Callable[[str, str | None, ScenarioSettings, list[str]], CheckReport],
    announce: str,
    note: str,
) -> CheckReport | None:
    """Run `scenario` again on a second server (the first one's arguments and `extra_args`)
    against what the first one saved, and put that comparison in `report` in place of the
    first result; returns the second run's report. Nothing happens (None) when the first run
    failed or saved nothing."""
    saved = next((r for r in report.results if r.name == scenario), None)
    path = settings.against if scenario == "restart" else settings.speculative_against
    if saved is None or saved.status == FAIL or path is None or not path.is_file():
        return None  # nothing saved to compare with: the first result stands
    err.print(announce, highlight=False)
    after = _serve_and_check(
        args, err, lambda url: check(url, None, settings, [scenario]), extra_args
    )
    compared = after.results[0]
    compared.note(note)
    report.results = [compared if r.name == scenario else r for r in report.results]
    report.elapsed_s += after.elapsed_s
    return after


def _serve_and_check(
    args: argparse.Namespace,
    err: Console,
    check: Callable[[str], CheckReport],
    extra_args: tuple[str, ...] = (),
) -> CheckReport:
    """One Lockstep server (with `extra_args` after the user's) for the length of `check`; its
    log is kept if the check fails. The served model's name comes from /v1/models: --model was
    what to load."""
    server = LockstepServer(
        [*serve_args(args), *extra_args], startup_timeout_s=args.serve_timeout_s, port=args.port
    )
    err.print(f"starting: {' '.join(server.command)}", highlight=False)
    with server:
        report = check(server.url)
        if not report.passed:
            server.keep_log = True
            err.print(f"server log: {server.log_path}", highlight=False)
    return report
