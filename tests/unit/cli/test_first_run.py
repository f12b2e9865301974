"""A first run killed at any moment of its kernel build leaves nothing that blocks the next run.

The C++ CPU kernels are compiled on first use (lockstep/ops/cpu_build.py). torch's JIT loader
guards a build folder with a plain `lock` file that a killed build leaves behind, and every
later `load()` of that folder then waits for it forever, silently: the negative control below
shows that. Lockstep builds under an OS file lock instead, in a private folder per process.

The main test costs one real compile (about a minute on a 2-core machine) in a fresh
LOCKSTEP_CACHE_DIR: four `lockstep generate` runs are started one after another, each while
the previous one builds, so each waits on a live builder, says on whom, and takes the build
over when that builder is killed by SIGINT (Ctrl-C, to its process group), SIGKILL (the
Python process alone: its compiler lives on, orphaned) or SIGTERM (a supervisor, `timeout`).
The last one is left alone and must answer. Timeouts only guard against hangs. Where the
first build ends before the run started beside it reaches the lock (a loaded machine), the
first pair is started again in a fresh cache.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PROMPT = "What is the capital of France?"
HANG_GUARD_S = 600  # far beyond a compile on a slow machine; only a hang reaches it


@dataclass
class Run:
    """A `lockstep generate` process in a session of its own, its output in files."""

    proc: subprocess.Popen
    out: Path
    err: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")


def _env(cache: Path) -> dict[str, str]:
    return dict(os.environ, LOCKSTEP_CACHE_DIR=str(cache), PYTHONPATH=str(REPO))


def _start(cache: Path, name: str) -> Run:
    out, err = cache.parent / f"{name}.out", cache.parent / f"{name}.err"
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lockstep", "generate", PROMPT, "--max-tokens", "8"],
            cwd=REPO, env=_env(cache), stdout=o, stderr=e, start_new_session=True,
        )  # fmt: skip
    return Run(proc, out, err)


def _session_pids(sid: int) -> list[int]:
    """Every live process of session `sid` (a killed run's orphaned ninja and compiler)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # Fields after the command (which may hold spaces) start after the last ')'.
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def _end_session(run: Run) -> None:
    """Kill what is left of a run's session, by pid, and reap the run."""
    for pid in _session_pids(run.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        run.proc.wait(30)
    except subprocess.TimeoutExpired:
        pass


def _wait_until(what: str, ready: Callable[[], bool], runs: list[Run]) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not ready():
        for run in runs:
            if run.proc.poll() is not None:
                raise AssertionError(
                    f"{what}: process {run.pid} exited with {run.proc.returncode}:\n"
                    + run.stderr()[-3000:]
                )
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {HANG_GUARD_S} s")
        time.sleep(0.05)


def _build_folder(cache: Path, run: Run) -> Path | None:
    found = list((cache / "cpu_kernels").glob(f"*.build-{run.pid}"))
    return found[0] if found else None


def _compiling(cache: Path, run: Run) -> bool:
    """Whether `run` holds the build lock and has started ninja in its private folder."""
    folder = _build_folder(cache, run)
    return folder is not None and (folder / "build.ninja").exists()


def _waits_on(waiter: Run, holder: Run) -> bool:
    return f"waiting for process {holder.pid}'s build" in waiter.stderr()


@pytest.fixture
def runs() -> Iterator[list[Run]]:
    started: list[Run] = []
    yield started
    for run in started:
        _end_session(run)


def _pair(cache: Path, tag: str, runs: list[Run]) -> tuple[Run, Run] | None:
    """Two runs started together in `cache`: (the one that compiles, the one that waits on
    it), once the waiter names the builder while the build still runs; None where the build
    ended first (the pair is ended)."""
    pair = [_start(cache, f"first{tag}"), _start(cache, f"second{tag}")]
    runs += pair
    _wait_until("a first run compiles", lambda: any(_compiling(cache, r) for r in pair), pair)
    builder, waiter = pair if _compiling(cache, pair[0]) else pair[::-1]
    _wait_until("the second waits on it, or the build ends",
                lambda: _waits_on(waiter, builder) or not _compiling(cache, builder),
                pair)  # fmt: skip
    if _waits_on(waiter, builder) and _compiling(cache, builder):
        return builder, waiter
    for run in pair:
        _end_session(run)
    return None


def _builder_and_waiter(tmp_path: Path, runs: list[Run]) -> tuple[Path, Run, Run]:
    """A builder caught mid-build with a run waiting on it, in a fresh cache. On a loaded
    machine the second run can reach the lock only after the build ended (its imports took
    longer than the compile): then the pair is started again in another cache, at most three
    times."""
    for attempt in range(3):
        cache = tmp_path / f"cache{attempt}"
        found = _pair(cache, str(attempt), runs)
        if found is not None:
            return cache, *found
    raise AssertionError("three builds ended before the run started beside them reached the lock")


@pytest.mark.slow  # one real compile of the CPU kernels
def test_killed_first_runs_never_block_the_next(tmp_path: Path, runs: list[Run]) -> None:
    # Ctrl-C while building; the other run was already waiting and names the builder.
    cache, ctrl_c, sigkill = _builder_and_waiter(tmp_path, runs)
    kernels = cache / "cpu_kernels"
    assert re.search(r"\(started \d\d:\d\d:\d\d UTC, \d+ s ago\)", sigkill.stderr())
    os.killpg(ctrl_c.pid, signal.SIGINT)
    assert ctrl_c.proc.wait(60) == 130, ctrl_c.stderr()[-3000:]
    _end_session(ctrl_c)

    # The waiter takes the build over; SIGKILL it (its compiler lives on, orphaned).
    sigterm = _start(cache, "sigterm")
    runs.append(sigterm)
    _wait_until("the second takes over", lambda: _compiling(cache, sigkill), [sigkill, sigterm])
    _wait_until("the third waits on it", lambda: _waits_on(sigterm, sigkill), [sigkill, sigterm])
    sigkill.proc.send_signal(signal.SIGKILL)
    sigkill.proc.wait(30)

    # The third takes over; SIGTERM it: it dies without cleaning up, leaving torch's lock file.
    normal = _start(cache, "normal")
    runs.append(normal)
    _wait_until("the third takes over", lambda: _compiling(cache, sigterm), [sigterm, normal])
    _wait_until("the normal run waits", lambda: _waits_on(normal, sigterm), [sigterm, normal])
    torch_lock = _build_folder(cache, sigterm) / "lock"
    assert torch_lock.exists(), "the SIGTERM should land while torch's baton is held"
    sigterm.proc.send_signal(signal.SIGTERM)
    sigterm.proc.wait(30)
    assert torch_lock.exists(), "a killed build leaves torch's lock file (what hung old runs)"
    assert not list(kernels.glob("*.so")), "every kill landed before a build finished"
    for run in (sigkill, sigterm):
        _end_session(run)

    # The run nobody kills builds and answers.
    try:
        assert normal.proc.wait(HANG_GUARD_S) == 0, normal.stderr()[-3000:]
    except subprocess.TimeoutExpired:
        raise AssertionError("the run after the kills hangs:\n" + normal.stderr()[-3000:]) from None
    assert "Paris" in normal.out.read_text()
    assert "compiling Lockstep's CPU kernels" in normal.stderr()
    assert len(list(kernels.glob("*.so"))) == 1
    assert not list(kernels.glob("*.build-*")), "the builder removes the killed runs' folders"


TINY_EXTENSION = """
#include <Python.h>
static struct PyModuleDef tiny = {PyModuleDef_HEAD_INIT, "tiny_ext", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_tiny_ext(void) { return PyModule_Create(&tiny); }
"""

TORCH_LOAD = """
import sys
from torch.utils.cpp_extension import load
load(name="tiny_ext", sources=[sys.argv[1]], build_directory=sys.argv[2])
"""


def test_control_torch_load_waits_forever_on_a_stale_lock(tmp_path: Path) -> None:
    """The mechanism Lockstep no longer uses: torch's `load()` on a folder where a killed
    build left `lock` waits as long as that file exists, and goes on once it is removed."""
    source, build = tmp_path / "tiny.cpp", tmp_path / "build"
    source.write_text(TINY_EXTENSION)
    build.mkdir()
    stale = build / "lock"
    stale.touch()
    proc = subprocess.Popen(
        [sys.executable, "-c", TORCH_LOAD, str(source), str(build)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(8)
        assert not (build / "build.ninja").exists(), "it never started building"
        stale.unlink()
        # torch polls the file every 0.1 s; without it, it goes on (to import a module that
        # was never built, since the build belonged to the "other" process).
        proc.wait(60)
    finally:
        proc.kill()
        proc.wait()


def test_unwritable_cache_is_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    """A HOME where the cache cannot be made (read-only, full, or a file in the way, which
    stops root too): one line naming the folder and LOCKSTEP_CACHE_DIR, exit 2."""
    from lockstep import cli
    from lockstep.ops import cpu_build

    (tmp_path / ".cache").write_text("a file where the cache folder would go")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("LOCKSTEP_CACHE_DIR", raising=False)
    monkeypatch.setattr(cpu_build, "_module", None)
    assert cli.main(["generate", PROMPT, "--max-tokens", "1", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"{tmp_path}/.cache/lockstep/cpu_kernels is not writable" in err
    assert "LOCKSTEP_CACHE_DIR" in err
