"""The critical-path shares that scripts/graph_timeline.py and bench.gpu_kernels report."""

from __future__ import annotations

from types import SimpleNamespace

from bench.kernel_trace import charge_critical_path, kernel_events


def _event(name: str, start: float, dur: float, device: str = "CUDA", stream: int = 7):
    return SimpleNamespace(
        name=lambda: name, start_ns=lambda: start * 1e3, duration_ns=lambda: dur * 1e3,
        device_type=lambda: SimpleNamespace(name=device), device_resource_id=lambda: stream,
    )  # fmt: skip


def test_shares_add_up_to_the_span_when_kernels_overlap() -> None:
    """PDL: b starts (and waits) inside a, c lies wholly inside b, d starts after a gap. Each
    is charged only what it adds to the latest end; the shares sum to the span, while the
    durations (30 + 20 + 2 + 5) would overstate it."""
    events = [
        {"name": "a", "start": 0.0, "dur": 10.0},
        {"name": "b", "start": 8.0, "dur": 20.0},
        {"name": "c", "start": 9.0, "dur": 2.0},
        {"name": "d", "start": 31.0, "dur": 5.0},
    ]
    span = charge_critical_path(events)
    assert span == 36.0
    assert [e["contribution"] for e in events] == [10.0, 18.0, 0.0, 8.0]
    assert [e["gap_before"] for e in events] == [0.0, 0.0, 0.0, 3.0]
    assert sum(e["contribution"] for e in events) == span
    assert charge_critical_path([]) == 0.0


def test_kernel_events_keep_device_kernels_in_start_order() -> None:
    """Host events and memory copies or fills are left out; kernels come sorted by start."""
    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(
        events=lambda: [_event("late", 5.0, 1.0), _event("cpu op", 0.0, 9.0, device="CPU"),
                        _event("Memcpy HtoD", 1.0, 1.0), _event("Memset", 2.0, 1.0),
                        _event("early", 1.0, 2.0, stream=9), _event("empty", 3.0, 0.0)])))  # fmt: skip
    got = kernel_events(prof)
    assert [(e["name"], e["start"], e["dur"], e["stream"]) for e in got] == [
        ("early", 1.0, 2.0, 9), ("late", 5.0, 1.0, 7)]  # fmt: skip
