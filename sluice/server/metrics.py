"""Prometheus metrics for the server, in the serving world's vocabulary (see DESIGN.md).

Each app has its own registry, so several apps in one process (tests) do not collide.
Latencies use the engine's monotonic timestamps, so they measure the engine, not HTTP.
Which stat is which gauge (or label) is declared on the stats' fields in
sluice/engine/stats.py; this module reads those declarations, it lists no keys.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from sluice.engine.stats import (
    AsGauge,
    AsLabel,
    EngineStats,
    FrontEndStats,
    PerAdapter,
    PerLayerExpert,
    PerReplica,
    ReplicaStats,
    stat_fields,
)
from sluice.outputs import RequestOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class _Metric(NamedTuple):
    name: str
    help: str


# The server's own metrics; the stats' gauges are declared on their fields instead.
_TTFT = _Metric(
    "sluice_time_to_first_token_seconds", "Time from arrival to the first output token."
)
_TPOT = _Metric(
    "sluice_time_per_output_token_seconds",
    "Mean time between output tokens of a finished request (after the first).",
)
_E2E = _Metric("sluice_e2e_request_latency_seconds", "Time from arrival to the last output token.")
_PROMPT_TOKENS = _Metric("sluice_prompt_tokens", "Prompt tokens submitted.")
_GENERATION_TOKENS = _Metric("sluice_generation_tokens", "Output tokens generated.")
_FINISHED = _Metric(
    "sluice_request_success",
    "Output sequences finished, by finish reason (stop, length, abort).",
)
_RSS = _Metric(
    "sluice_process_resident_bytes",
    "Resident memory of the engine's process (weights, KV pages in use, runtime).",
)
# What runs: constant 1, the facts in labels (the Prometheus "info" idiom), so a
# dashboard can tell which kernel level (avx512, avx2, generic) served a figure.
_ENGINE_INFO = _Metric(
    "sluice_engine_info",
    "The engine's configuration: dtype, weight quantization, KV cache dtype, CPU kernel level.",
)

# The stats' keys and what they become, read off their declarations.
_STATS = (*stat_fields(EngineStats), *stat_fields(FrontEndStats))
_GAUGES = tuple((f.key, f.export) for f in _STATS if isinstance(f.export, AsGauge))
_INFO_LABELS = tuple(f.key for f in _STATS if isinstance(f.export, AsLabel))
_REPLICA_LISTS = tuple(f.key for f in _STATS if isinstance(f.export, PerReplica))
_EXPERT_TABLES = tuple((f.key, f.export) for f in _STATS if isinstance(f.export, PerLayerExpert))
_ADAPTER_COUNTS = tuple((f.key, f.export) for f in _STATS if isinstance(f.export, PerAdapter))
_REPLICA_GAUGES = tuple(
    (f.key, f.export) for f in stat_fields(ReplicaStats) if isinstance(f.export, AsGauge)
)
(_REPLICA_LABEL,) = (f.key for f in stat_fields(ReplicaStats) if isinstance(f.export, AsLabel))


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self._model = model_name
        labels = ["model_name"]

        def histogram(m: _Metric, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(m.name, m.help, labels, buckets=buckets, registry=r).labels(model_name)

        def counter(m: _Metric) -> Counter:
            return Counter(m.name, m.help, labels, registry=r).labels(model_name)

        def gauge(m: _Metric | AsGauge) -> Gauge:
            return Gauge(m.name, m.help, labels, registry=r).labels(model_name)

        self.ttft = histogram(_TTFT, _TTFT_BUCKETS)
        self.tpot = histogram(_TPOT, _TPOT_BUCKETS)
        self.e2e = histogram(_E2E, _E2E_BUCKETS)
        self.prompt_tokens = counter(_PROMPT_TOKENS)
        self.generation_tokens = counter(_GENERATION_TOKENS)
        self._finished = Counter(*_FINISHED, [*labels, "finished_reason"], registry=r)
        # The stats' gauges; refreshed on each scrape.
        self._gauges = {key: gauge(declared) for key, declared in _GAUGES}
        self._rss = gauge(_RSS)
        self._engine_info = Gauge(*_ENGINE_INFO, [*labels, *_INFO_LABELS], registry=r)
        # Data-parallel replicas, one series each (labelled by replica index); present
        # only when the server runs replicas. Counts since start are mirrored as gauges.
        self._replica_gauges = {
            key: Gauge(g.name, g.help, [*labels, _REPLICA_LABEL], registry=r)
            for key, g in _REPLICA_GAUGES
        }
        self._expert_gauges = {
            key: Gauge(g.name, g.help, [*labels, "layer", "expert"], registry=r)
            for key, g in _EXPERT_TABLES
        }
        self._adapter_gauges = {
            key: Gauge(g.name, g.help, [*labels, "lora_name"], registry=r)
            for key, g in _ADAPTER_COUNTS
        }

    def finished(self, reason: str, count: int = 1) -> None:
        self._finished.labels(self._model, reason).inc(count)

    def observe_first_token(self, out: RequestOutput) -> None:
        m = out.metrics
        if m is not None and m.first_token_time is not None:
            self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))

    def observe_finished(self, out: RequestOutput) -> None:
        """Latencies of a finished request, from its final output."""
        m = out.metrics
        if m is None or m.finished_time is None:
            return
        self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))
        n = max((len(c.token_ids) for c in out.outputs), default=0)
        if m.first_token_time is not None and n > 1:
            self.tpot.observe(max(0.0, m.finished_time - m.first_token_time) / (n - 1))

    def render(self, stats: Mapping[str, Any]) -> bytes:
        for key, gauge in self._gauges.items():
            value = stats.get(key)
            if isinstance(value, int | float):
                gauge.set(float(value))
        # Read at the scrape, not in every step's stats: it costs a file read.
        rss = _resident_bytes()
        if rss is not None:
            self._rss.set(float(rss))
        for key in _REPLICA_LISTS:
            for replica in stats.get(key) or ():
                index = str(replica[_REPLICA_LABEL])
                for name, family in self._replica_gauges.items():
                    family.labels(self._model, index).set(float(replica[name]))
        for key, family in self._expert_gauges.items():
            for layer, row in enumerate(stats.get(key) or ()):
                for expert, count in enumerate(row):
                    family.labels(self._model, str(layer), str(expert)).set(float(count))
        for key, family in self._adapter_gauges.items():
            for name, count in (stats.get(key) or {}).items():
                family.labels(self._model, name).set(float(count))
        info = [str(stats.get(k, "unknown")) for k in _INFO_LABELS]
        self._engine_info.clear()
        self._engine_info.labels(self._model, *info).set(1)
        return generate_latest(self.registry)


def _resident_bytes() -> int | None:
    """This process's resident memory (Linux), None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
