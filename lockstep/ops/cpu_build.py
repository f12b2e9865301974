"""Build (on first use) and load the C++ CPU kernels in `lockstep/ops/csrc/`.

The extension is compiled with torch's JIT loader (ninja) and kept in a cache folder under a
name keyed by the source text, the compiler flags and this machine's CPU features:
`-march=native` code built on one CPU must never be loaded on another, so each CPU kind gets
its own build. The cache is `$LOCKSTEP_CACHE_DIR/cpu_kernels` (default
`~/.cache/lockstep/cpu_kernels`):

    cpu_kernels/
      <name>.so            the finished build; appears by an atomic rename, never half-written
      <name>.lock          an OS file lock (flock) held by the one process building <name>;
                           its text says which process and since when
      <name>.build-<pid>   that process's private ninja folder, removed when it finishes

A process killed at any moment leaves nothing that blocks or corrupts the next run: the kernel
releases a dead process's flock, the next builder deletes every leftover build folder (it holds
the lock, so no one else is building), and a reader only ever sees a complete `<name>.so`.
torch's own lock file (`lock` in the build folder, which a killed build leaves behind and
which makes every later `load()` of that folder wait forever) lives and dies in the private
folder.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import IO

from lockstep.errors import LockstepError

logger = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).parent / "csrc"
SOURCES = ("lockstep_cpu.cpp",)

# -ffp-contract=off: the arithmetic is what the code says; the compiler must not fuse a*b+c.
# -fopenmp: at::parallel_for is a header template that only runs in parallel under OpenMP.
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-std=c++17")

# How often a long build or a long wait says it is still alive.
PROGRESS_EVERY_S = 15.0
# How often a waiter polls the build lock (polling, not a blocking flock, so it can report).
POLL_S = 0.2

_lock = threading.Lock()
_module: ModuleType | None = None


class KernelBuildError(LockstepError, RuntimeError):
    """The C++ CPU kernels could not be compiled or loaded (the message is for the user)."""


def _cpu_signature() -> str:
    """A short digest of the CPU model and feature flags (the code is built for this CPU)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return hashlib.sha256(platform.processor().encode()).hexdigest()[:10]
    keep = [
        line
        for line in text.splitlines()
        if line.startswith(("flags", "model name", "vendor_id", "cpu family", "model\t"))
    ]
    return hashlib.sha256("\n".join(sorted(set(keep))).encode()).hexdigest()[:10]


def _ldflags() -> list[str]:
    """Link the OpenMP runtime torch itself ships, so that there is one runtime in the process
    (one thread pool, and torch.set_num_threads governs these kernels too); fall back to the
    compiler's own when torch ships none (it then uses the system one, as we do)."""
    import torch

    lib = Path(torch.__file__).parent / "lib"
    for pattern in ("libgomp*.so*", "libiomp5*.so*"):
        found = sorted(lib.glob(pattern))
        if found:
            return [f"-L{lib}", f"-Wl,-rpath,{lib}", f"-l:{found[0].name}"]
    return ["-fopenmp"]


def _build_name(ldflags: list[str]) -> str:
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((CSRC_DIR / name).read_bytes())
    digest.update(" ".join(CFLAGS + tuple(ldflags)).encode())
    return f"lockstep_cpu_{digest.hexdigest()[:10]}_{_cpu_signature()}"


def cache_root() -> Path:
    """Lockstep's cache folder: `$LOCKSTEP_CACHE_DIR`, else `~/.cache/lockstep`."""
    root = os.environ.get("LOCKSTEP_CACHE_DIR") or Path.home() / ".cache" / "lockstep"
    return Path(root).expanduser()


def cache_dir() -> Path:
    """Where the compiled kernels live (see the module docstring for the layout)."""
    return cache_root() / "cpu_kernels"


def _unwritable(path: Path, exc: OSError) -> KernelBuildError:
    return KernelBuildError(
        f"Lockstep's kernel cache {path} is not writable ({exc.strerror or exc}): set "
        "LOCKSTEP_CACHE_DIR to a writable folder with a few MB free, or run with --mode reference"
    )


@contextmanager
def _build_lock(path: Path, what: str) -> Iterator[None]:
    """Hold an exclusive flock on `path` for the block. The kernel drops the lock when its
    holder exits, however it exits, so a killed holder never blocks anyone. While another
    process holds it, say whose it is and since when, then every PROGRESS_EVERY_S."""
    try:
        handle: IO[str] = open(path, "a+")  # noqa: SIM115 (closed in finally)
    except OSError as exc:
        raise _unwritable(path.parent, exc) from exc
    try:
        last_report = 0.0
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now - last_report >= PROGRESS_EVERY_S:
                    still = "still " if last_report else ""
                    last_report = now
                    logger.info("%swaiting for %s", still, _holder(path, what))
                time.sleep(POLL_S)
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()} {time.time():.3f}\n")
        handle.flush()
        yield
    finally:
        handle.close()  # releases the flock


def _holder(path: Path, what: str) -> str:
    """'process 1234's build of X (started 07:52:10 UTC, 12 s ago)', from the lock's text."""
    try:
        pid, started = path.read_text().split()[:2]
        start = float(started)
    except (OSError, ValueError):
        return f"another process's {what} (lock {path})"
    stamp = time.strftime("%H:%M:%S UTC", time.gmtime(start))
    return f"process {pid}'s {what} (started {stamp}, {max(0.0, time.time() - start):.0f} s ago)"


@contextmanager
def _progress(message: str) -> Iterator[None]:
    """Log `message ... (N s)` every PROGRESS_EVERY_S until the block ends."""
    done = threading.Event()
    start = time.monotonic()

    def report() -> None:
        while not done.wait(PROGRESS_EVERY_S):
            logger.info("%s (%.0f s)", message, time.monotonic() - start)

    thread = threading.Thread(target=report, name="lockstep-build-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise KernelBuildError(f"cannot load the CPU kernels from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(name: str, directory: Path, ldflags: list[str]) -> ModuleType:
    """Compile into a private folder and rename the result into place; call with the build
    lock held. Leftover folders from killed builds are deleted first."""
    from torch.utils.cpp_extension import load

    for stale in directory.glob(f"{name}.build-*"):
        shutil.rmtree(stale, ignore_errors=True)  # an orphaned compiler may still write there
    build_dir = directory / f"{name}.build-{os.getpid()}"
    try:
        build_dir.mkdir()
    except OSError as exc:
        raise _unwritable(directory, exc) from exc
    logger.info("compiling Lockstep's CPU kernels into %s (first run only, about a minute)",
                directory)  # fmt: skip
    start = time.monotonic()
    try:
        with _progress("still compiling Lockstep's CPU kernels"):
            module = load(
                name=name,
                sources=[str(CSRC_DIR / s) for s in SOURCES],
                extra_cflags=list(CFLAGS),
                extra_ldflags=ldflags,
                build_directory=str(build_dir),
                verbose=False,
            )
        os.replace(build_dir / f"{name}.so", directory / f"{name}.so")
    except OSError as exc:
        raise _unwritable(directory, exc) from exc
    except Exception as exc:  # the compiler's own message is in exc; keep it
        if "interrupted by user" in str(exc):  # ninja saw the Ctrl-C first: it is the Ctrl-C
            raise KeyboardInterrupt from exc
        raise KernelBuildError(f"building Lockstep's CPU kernels failed: {exc}") from exc
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    logger.info("compiled Lockstep's CPU kernels in %.0f s", time.monotonic() - start)
    return module


def load_extension() -> ModuleType:
    """Return the compiled kernel module, compiling it the first time on this machine.

    Safe across processes: one builds while the others wait (and say on whom), and a process
    killed while building leaves nothing behind that blocks or corrupts the next one. Raises
    KernelBuildError, in one line, for a missing compiler or ninja or an unwritable cache."""
    global _module
    with _lock:
        if _module is not None:
            return _module
        compiler = os.environ.get("CXX", "c++")
        if shutil.which(compiler) is None:
            raise KernelBuildError(
                f"the deterministic CPU backend needs a C++ compiler: {compiler!r} was not found "
                "on PATH (install g++ >= 9, e.g. `apt-get install g++`, or set CXX); "
                "`--mode reference` runs without one"
            )
        if shutil.which("ninja") is None:
            raise KernelBuildError(
                "the deterministic CPU backend needs ninja to build its kernels: "
                "`pip install ninja`"
            )
        ldflags = _ldflags()
        name = _build_name(ldflags)
        directory = cache_dir()
        built = directory / f"{name}.so"
        if not built.exists():
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise _unwritable(directory, exc) from exc
            with _build_lock(directory / f"{name}.lock", "build of Lockstep's CPU kernels"):
                if not built.exists():  # the process we waited for may have built it
                    _module = _build(name, directory, ldflags)
                    return _module
        _module = _import(name, built)
        return _module
