"""The engine's modes (lockstep/config.py): "deterministic" and "reference" (stock PyTorch, the
negative control), and "fast", the reference mode's old name, still taken where users type
options (EngineConfig.from_options, `LLM(mode=...)`, `--mode`) with a one-line deprecation
warning, and refused by the validated dataclass itself, so that a config never holds it."""

from __future__ import annotations

import argparse
import logging

import pytest

from lockstep.check.cli import add_check_parser, serve_args
from lockstep.cli_options import add_engine_arguments, engine_options_from_args
from lockstep.config import MODES, EngineConfig, canonical_mode
from lockstep.errors import ConfigError


def _deprecations(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]


def test_fast_is_taken_as_reference_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lockstep.config"):
        config = EngineConfig.from_options(mode="fast", device="cpu")
    assert config.mode == "reference"
    (line,) = _deprecations(caplog)
    assert "'fast'" in line and "'reference'" in line and "\n" not in line


def test_current_names_pass_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    assert MODES == ("deterministic", "reference")
    with caplog.at_level(logging.WARNING, logger="lockstep.config"):
        for mode in MODES:
            assert EngineConfig.from_options(mode=mode, device="cpu").mode == mode
            assert canonical_mode(mode) == mode
    assert _deprecations(caplog) == []


def test_the_dataclass_refuses_the_old_name_and_unknown_ones() -> None:
    with pytest.raises(
        ConfigError, match="mode='fast' is invalid: it is the old name of 'reference'"
    ):
        EngineConfig(mode="fast")
    with pytest.raises(
        ConfigError, match="mode='quick' is invalid: expected one of deterministic, reference"
    ):
        EngineConfig.from_options(mode="quick")


def test_the_command_line_takes_both_names(caplog: pytest.LogCaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    for given, want in (("reference", "reference"), ("fast", "reference")):
        args = parser.parse_args(["--mode", given, "--device", "cpu"])
        assert EngineConfig.from_options(**engine_options_from_args(args)).mode == want
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "quick"])
    # `lockstep check --serve` passes the current name on to the server it starts.
    check = argparse.ArgumentParser().add_subparsers()
    add_check_parser(check)
    parsed = check.choices["check"].parse_args(["--serve", "--mode", "fast"])
    assert serve_args(parsed)[:2] == ["--mode", "reference"]
