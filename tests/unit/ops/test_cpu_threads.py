"""The CPU engine's threads: the cores a process may use (affinity, cgroup quota) and the
OpenMP spin count set before torch loads its runtime (lockstep/cpu_threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lockstep.cpu_threads import SPIN_COUNT, cgroup_cpu_quota, usable_cores

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


def _spin_count(code: str, **env: str) -> str:
    """GOMP_SPINCOUNT as the OpenMP runtime torch loads reports it (OMP_DISPLAY_ENV)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", code],
        # One thread: the child's import must not wait on spinning partners of its own.
        env={**clean, "OMP_DISPLAY_ENV": "verbose", "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    line = next(x for x in out.stderr.splitlines() if "GOMP_SPINCOUNT" in x)
    return line.split("=")[1].strip().strip("'")


def test_threads_soon_sleep_when_lockstep_is_imported_first() -> None:
    # The `lockstep` command's entry; `from lockstep import LLM` runs the same package init.
    assert _spin_count("import lockstep.cli; import torch") == str(SPIN_COUNT)


def test_control_torch_first_keeps_spinning_threads() -> None:
    # The runtime read its environment when torch loaded it: too late for the policy, which
    # is why lockstep/__init__.py sets it before any Lockstep module imports torch.
    assert _spin_count("import torch; import lockstep") == "300000"


def test_a_policy_the_user_chose_is_kept() -> None:
    assert _spin_count("import lockstep; import torch", OMP_WAIT_POLICY="PASSIVE") == "0"
