"""Options that cannot work are refused at start-up in one line with exit status 2, the same
way by `lockstep generate` and `lockstep serve` (both build the engine, which checks them),
before any model work where the option alone decides. In-process: `cli.main` returns the
status and prints the line."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from lockstep import cli

ENGINE_ERRORS = [
    pytest.param(["--device", "cuda"], "device='cuda' is invalid", id="cuda-without-cuda",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")),
    pytest.param(["--max-model-len", "999999"],
                 "max_model_len=999999 is invalid for random:tiny: its context is 4096 tokens",
                 id="context-beyond-the-model"),
    pytest.param(["--kv-tokens", "10", "--max-model-len", "64"],
                 "kv_tokens=10 is invalid with max_model_len=64", id="pool-below-the-context"),
]  # fmt: skip


def _one_line(capsys: pytest.CaptureFixture, argv: list[str], needle: str) -> None:
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


@pytest.mark.parametrize(("args", "needle"), ENGINE_ERRORS)
def test_generate_refuses(args: list[str], needle: str, capsys) -> None:
    argv = ["generate", "hi", "--raw", "--max-tokens", "2", "--model", "random:tiny", *args]
    _one_line(capsys, argv, needle)


@pytest.mark.parametrize(("args", "needle"), ENGINE_ERRORS)
def test_serve_refuses(args: list[str], needle: str, capsys) -> None:
    _one_line(capsys, ["serve", "--port", "0", "--model", "random:tiny", *args], needle)


def test_generate_refuses_the_temperatures_the_server_refuses(capsys) -> None:
    argv = ["generate", "hi", "--model", "random:tiny", "--temperature", "5"]
    _one_line(capsys, argv, "temperature=5.0 is invalid: expected 0 (greedy) or a number from")


def test_a_pool_below_the_model_context_is_said_at_start(caplog, capsys) -> None:
    argv = ["generate", "hi", "--raw", "--max-tokens", "2", "--model", "random:tiny",
            "--kv-tokens", "16"]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="lockstep.engine"):
        assert cli.main(argv) == 0
    assert "kv_tokens=16 is less than one prefill chunk (512 tokens)" in caplog.text


def test_version(capsys) -> None:
    import lockstep

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"lockstep {lockstep.__version__}\n"


def test_every_option_of_every_command_says_what_it_does() -> None:
    import argparse

    def undocumented(parser: argparse.ArgumentParser, path: str) -> list[str]:
        found = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found += undocumented(sub, f"{path} {name}")
            elif action.option_strings and not action.help:
                found.append(f"{path} {action.option_strings[0]}")
        return found

    assert undocumented(cli.build_parser(), "lockstep") == []


def test_every_option_with_a_default_shows_it_in_help() -> None:
    """`--help` names the default of every option that takes a value and has one (flags and
    options whose absence means "decided at start" have nothing to show)."""
    import argparse

    from lockstep.cli_options import full_help

    def silent(parser: argparse.ArgumentParser, path: str) -> list[str]:
        entries = re.split(r"\n(?=  -)", full_help(parser))
        found = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found += silent(sub, f"{path} {name}")
            elif action.option_strings and action.nargs != 0 and action.default not in (
                None, [], {}, ""
            ):  # fmt: skip
                entry = next(e for e in entries if e.lstrip().startswith(action.option_strings[0]))
                if "default" not in entry:
                    found.append(f"{path} {action.option_strings[0]}")
        return found

    assert silent(cli.build_parser(), "lockstep") == []


def test_help_describes_the_command_and_names_the_other_engine_options() -> None:
    """`--help` describes the subcommand's own options and the common engine options and
    only names the others; `--help-all` describes every one (the control: the brief help
    lacks a description that the full help has)."""
    from lockstep.cli_options import full_help

    serve = cli.build_parser()._subparsers._group_actions[0].choices["serve"]
    brief, full = serve.format_help(), full_help(serve)
    described = "radix snapshots of the linear-attention state"
    assert described in " ".join(full.split()) and described not in " ".join(brief.split())
    assert "--linear-snapshot-interval" in brief and "--help-all" in brief
    assert "--max-waiting" in brief and "--kv-tokens KV_TOKENS" in brief
    assert len(brief.splitlines()) < len(full.splitlines()) - 20
