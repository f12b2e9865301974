"""Every `lockstep ...` command in the shell examples of README.md and docs/*.md parses, with its
flags, against the real command-line parser, and its engine options make a valid
configuration (the same checks `lockstep` runs before it loads anything); every `pip install`
names this project's distribution (with extras it has) or a package pyproject.toml or
constraints.txt names.

A command is a line of a fenced block tagged bash, sh or nothing (continuation lines joined),
cut at `&&`, `;`, `|` and `&`; leading `VAR=value` words are dropped and `$VAR` is replaced by
a value given earlier in the same block."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from lockstep.check.cli import serve_args
from lockstep.cli import build_parser
from lockstep.cli_options import engine_options_from_args
from lockstep.config import EngineConfig
from lockstep.errors import LockstepError

REPO = Path(__file__).resolve().parents[3]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SEPARATORS = {"&&", "||", ";", "|", "&"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def shell_blocks(text: str) -> list[str]:
    """The bodies of the fenced blocks tagged bash, sh or nothing."""
    blocks: list[str] = []
    language, body = None, []
    for line in text.splitlines():
        fence = re.match(r"\s*```(\w*)", line)
        if fence and language is None:
            language, body = fence.group(1), []
        elif fence:
            if language in ("bash", "sh", ""):
                blocks.append("\n".join(body) + "\n")
            language = None
        elif language is not None:
            body.append(line)
    return blocks


def commands(block: str) -> list[list[str]]:
    """Each command of a shell block, as the words a shell would pass to it."""
    found: list[list[str]] = []
    variables: dict[str, str] = {}
    for line in block.replace("\\\n", " ").splitlines():
        line = line.strip().removeprefix("$ ")
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        try:
            words = list(lexer)
        except ValueError:  # not shell (a layout sketch, an unbalanced quote in prose)
            continue
        segment: list[str] = []
        for word in [*words, ";"]:
            if word not in SEPARATORS:
                segment += shlex.split(variables[word[1:]]) if word[1:] in variables else [word]
                continue
            if len(segment) == 1 and ASSIGNMENT.match(segment[0]):
                name, value = segment[0].split("=", 1)
                variables[name] = value
            while segment and ASSIGNMENT.match(segment[0]):
                segment.pop(0)
            if segment:
                found.append(segment)
            segment = []
    return found


def lockstep_argv(words: list[str]) -> list[str] | None:
    """The arguments of a `lockstep` command (or `python -m lockstep`); None for others."""
    if words[0] == "lockstep":
        return words[1:]
    if words[:3] in (["python", "-m", "lockstep"], ["python3", "-m", "lockstep"]):
        return words[3:]
    return None


def examples() -> list[tuple[str, list[str]]]:
    return [
        (doc.name, argv)
        for doc in DOCS
        for block in shell_blocks(doc.read_text())
        for words in commands(block)
        if (argv := lockstep_argv(words)) is not None
    ]


def problem(argv: list[str]) -> str | None:
    """Why `lockstep argv` would be refused before it starts anything; None if it would not."""
    parser = build_parser()
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            args = parser.parse_args(argv)
    except SystemExit as e:
        if e.code == 0 and ("--version" in argv or "--help" in argv or "-h" in argv):
            return None
        return stderr.getvalue().strip().splitlines()[-1] if stderr.getvalue() else str(e)
    if args.command == "check":  # its engine options are the server's, with --serve
        return problem(["serve", *serve_args(args)]) if args.serve else None
    return engine_problem(args)


def engine_problem(args: argparse.Namespace) -> str | None:
    """The engine's refusals that need no model: the configuration's own validation, and a
    pool smaller than the context limit when both are given."""
    from lockstep.engine.engine import _check_pool_holds_a_context

    options = engine_options_from_args(args)
    if not options:
        return None
    try:
        config = EngineConfig.from_options(**options)
        if config.kv_tokens is not None and config.max_model_len is not None:
            _check_pool_holds_a_context(config, config.kv_tokens, config.max_model_len)
    except LockstepError as e:
        return str(e)
    return None


def test_the_extraction_finds_the_examples() -> None:
    found = examples()
    assert len(found) > 30
    block = 'M="--model random:tiny"\nX=1 lockstep bench decode $M \\\n    --batches 1 &  # c\n'
    assert commands(block) == [
        ["lockstep", "bench", "decode", "--model", "random:tiny", "--batches", "1"]
    ]


def test_every_lockstep_example_parses_and_configures() -> None:
    refused = [(doc, " ".join(argv), why) for doc, argv in examples() if (why := problem(argv))]
    assert refused == []


@pytest.mark.parametrize(
    "argv",
    [
        ["check", "--serve", "--kv-tokens", "400", "--max-model-len", "512"],  # the pool rule
        ["bench", "decode", "--batches", "1", "--no-such-flag"],  # an unknown flag
        ["serve", "--mode", "exact"],  # a value outside the choices
        ["generate", "hi", "--chunk-size", "0"],  # the configuration's validation
    ],
)
def test_control_a_refused_command_is_caught(argv: list[str]) -> None:
    assert problem(argv) is not None


def _known_packages() -> set[str]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    listed = list(project["dependencies"])
    listed += [r for extra in project["optional-dependencies"].values() for r in extra]
    listed += [
        line.split("#")[0].strip()
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if line.split("#")[0].strip()
    ]
    return {_normal(Requirement(r).name) for r in listed}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# A command ends at a shell operator, a parenthesis, a code span's end or a line's end; in
# Python sources also at a double quote (the end of the string that says it).
PIP_INSTALL = re.compile(r"pip install ([^`\n&;|()]*)")
PIP_INSTALL_PY = re.compile(r"pip install ([^`\n&;|()\"]*)")
VALUE_OPTIONS = {"-c", "--constraint", "-r", "--requirement", "-i", "--index-url",
                 "--extra-index-url", "-f", "--find-links", "-t", "--target"}  # fmt: skip


def pip_install_problems(
    text: str, name: str, extras: set[str], known: set[str], pattern: re.Pattern = PIP_INSTALL
) -> list[str]:
    """What is wrong with the `pip install` commands of `text`: a requirement on a package
    neither this distribution (`name`, with `extras`) nor one that pyproject.toml or
    constraints.txt names (`known`), an extra this project does not have, or a local path
    other than the checkout's root."""
    from packaging.requirements import InvalidRequirement, Requirement

    problems = []
    for match in pattern.finditer(text):
        try:
            words = shlex.split(match.group(1), comments=True)
        except ValueError:
            words = match.group(1).split()
        skip = False
        for word in words:
            if skip or word.startswith("-"):
                skip = word in VALUE_OPTIONS
                continue
            path = re.fullmatch(r"(\.[^\[]*)(?:\[([^\]]*)\])?", word)
            if path:
                wanted, where = set(filter(None, (path.group(2) or "").split(","))), path.group(1)
                if where not in (".", "./"):
                    problems.append(f"{word}: not the checkout's root")
            else:
                try:
                    requirement = Requirement(word)
                except InvalidRequirement:
                    problems.append(f"{word}: not a requirement")
                    continue
                wanted = set(requirement.extras)
                if _normal(requirement.name) != _normal(name):
                    if _normal(requirement.name) not in known:
                        problems.append(f"{word}: not {name} nor a package the project names")
                    continue
            problems += [f"{word}: {name} has no extra {e!r}" for e in wanted - extras]
    return problems


def test_every_pip_install_names_this_distribution_or_a_known_package() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    name, extras = project["name"], set(project["optional-dependencies"])
    known = _known_packages()
    sources = [*DOCS, *sorted((REPO / "lockstep").rglob("*.py"))]
    texts = {str(p.relative_to(REPO)): p.read_text() for p in sources}
    assert sum(len(PIP_INSTALL.findall(t)) for t in texts.values()) > 8
    found = {
        doc: pip_install_problems(
            text, name, extras, known, PIP_INSTALL_PY if doc.endswith(".py") else PIP_INSTALL
        )
        for doc, text in texts.items()
    }
    assert {doc: p for doc, p in found.items() if p} == {}


def test_control_the_pip_check_refuses_the_import_name() -> None:
    known = {"torch", "matplotlib"}
    extras = {"plot", "test"}
    check = lambda text: pip_install_problems(text, "lockstep-llm", extras, known)  # noqa: E731
    assert check("pip install lockstep") != []  # somebody else's project on the registry
    assert check("`pip install 'lockstep-llm[plots]'`") != []
    assert check('pip install -e ".[gpus]" -c constraints.txt') != []
    assert check("pip install -e ../elsewhere") != []
    assert check("pip install 'lockstep-llm[plot]' && pip install -e '.[test]' torch") == []


def test_the_readme_python_example_runs_in_under_1_gib() -> None:
    """The README's first Python example, as written, on the embedded default model: it
    answers, and its process peaks under 1 GiB of RSS although `LLM()` keeps its
    memory-sized pool (the control: that pool's bytes alone are over 2 GiB, so the bound
    holds because pages are used as slots are, lockstep/cache/kv_pool.py)."""
    import subprocess
    import sys

    example = re.search(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert example is not None and "LLM()" in example.group(1)
    # The peak of this process's own memory map (VmHWM): getrusage's ru_maxrss also counts
    # the forking parent's resident pages at the fork (Linux keeps it across exec), so a
    # large pytest worker would be measured instead of the example.
    probe = (
        "\npool = llm.engine.pool\n"
        "k = pool.k_cache(0)\n"
        "print('POOL', 2 * pool.num_layers * k.numel() * k.element_size())\n"
        "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
        "print('PEAK', int(hwm.split()[1]) * 1024)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", example.group(1) + probe],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in out.stdout
    figures = dict(line.split() for line in out.stdout.splitlines() if line[:4] in ("POOL", "PEAK"))
    assert int(figures["POOL"]) > 2 * 2**30
    assert int(figures["PEAK"]) < 2**30
