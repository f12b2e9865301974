"""The CPU engine's threads: the cores a process may use (affinity, cgroup quota) and the
governor that keeps the thread count within the cores other processes leave idle
(lockstep/cpu_threads.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from lockstep.cpu_threads import (
    ThreadGovernor,
    cgroup_cpu_quota,
    read_core_ticks,
    read_own_ticks,
    set_engine_threads,
    usable_cores,
)

AFFINITY = len(os.sched_getaffinity(0))


def _v2(root: Path, path: str, cpu_max: dict[str, str]) -> Path:
    """A cgroup v2 tree under `root`: `cpu_max` maps folders (relative) to cpu.max lines."""
    for folder, line in cpu_max.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "cpu.max").write_text(line + "\n")
    proc = root / "proc-self-cgroup"
    proc.write_text(f"0::{path}\n")
    return proc


def test_v2_quota_of_the_process_cgroup(tmp_path: Path) -> None:
    proc = _v2(tmp_path, "/job", {"job": "50000 100000"})
    assert cgroup_cpu_quota(tmp_path, proc) == 0.5
    assert usable_cores(tmp_path, proc) == 1  # half a core still runs one thread


def test_v2_smallest_quota_on_the_way_up_wins(tmp_path: Path) -> None:
    proc = _v2(tmp_path, "/a/b", {"a": "150000 100000", "a/b": "max 100000", "": "max 100000"})
    assert cgroup_cpu_quota(tmp_path, proc) == 1.5
    assert usable_cores(tmp_path, proc) == min(AFFINITY, 2)  # rounded up, within the mask


def test_no_quota_leaves_the_affinity_mask(tmp_path: Path) -> None:
    proc = _v2(tmp_path, "/job", {"job": "max 100000"})
    assert cgroup_cpu_quota(tmp_path, proc) is None
    assert usable_cores(tmp_path, proc) == AFFINITY
    assert usable_cores(tmp_path / "absent", tmp_path / "absent-file") == AFFINITY


def test_v1_quota(tmp_path: Path) -> None:
    folder = tmp_path / "cpu,cpuacct" / "docker" / "c1"
    folder.mkdir(parents=True)
    (folder / "cpu.cfs_quota_us").write_text("100000\n")
    (folder / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text("4:memory:/docker/c1\n3:cpu,cpuacct:/docker/c1\n")
    assert cgroup_cpu_quota(tmp_path, proc) == 1.0
    (folder / "cpu.cfs_quota_us").write_text("-1\n")  # v1's "no quota"
    assert cgroup_cpu_quota(tmp_path, proc) is None


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Cores:
    """Fake tick counters for a 2-core machine: `run(seconds, others, own)` advances them by
    what other processes and this one kept busy, in cores (100 ticks a second a core)."""

    def __init__(self) -> None:
        self.busy = self.total = self.own = 0

    def run(self, seconds: float, others: float, own: float) -> None:
        self.busy += round((others + own) * 100 * seconds)
        self.total += round(2 * 100 * seconds)
        self.own += round(own * 100 * seconds)


def _governor(cores: _Cores, clock: _Clock, ceiling: int = 2) -> tuple[ThreadGovernor, list[int]]:
    calls: list[int] = []
    governor = ThreadGovernor(
        ceiling,
        cpus={0, 1},
        read_cores=lambda: (cores.busy, cores.total),
        read_own=lambda: cores.own,
        clock=clock,
        set_threads=calls.append,
    )
    return governor, calls


def test_governor_gives_a_core_other_processes_keep_busy_back_and_takes_it_again() -> None:
    cores, clock = _Cores(), _Clock()
    governor, calls = _governor(cores, clock)
    cores.run(0.5, others=0.0, own=2.0)  # quiet: this engine alone, both threads busy
    clock.now = 0.5
    governor.tick()
    assert governor.threads == 2 and calls == []
    cores.run(0.5, others=0.9, own=1.1)  # another process takes most of a core
    clock.now = 1.0
    governor.tick()
    assert governor.threads == 1 and calls == [1]
    assert abs(governor.others_busy - 0.9) < 0.02
    for interval in range(1, ThreadGovernor.RAISE_AFTER + 1):  # it stopped
        cores.run(0.5, others=0.1, own=1.0)
        clock.now = 1.0 + 0.5 * interval
        governor.tick()
        # Back only once the cores stayed idle RAISE_AFTER intervals in a row.
        assert governor.threads == (2 if interval == ThreadGovernor.RAISE_AFTER else 1)
    assert calls == [1, 2]


def test_governor_ignores_this_process_and_small_neighbours() -> None:
    # Control for the test above: the same busy ticks, but this process's own, keep both
    # threads; so does a neighbour using less than half a core.
    cores, clock = _Cores(), _Clock()
    governor, calls = _governor(cores, clock)
    cores.run(0.5, others=0.0, own=2.0)
    clock.now = 0.5
    governor.tick()
    cores.run(0.5, others=0.4, own=1.6)
    clock.now = 1.0
    governor.tick()
    assert governor.threads == 2 and calls == []


def test_governor_reads_at_most_every_interval_and_never_exceeds_its_ceiling() -> None:
    cores, clock = _Cores(), _Clock()
    governor, calls = _governor(cores, clock, ceiling=1)
    cores.run(0.2, others=1.0, own=1.0)
    clock.now = 0.2
    governor.tick()
    assert governor.others_busy == 0.0  # not read yet: under INTERVAL_S
    cores.run(0.4, others=0.0, own=1.0)
    clock.now = 0.6
    governor.tick()
    assert governor.threads == 1 and calls == []  # idle cores, but the engine chose one


def test_tick_counters_from_proc(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  30 0 30 500 10 0 0 5 0 0\n"
        "cpu0 10 0 10 200 5 0 0 0 0 0\n"
        "cpu1 20 0 20 300 5 0 0 5 0 0\n"
        "intr 1 2 3\n"
    )
    assert read_core_ticks({0, 1}, stat) == (65, 575)  # steal is busy, iowait idle
    assert read_core_ticks({1}, stat) == (45, 350)
    assert read_core_ticks({7}, stat) is None
    own = tmp_path / "self-stat"
    # A process name with spaces and parentheses; utime 123, stime 45 (fields 14 and 15).
    own.write_text("42 (a (b) c) R 1 1 1 0 -1 4194560 10 0 0 0 123 45 0 0 20 0 3 0 9\n")
    assert read_own_ticks(own) == 168


def test_this_process_is_counted_as_its_own_on_the_real_proc() -> None:
    # The identity the governor rests on, with the real /proc: this process's spinning is in
    # its own ticks (so never counted as another process's), and within the cores' busy ticks.
    cpus = os.sched_getaffinity(0)
    cores_before, own_before = read_core_ticks(cpus), read_own_ticks()
    start = time.process_time()
    while time.process_time() - start < 0.3:
        pass
    cores_after, own_after = read_core_ticks(cpus), read_own_ticks()
    assert cores_before is not None and cores_after is not None
    assert own_before is not None and own_after is not None
    own = own_after - own_before
    assert 20 <= own <= 60  # 0.3 s of one core at 100 ticks a second, within tick rounding
    assert cores_after[0] - cores_before[0] >= own - 2


def test_a_cpu_engine_governs_its_threads_only_where_none_were_given() -> None:
    assert set_engine_threads(None, "cuda") is None
    before = torch.get_num_threads()
    try:
        assert set_engine_threads(1, "cpu") is None
        assert torch.get_num_threads() == 1
        # One thread leaves nothing to govern; two usable threads get a governor.
        torch.set_num_threads(2)
        governor = set_engine_threads(None, "cpu")
        assert (governor is not None) == (min(2, usable_cores()) > 1)
    finally:
        torch.set_num_threads(before)
