"""How many CPU threads the engine uses (docs/cpu_ops.md, "Threads").

torch's CPU build and Lockstep's kernels share one OpenMP runtime (libgomp). A decode step runs
hundreds of parallel regions, each ending at a barrier where every thread waits for the
slowest. When another process holds one of the cores, one thread of each region waits for a
time slice while its partners spin (OpenMP's threads spin for 300,000 iterations before they
sleep), and the step takes tens of times longer than on one thread. Two rules keep that away
without slowing a quiet machine:

* **No more threads than usable cores:** the process's CPU affinity and, where the container or
  cgroup has one, its CPU quota (`cpu.max`, `cpu.cfs_quota_us`), which torch's own default
  (every core of the affinity mask) ignores.
* **No more threads than idle cores** (`ThreadGovernor`): while a CPU engine runs, every half
  second it reads how busy the usable cores were (`/proc/stat`) less this process's own time
  (`/proc/self/stat`), and gives torch one thread fewer for each core other processes kept
  busy, and the threads back when they stop. OpenMP's spinning is left as it is: it is the
  fastest wait on cores nobody else wants, and on a core somebody wants there is no thread.

Results do not depend on the thread count; only speed does.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Collection
from pathlib import Path

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
PROC_STAT = Path("/proc/stat")
PROC_SELF_STAT = Path("/proc/self/stat")


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


def set_engine_threads(num_threads: int | None, device: str) -> ThreadGovernor | None:
    """torch's threads for an engine: `num_threads` where given; on the CPU otherwise, torch's
    current count lowered to `usable_cores()` (never raised: a caller that chose fewer keeps
    them), and a `ThreadGovernor` that keeps it within the idle cores while the engine runs
    (None where the count was given, or on a GPU)."""
    import torch

    if num_threads is not None:
        torch.set_num_threads(num_threads)
        return None
    if device != "cpu":
        return None
    cores = usable_cores()
    if torch.get_num_threads() > cores:
        torch.set_num_threads(cores)
    return ThreadGovernor.start(torch.get_num_threads())


def read_core_ticks(cpus: Collection[int], stat: Path = PROC_STAT) -> tuple[int, int] | None:
    """(busy, all) clock ticks the cores `cpus` spent since boot, from `/proc/stat`; busy is
    every state but idle and iowait (steal counts: the hypervisor gave the core to somebody
    else). None where the file cannot be read or names none of them."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    busy = total = 0
    found = False
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        ticks = [int(x) for x in rest.split()[:8]]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
        busy += sum(ticks) - idle
        total += sum(ticks)
        found = True
    return (busy, total) if found else None


def read_own_ticks(stat: Path = PROC_SELF_STAT) -> int | None:
    """Clock ticks this process (all its threads) has run, user and system, from
    `/proc/self/stat`; None where it cannot be read."""
    try:
        text = stat.read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
    return int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of the line


class ThreadGovernor:
    """Keeps torch's thread count within the cores other processes leave idle, between
    `ceiling` (the count the engine started with) and 1. `tick()` is called before each engine
    step; at most every `INTERVAL_S` it compares the usable cores' busy ticks with this
    process's own: the difference, in cores, is what other processes took, and each core they
    mostly kept busy (half or more) costs one thread at once; a thread comes back once the
    cores stayed idle for `RAISE_AFTER` intervals in a row. Speed only: results do not depend
    on the thread count."""

    INTERVAL_S = 0.5
    RAISE_AFTER = 3

    def __init__(
        self,
        ceiling: int,
        cpus: Collection[int],
        read_cores: Callable[[], tuple[int, int] | None],
        read_own: Callable[[], int | None],
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] | None = None,
    ) -> None:
        import torch

        self.ceiling = ceiling
        self.cpus = len(cpus)
        self._read_cores = read_cores
        self._read_own = read_own
        self._clock = clock
        self._set_threads = set_threads or torch.set_num_threads
        self.threads = ceiling
        self.others_busy = 0.0  # cores other processes kept busy over the last interval
        self._idle_intervals = 0  # intervals in a row that left more cores idle than used
        self._last = self._sample()

    @classmethod
    def start(cls, ceiling: int) -> ThreadGovernor | None:
        """A governor for this process's usable cores, or None where one thread is all it has
        or `/proc` cannot tell (macOS, Windows)."""
        if ceiling <= 1 or not hasattr(os, "sched_getaffinity"):
            return None
        cpus = frozenset(os.sched_getaffinity(0))
        if read_core_ticks(cpus) is None or read_own_ticks() is None:
            return None
        return cls(ceiling, cpus, lambda: read_core_ticks(cpus), read_own_ticks)

    def _sample(self) -> tuple[float, tuple[int, int] | None, int | None]:
        return self._clock(), self._read_cores(), self._read_own()

    def tick(self) -> None:
        """Re-read the cores' use if `INTERVAL_S` has passed, and set the thread count."""
        now = self._clock()
        if now - self._last[0] < self.INTERVAL_S:
            return
        sample = self._sample()
        (_, cores_before, own_before), (_, cores_now, own_now) = self._last, sample
        self._last = sample
        if None in (cores_before, cores_now, own_before, own_now):
            return
        busy = cores_now[0] - cores_before[0]
        ticks = cores_now[1] - cores_before[1]
        if ticks <= 0:
            return
        # All ticks of the usable cores cover `cpus` cores over the interval: busy / ticks
        # of them were busy, and this process's own ticks were part of that.
        own = max(0, own_now - own_before)
        self.others_busy = max(0.0, (busy - own) / ticks * self.cpus)
        idle = self.cpus - math.floor(self.others_busy + 0.5)
        threads = max(1, min(self.ceiling, idle))
        # A thread too many costs tens of times a step, one too few about 1.3x: fewer at once,
        # more only once the cores stayed idle for RAISE_AFTER intervals in a row.
        self._idle_intervals = self._idle_intervals + 1 if threads > self.threads else 0
        if threads > self.threads and self._idle_intervals < self.RAISE_AFTER:
            return
        if threads != self.threads:
            logger.info(
                "other processes keep %.1f of %d cores busy: %d CPU threads (of %d)",
                self.others_busy,
                self.cpus,
                threads,
                self.ceiling,
            )
            self._set_threads(threads)
            self.threads = threads
