"""Build (on first use) and load the C++ CPU kernels in `lockstep/ops/csrc/`.

The extension is compiled with torch's JIT loader (ninja) into a cache folder keyed by the
source text, the compiler flags and this machine's CPU features: `-march=native` code built on
one CPU must never be loaded on another, so each CPU kind gets its own build.

The cache lives in `$LOCKSTEP_CACHE_DIR` (default `~/.cache/lockstep`)/torch_extensions.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).parent / "csrc"
SOURCES = ("lockstep_cpu.cpp",)

# -ffp-contract=off: the arithmetic is what the code says; the compiler must not fuse a*b+c.
# -fopenmp: at::parallel_for is a header template that only runs in parallel under OpenMP.
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-std=c++17")

_lock = threading.Lock()
_module: ModuleType | None = None


class KernelBuildError(RuntimeError):
    """The C++ CPU kernels could not be compiled or loaded."""


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


def cache_dir() -> Path:
    root = os.environ.get("LOCKSTEP_CACHE_DIR") or Path.home() / ".cache" / "lockstep"
    return Path(root) / "torch_extensions"


def load_extension() -> ModuleType:
    """Return the compiled kernel module, compiling it the first time on this machine."""
    global _module
    with _lock:
        if _module is not None:
            return _module
        compiler = os.environ.get("CXX", "c++")
        if shutil.which(compiler) is None:
            raise KernelBuildError(
                f"the deterministic CPU backend needs a C++ compiler: {compiler!r} was not found "
                "on PATH (install g++ >= 9, e.g. `apt-get install g++`, or set CXX); "
                "`--mode fast` runs without one"
            )
        if shutil.which("ninja") is None:
            raise KernelBuildError(
                "the deterministic CPU backend needs ninja to build its kernels: "
                "`pip install ninja`"
            )
        from torch.utils.cpp_extension import load

        ldflags = _ldflags()
        name = _build_name(ldflags)
        build_dir = cache_dir() / name
        build_dir.mkdir(parents=True, exist_ok=True)
        first = not (build_dir / f"{name}.so").exists()
        if first:
            logger.info("compiling the lockstep CPU kernels into %s (first use only)", build_dir)
        start = time.perf_counter()
        try:
            _module = load(
                name=name,
                sources=[str(CSRC_DIR / s) for s in SOURCES],
                extra_cflags=list(CFLAGS),
                extra_ldflags=ldflags,
                build_directory=str(build_dir),
                verbose=False,
            )
        except Exception as exc:  # the compiler's own message is in exc; keep it
            raise KernelBuildError(
                f"building the lockstep CPU kernels in {build_dir} failed: {exc}"
            ) from exc
        if first:
            logger.info("compiled the lockstep CPU kernels in %.1f s", time.perf_counter() - start)
        return _module
