"""The `lockstep` command: the README's main job, and one-line errors without tracebacks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest


def _lockstep(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lockstep", *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_generate_answers_paris_on_the_default_model() -> None:
    """The README's first command, and its KV pool sized to the one job (the prompt and
    --max-tokens, at least one prefill chunk), not to a share of the machine's memory."""
    out = _lockstep("generate", "What is the capital of France?", "--max-tokens", "300", "-v")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "The capital of France is Paris."
    kv_tokens = int(re.search(r"engine ready: .* kv_tokens=(\d+)", out.stderr).group(1))
    assert 300 < kv_tokens <= 512, out.stderr[-2000:]


def test_generate_raw_with_seed_is_reproducible() -> None:
    args = ("generate", "Once upon a time", "--raw", "--temperature", "1", "--seed", "3",
            "--max-tokens", "12", "--model", "random:tiny", "--kv-tokens", "256")  # fmt: skip
    first, second = _lockstep(*args), _lockstep(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    other = _lockstep(*args[:6], "4", *args[7:])  # another seed: another text (the control)
    assert other.returncode == 0 and other.stdout != first.stdout


def _one_line_error(out: subprocess.CompletedProcess, *needles: str) -> None:
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_model_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    _one_line_error(_lockstep("generate", "hi", "--model", str(missing)), str(missing))


def test_unknown_preset() -> None:
    _one_line_error(_lockstep("generate", "hi", "--model", "random:nope"), "random:nope", "tiny")


def test_folder_without_config(tmp_path: Path) -> None:
    _one_line_error(_lockstep("generate", "hi", "--model", str(tmp_path)), "config.json")


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    _one_line_error(_lockstep("generate", "hi", "--model", str(tmp_path)), "gpt2", "llama")


def test_missing_tokenizer(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    _one_line_error(_lockstep("generate", "hi", "--model", str(tmp_path)), "tokenizer.json")


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [("--max-running", "0", "max_running=0"), ("--chunk-size", "4096", "chunk_size=4096")],
)
def test_invalid_engine_option_is_one_line(flag: str, value: str, needle: str) -> None:
    _one_line_error(_lockstep("generate", "hi", "--model", "random:tiny", flag, value), needle)


def test_bench_decode_sampling_options_reach_the_json(tmp_path: Path) -> None:
    """--temperature/--top-p/--top-k are recorded in the JSON and its command line; filters
    without a temperature are one clear line (the control: the same run at temperature 1)."""
    import json

    out_file = tmp_path / "bench.json"
    args = ("bench", "decode", "--model", "random:tiny", "--device", "cpu", "--modes",
            "deterministic", "--batches", "2", "--prompt-len", "8", "--gen-len", "2",
            "--kv-tokens", "512")  # fmt: skip
    out = _lockstep(*args, "--temperature", "1", "--top-p", "0.9", "--top-k", "5",
                    "--output", str(out_file))  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads(out_file.read_text())
    assert doc["options"]["sampling"] == {"temperature": 1.0, "top_p": 0.9, "top_k": 5}
    assert "--temperature 1.0 --top-p 0.9 --top-k 5" in doc["command"]
    _one_line_error(_lockstep(*args, "--top-p", "0.9"), "--temperature", "top_p=0.9")


def test_bench_decode_says_what_the_reference_ratio_means(tmp_path: Path) -> None:
    """`--modes deterministic,fast` runs the reference mode under its old name (one deprecation
    line), and the ratio is printed and recorded with what it means: reference is the
    stock-PyTorch control, not a speed target, and the ratio is not the cost of determinism."""
    import json

    out_file = tmp_path / "bench.json"
    out = _lockstep("bench", "decode", "--model", "random:tiny", "--device", "cpu", "--modes",
                    "deterministic,fast", "--batches", "2", "--prompt-len", "8", "--gen-len",
                    "2", "--kv-tokens", "512", "--output", str(out_file))  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads(out_file.read_text())
    assert [r["mode"] for r in doc["results"]] == ["deterministic", "reference"]
    assert set(doc["det_over_reference_decode"]) == {"2"}
    meaning = doc["det_over_reference_meaning"]
    assert "not a speed target" in meaning and "not the cost of determinism" in meaning
    assert "batch 2: deterministic / reference decode throughput =" in out.stdout
    assert meaning in out.stdout
    (warning,) = [line for line in out.stderr.splitlines() if "deprecated" in line]
    assert "mode='fast' is deprecated: it is now named 'reference'" in warning


def _lockstep_without(module: str, *args: str) -> subprocess.CompletedProcess:
    """`lockstep ARGS` in a process where importing `module` fails, as on a broken install."""
    code = (
        f"import sys; sys.modules[{module!r}] = None; sys.argv[0] = 'lockstep'\n"
        f"from lockstep.cli import main; sys.exit(main({list(args)!r}))"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600)  # fmt: skip


def test_a_subcommand_missing_a_dependency_leaves_the_others_working() -> None:
    out = _lockstep_without("httpx", "generate", "hi", "--model", "random:tiny",
                            "--kv-tokens", "64", "--max-tokens", "2", "--raw")  # fmt: skip
    assert out.returncode == 0, out.stderr
    _one_line_error(_lockstep_without("httpx", "check", "--serve"), "lockstep check", "'httpx'")
    # The control: with httpx importable the same command line parses and runs past the import.
    help_out = _lockstep("check", "--help")
    assert help_out.returncode == 0 and "--serve" in help_out.stdout


def test_check_plot_without_matplotlib_says_what_to_install() -> None:
    out = _lockstep_without("matplotlib", "check", "--url", "http://127.0.0.1:9", "--plot",
                            "x.png")  # fmt: skip
    _one_line_error(out, "--plot", "lockstep-llm[plot]")


def test_every_module_but_the_kernels_imports_without_triton() -> None:
    """triton is the optional GPU dependency: a CPU install must import every other module
    (the backends defer theirs until asked for). The control: with triton blocked, a Triton
    kernel module does fail to import, so the block is real."""
    code = (
        "import importlib, pkgutil, sys\n"
        "sys.modules['triton'] = None\n"
        "import lockstep\n"
        "names = [m.name for m in pkgutil.walk_packages(lockstep.__path__, 'lockstep.')]\n"
        "skip = ('lockstep.ops.triton', 'lockstep.__main__')\n"
        "for name in names:\n"
        "    if not name.startswith(skip):\n"
        "        importlib.import_module(name)\n"
        "try:\n"
        "    importlib.import_module('lockstep.ops.triton.norm')\n"
        "except ImportError:\n"
        "    print('blocked')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "blocked"


def test_generate_says_what_it_loads_on_a_terminal_only(capsys: pytest.CaptureFixture) -> None:
    """On a terminal (a pseudo-terminal here) `generate` says what it loads and when it is
    ready; where stderr is not a terminal (the control, in-process) it says nothing."""
    import os
    import pty

    from lockstep import cli

    args = ["generate", "hi", "--raw", "--model", "random:tiny", "--max-tokens", "2",
            "--kv-tokens", "256"]  # fmt: skip
    leader, follower = pty.openpty()
    with subprocess.Popen([sys.executable, "-m", "lockstep", *args], stdout=subprocess.DEVNULL,
                          stderr=follower) as proc:  # fmt: skip
        os.close(follower)
        said = b""
        try:
            while chunk := os.read(leader, 4096):
                said += chunk
        except OSError:  # EIO: the process and its terminal are gone
            pass
        os.close(leader)
    assert proc.returncode == 0, said
    assert re.search(rb"Loading random:tiny \.\.\.\r\n(.*\r\n)*Loaded in \d+\.\d s\r\n", said), said
    assert cli.main(args) == 0
    assert capsys.readouterr().err == ""
