"""Kernels of a profiled CUDA run and each one's share of its critical path.

With programmatic dependent launch a kernel starts (and waits) before the one ahead of it
ends, so kernel durations overlap and do not add up to the run's time. Charging each kernel
only the time by which it pushed out the latest end seen so far does add up: the shares sum
to the span from the first kernel's start to the last end. Used by scripts/graph_timeline.py
(a decode step, kernel by kernel) and `bench.gpu_kernels.graph_span_ms` (a replay's span).
"""

from __future__ import annotations


def kernel_events(prof) -> list[dict]:
    """The device kernels a `torch.profiler.profile` recorded (copies and fills of memory
    left out), by start: name, start and duration (us), stream."""
    out = []
    for ev in prof.profiler.kineto_results.events():
        if ev.device_type().name != "CUDA" or ev.duration_ns() <= 0:
            continue
        if ev.name().startswith(("Memcpy", "Memset")):
            continue
        out.append({"name": ev.name(), "start": ev.start_ns() / 1e3,
                    "dur": ev.duration_ns() / 1e3, "stream": ev.device_resource_id()})  # fmt: skip
    return sorted(out, key=lambda e: e["start"])


def charge_critical_path(events: list[dict]) -> float:
    """Give each event (in start order) `contribution`: its end minus the latest end before
    it, at least 0, and `gap_before`: idle time before its start. Returns the span, which
    the contributions add up to. Empty: 0."""
    if not events:
        return 0.0
    t0 = latest = events[0]["start"]
    for e in events:
        end = e["start"] + e["dur"]
        e["contribution"] = max(0.0, end - latest)
        e["gap_before"] = max(0.0, e["start"] - latest)
        latest = max(latest, end)
    return latest - t0
