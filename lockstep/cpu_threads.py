"""How many CPU threads the engine uses, and how they wait (docs/cpu_ops.md, "Threads").

Two things keep the CPU engine from collapsing when another process holds a core:

* **Idle OpenMP threads that soon sleep.** torch's CPU build and Lockstep's kernels share one
  OpenMP runtime (libgomp), whose threads by default spin for 300,000 iterations at the end of
  every parallel region before they sleep. A decode step runs hundreds of regions; when one
  thread waits for a time slice behind another process, its partners spin through theirs and
  the step takes tens of times longer. `GOMP_SPINCOUNT=1000` lets a thread spin briefly (a
  quiet machine keeps the speed of spinning, the next region usually comes within it) and
  then sleep. The runtime reads it once, when torch loads it, so `lockstep/__init__.py` sets
  it (unless the user chose a policy) before anything in Lockstep imports torch.
* **A thread count no larger than the cores this process may use:** its CPU affinity and,
  where the container or cgroup has one, its CPU quota (`cpu.max`, `cpu.cfs_quota_us`), which
  torch's own default (every core of the affinity mask) ignores.

Results do not depend on the thread count or the spin count; only speed does.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")

# Whether the spin count was in the environment before torch loaded its OpenMP runtime:
# set by `prefer_yielding_openmp`, read when a CPU engine starts; the warning is said once.
_policy_in_time = False
_warned = False


# Spins before an idle OpenMP thread sleeps: about as fast as OpenMP's default (300,000) on a
# quiet machine, and within 1.5x of one thread with a core kept busy, where 10,000 is not
# (docs/results.md, "Decode with a core kept busy").
SPIN_COUNT = 1000


def prefer_yielding_openmp() -> None:
    """Ask idle OpenMP threads to sleep soon: set `GOMP_SPINCOUNT=SPIN_COUNT` unless the user
    chose a policy or a spin count (`OMP_WAIT_POLICY`, `GOMP_SPINCOUNT`). It takes effect only
    if torch is not imported yet; child processes (the server's engine, the tensor-parallel
    workers) inherit it either way."""
    global _policy_in_time
    chosen = "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ
    if not chosen:
        os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    _policy_in_time = chosen or "torch" not in sys.modules


def usable_cores(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """The cores this process may keep busy: its affinity mask, bounded by the CPU quota of
    its cgroup or of any cgroup above it (rounded up: a quota of 1.5 cores is 2 threads)."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:  # pragma: no cover (macOS, Windows)
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, proc_cgroup)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def cgroup_cpu_quota(
    cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP
) -> float | None:
    """The smallest CPU quota, in cores, on this process's cgroup and its ancestors (cgroup v2
    `cpu.max`, or v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`); None where none is set or
    none can be read. Inside a container the cgroup file often names a path the container
    cannot see; the mount's own root (the container's cgroup) is read then."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    quotas: list[float] = []
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "":  # cgroup v2: one unified hierarchy
            quotas += _quotas_up(cgroup_root, path, _v2_quota)
        elif "cpu" in controllers.split(","):
            mount = cgroup_root / controllers
            if not mount.is_dir():
                mount = cgroup_root / "cpu"
            quotas += _quotas_up(mount, path, _v1_quota)
    if not lines:
        quotas += [q for q in (_v2_quota(cgroup_root),) if q is not None]
    return min(quotas, default=None)


def _quotas_up(mount: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """The quotas found from `mount`/`path` up to `mount` itself."""
    found: list[float] = []
    folder = mount / path.lstrip("/")
    seen: set[Path] = set()
    while True:
        if folder not in seen:
            seen.add(folder)
            quota = read(folder)
            if quota is not None:
                found.append(quota)
        if folder == mount or mount not in folder.parents:
            break
        folder = folder.parent
    return found


def _v2_quota(folder: Path) -> float | None:
    try:
        words = (folder / "cpu.max").read_text().split()
    except OSError:
        return None
    if len(words) != 2 or words[0] == "max":
        return None
    try:
        quota, period = int(words[0]), int(words[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def set_engine_threads(num_threads: int | None, device: str) -> None:
    """torch's threads for an engine: `num_threads` where given; on the CPU otherwise, torch's
    current count lowered to `usable_cores()` (never raised: a caller that chose fewer keeps
    them). Warns once where torch loaded OpenMP before the spin count was set."""
    import torch

    if num_threads is not None:
        torch.set_num_threads(num_threads)
    elif device == "cpu":
        cores = usable_cores()
        if torch.get_num_threads() > cores:
            torch.set_num_threads(cores)
    global _warned
    if device == "cpu" and torch.get_num_threads() > 1 and not (_policy_in_time or _warned):
        _warned = True
        logger.warning(
            "torch was imported before lockstep, so its OpenMP threads spin while idle: a "
            "busy core can slow each step many times over; import lockstep first, set "
            f'GOMP_SPINCOUNT={SPIN_COUNT}, or pass num_threads=1 (docs/cpu_ops.md, "Threads")'
        )
