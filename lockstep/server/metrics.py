"""Prometheus metrics for `/metrics`.

Latency histograms are observed as outputs reach their handlers (so they include the hop from
the engine to the event loop, as a client sees it). Engine gauges and counters are read from
`Engine.stats()` at scrape time by the engine loop, between steps, so a scrape is always a
consistent snapshot and never races a step. Each server gets its own registry: two apps in one
process (tests) do not collide in the global one.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_THROUGHPUT_WINDOW_S = 10.0


class _ThroughputMeter:
    """Generated tokens per second over the last few seconds; fed as steps are reported."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, tokens: int) -> None:
        now = time.monotonic()
        with self._lock:
            self._samples.append((now, tokens))
            self._trim(now)

    def rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._samples) / _THROUGHPUT_WINDOW_S

    def _trim(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - _THROUGHPUT_WINDOW_S:
            self._samples.popleft()


class _EngineStatsCollector(Collector):
    """Turns the last `Engine.stats()` snapshot into gauges and counters at scrape time."""

    def __init__(self, meter: _ThroughputMeter) -> None:
        self.stats: dict = {}
        self._meter = meter

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        gauges = {
            "lockstep_requests_running": ("Requests holding KV and being stepped", "num_running"),
            "lockstep_requests_waiting": ("Requests queued for admission", "num_waiting"),
            "lockstep_kv_tokens_total": ("KV pool capacity in tokens", "kv_total"),
            "lockstep_kv_tokens_free": ("KV slots neither in use nor cached", "kv_free"),
            "lockstep_kv_tokens_cached": ("KV slots held only by the prefix cache", "kv_cached"),
            "lockstep_kv_tokens_in_use": ("KV slots locked by running requests", "kv_in_use"),
            "lockstep_linear_state_snapshots": (
                "Linear-attention state snapshots held by the prefix cache (hybrid models)",
                "state_snapshots",
            ),
            "lockstep_linear_state_bytes": ("Bytes of those snapshots", "state_bytes"),
            "lockstep_linear_snapshot_slots": (
                "Slots of the snapshot pool (hybrid models)",
                "state_snapshot_slots",
            ),
            "lockstep_linear_snapshots_free": (
                "Snapshot slots neither cached nor held by running requests",
                "state_snapshots_free",
            ),
        }
        for name, (doc, key) in gauges.items():
            if key in s:
                yield GaugeMetricFamily(name, doc, value=s[key])
        if s.get("kv_total"):
            yield GaugeMetricFamily(
                "lockstep_kv_usage_ratio",
                "Fraction of the KV pool used by running requests",
                value=s["kv_in_use"] / s["kv_total"],
            )
        prompt_total = s.get("prompt_tokens_total", 0)
        yield GaugeMetricFamily(
            "lockstep_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache / prompt tokens, since start",
            value=s.get("cached_tokens_total", 0) / prompt_total if prompt_total else 0.0,
        )
        yield GaugeMetricFamily(
            "lockstep_spec_acceptance_rate",
            "Draft tokens kept / draft tokens proposed, since start (0 without speculation)",
            value=s.get("spec_acceptance_rate", 0.0),
        )
        counters = {
            "lockstep_prompt_tokens": ("Prompt tokens admitted", "prompt_tokens_total"),
            "lockstep_cached_prompt_tokens": ("Prompt tokens hit in cache", "cached_tokens_total"),
            "lockstep_generation_tokens": ("Tokens generated", "generated_tokens_total"),
            "lockstep_preemptions": ("Requests preempted for KV space", "num_preemptions"),
            "lockstep_spec_draft_tokens": (
                "Draft tokens proposed by speculative decoding",
                "spec_drafted_tokens_total",
            ),
            "lockstep_spec_accepted_tokens": (
                "Draft tokens verified and kept (outputs are the same either way)",
                "spec_accepted_tokens_total",
            ),
            "lockstep_spec_verify_chunks": (
                "Verify chunks computed (one per speculating request per step)",
                "spec_verify_chunks_total",
            ),
            "lockstep_spec_boundary_limited": (
                "Draft proposals shortened to stay inside a linear-attention chunk (hybrid models)",
                "spec_boundary_limited_total",
            ),
            "lockstep_linear_snapshots_not_kept": (
                "Chunk boundaries not kept for want of a free snapshot slot (hybrid models)",
                "state_snapshots_not_kept",
            ),
        }
        for name, (doc, key) in counters.items():
            if key in s:
                yield CounterMetricFamily(name, doc, value=s[key])
        yield GaugeMetricFamily(
            "lockstep_generation_tokens_per_second",
            f"Tokens generated per second over the last {_THROUGHPUT_WINDOW_S:.0f} s",
            value=self._meter.rate(),
        )


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._meter = _ThroughputMeter()
        self._engine_stats = _EngineStatsCollector(self._meter)
        self.registry.register(self._engine_stats)
        self.time_to_first_token = Histogram(
            "lockstep_time_to_first_token_seconds",
            "Time from a request's admission to its first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "lockstep_inter_token_latency_seconds",
            "Time between consecutive generated tokens of one request",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.request_latency = Histogram(
            "lockstep_request_latency_seconds",
            "Time from a request's admission to its last token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.step_time = Histogram(
            "lockstep_engine_step_seconds",
            "Wall time of one engine step",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.requests_finished = Counter(
            "lockstep_requests_finished",
            "Engine requests finished, by finish reason",
            ["finish_reason"],
            registry=self.registry,
        )
        self.http_errors = Counter(
            "lockstep_http_errors",
            "Responses with an error status (4xx, 5xx) sent, by status code",
            ["status"],
            registry=self.registry,
        )

    def count_error(self, status: int) -> None:
        """One response of `status` (>= 400) written to a client: called where every status
        line is written (connections.py), so the refusals below the routes count too."""
        self.http_errors.labels(str(status)).inc()

    def observe_step(self, seconds: float, new_tokens: int) -> None:
        """Called on the event loop as each step's outputs arrive."""
        self.step_time.observe(seconds)
        self._meter.add(new_tokens)

    def render(self, engine_stats: dict) -> bytes:
        self._engine_stats.stats = engine_stats
        return generate_latest(self.registry)
