"""`lockstep bench speculative`: its JSON line holds each prompt's acceptance and timings and
says the outputs were identical (exit 0); in reference mode, where a verify row does not get a
decode row's bits, the same comparison fails (exit 1: the negative control)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lockstep.cli import main

PROMPTS = [
    {"name": "copy", "user": "Repeat exactly: red, green, blue, red, green, blue, red, green."},
    {"name": "raw", "prompt": "a b c d e f a b c d e f a b c"},
]


@pytest.mark.parametrize(("mode", "code"), [("deterministic", 0), ("reference", 1)])
def test_bench_speculative_compares_outputs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str, code: int
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    argv = ["bench", "speculative", "--prompts-file", str(prompts), "--max-tokens", "16",
            "--repeats", "1", "--device", "cpu", "--mode", mode]  # fmt: skip
    assert main(argv) == code
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["identical"] is (code == 0)
    assert [r["name"] for r in doc["results"]] == ["copy", "raw"]
    assert all(r["generated_tokens"] > 0 for r in doc["results"])
    assert any(r["acceptance_rate"] > 0 for r in doc["results"])
    assert doc["command"].startswith("lockstep bench speculative --prompts-file ")


class _Built(Exception):
    pass


@pytest.mark.parametrize("extra", [[], ["--kv-tokens", "4096"]])
def test_the_two_engines_share_the_memory(monkeypatch, tmp_path: Path, extra: list[str]) -> None:
    """Without --kv-tokens, the plain engine takes half its default share of the memory left,
    so the speculating engine built after it finds room (on an 80 GB GPU the first engine's
    default share left the second no KV pool); with --kv-tokens both take that size."""
    import lockstep.engine.engine as engine_module

    configs = []

    def record(config):
        configs.append(config)
        if len(configs) == 2:
            raise _Built

    monkeypatch.setattr(engine_module, "Engine", record)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(PROMPTS[1]) + "\n")
    with pytest.raises(_Built):
        main(["bench", "speculative", "--prompts-file", str(prompts), "--device", "cpu", *extra])
    plain, speculating = configs
    assert plain.speculative is None and speculating.speculative == "ngram"
    assert speculating.kv_memory_fraction is None
    if extra:
        assert plain.kv_tokens == speculating.kv_tokens == 4096
        assert plain.kv_memory_fraction is None
    else:
        assert plain.kv_memory_fraction == 0.5 * speculating.resolved_kv_memory_fraction
