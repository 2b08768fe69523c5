"""Prometheus metrics for the server, in the serving world's vocabulary (see DESIGN.md).

Each app has its own registry, so several apps in one process (tests) do not collide.
Latencies use the engine's monotonic timestamps, so they measure the engine, not HTTP.
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from sluice.outputs import RequestOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


# The disk tier under the prefix cache (--kv-offload-dir); set only when it is on.
_KV_OFFLOAD_GAUGES = (
    (
        "kv_offload_hit_blocks",
        "sluice_kv_offload_hit_blocks",
        "KV blocks loaded from the disk tier instead of recomputed (since start).",
    ),
    (
        "kv_offload_queried_blocks",
        "sluice_kv_offload_queried_blocks",
        "Prompt blocks looked up on the disk tier after a RAM prefix-cache miss (since start).",
    ),
    (
        "kv_offload_miss_blocks",
        "sluice_kv_offload_miss_blocks",
        "Prompt blocks missing in RAM and on the disk tier, so recomputed (since start).",
    ),
    (
        "kv_offload_hit_rate",
        "sluice_kv_offload_hit_rate",
        "Disk-tier hits over lookups since start (0-1).",
    ),
    ("kv_offload_files", "sluice_kv_offload_files", "Block files on the disk tier."),
    ("kv_offload_disk_bytes", "sluice_kv_offload_disk_bytes", "Bytes of block files on disk."),
    (
        "kv_offload_bytes_read",
        "sluice_kv_offload_read_bytes",
        "Payload bytes loaded from the disk tier (since start).",
    ),
    (
        "kv_offload_bytes_written",
        "sluice_kv_offload_written_bytes",
        "Bytes of block files written to the disk tier (since start).",
    ),
    (
        "kv_offload_corrupt_files",
        "sluice_kv_offload_corrupt_files",
        "Truncated, corrupt or foreign block files found and deleted (since start).",
    ),
    (
        "kv_offload_write_errors",
        "sluice_kv_offload_write_errors",
        "Block files that could not be written, e.g. a full disk (since start).",
    ),
)

# Prefill/decode disaggregation (0 on an instance without a role).
_PD_GAUGES = (
    (
        "pd_held_blocks",
        "sluice_pd_held_blocks",
        "KV blocks a prefill instance holds for decode instances to pull (copies).",
    ),
    (
        "pd_held_transfers",
        "sluice_pd_held_transfers",
        "Prompts whose blocks a prefill instance holds for a decode instance.",
    ),
    (
        "pd_expired_transfers",
        "sluice_pd_expired_transfers",
        "Held prompts dropped because no decode instance pulled them in time (since start).",
    ),
    (
        "pd_loaded_blocks",
        "sluice_pd_loaded_blocks",
        "KV blocks a decode instance pulled and loaded instead of computing (since start).",
    ),
    (
        "pd_failed_transfers",
        "sluice_pd_failed_transfers",
        "Pulls that failed, so the decode instance computed the prompt (since start).",
    ),
)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram(
            "sluice_time_to_first_token_seconds",
            "Time from arrival to the first output token.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.tpot = Histogram(
            "sluice_time_per_output_token_seconds",
            "Mean time between output tokens of a finished request (after the first).",
            labels,
            buckets=_TPOT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.e2e = Histogram(
            "sluice_e2e_request_latency_seconds",
            "Time from arrival to the last output token.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.prompt_tokens = Counter(
            "sluice_prompt_tokens", "Prompt tokens submitted.", labels, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            "sluice_generation_tokens", "Output tokens generated.", labels, registry=r
        ).labels(model_name)
        self._finished = Counter(
            "sluice_request_success",
            "Output sequences finished, by finish reason (stop, length, abort).",
            [*labels, "finished_reason"],
            registry=r,
        )
        self._model = model_name
        # Gauges mirror the engine's stats; refreshed on each scrape.
        self._gauges = {
            key: Gauge(name, doc, labels, registry=r).labels(model_name)
            for key, name, doc in (
                ("num_running", "sluice_num_requests_running", "Requests being computed."),
                ("num_waiting", "sluice_num_requests_waiting", "Requests waiting to be run."),
                ("kv_usage", "sluice_kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)."),
                ("kv_free_blocks", "sluice_kv_cache_free_blocks", "Free KV cache blocks."),
                ("kv_total_blocks", "sluice_kv_cache_total_blocks", "KV cache blocks in total."),
                (
                    "kv_local_free_blocks",
                    "sluice_kv_cache_local_free_blocks",
                    "Free blocks of the windowed layers' own pool (0 with one pool).",
                ),
                (
                    "kv_local_total_blocks",
                    "sluice_kv_cache_local_total_blocks",
                    "Blocks of the windowed layers' own pool (0 with one pool).",
                ),
                (
                    "prefix_cache_hit_rate",
                    "sluice_prefix_cache_hit_rate",
                    "Fraction of queried prompt tokens found in the prefix cache (0-1).",
                ),
                (
                    "num_pending",
                    "sluice_num_requests_pending",
                    "Requests not yet taken by the loop.",
                ),
                (
                    "weight_bytes",
                    "sluice_weight_bytes",
                    "Bytes of the model's weights as held in memory (quantized or dense).",
                ),
                (
                    "num_forced_tokens",
                    "sluice_structured_forced_tokens",
                    "Output tokens a grammar forced, appended without a decode step each "
                    "(since start).",
                ),
                (
                    "grammars_compiled",
                    "sluice_structured_grammars_compiled",
                    "Distinct constraints compiled by the grammar library (since start).",
                ),
                (
                    "spec_drafted_tokens",
                    "sluice_spec_decode_num_draft_tokens",
                    "Draft tokens verified by speculative decoding (since start).",
                ),
                (
                    "spec_accepted_tokens",
                    "sluice_spec_decode_num_accepted_tokens",
                    "Draft tokens accepted by verification (since start).",
                ),
                (
                    "spec_emitted_tokens",
                    "sluice_spec_decode_num_emitted_tokens",
                    "Tokens emitted by steps that verified drafts: accepted drafts and the "
                    "target's own token (since start).",
                ),
                (
                    "spec_verify_steps",
                    "sluice_spec_decode_num_drafts",
                    "Verifications: a request checking its drafts in one step (since start).",
                ),
                (
                    "spec_acceptance_rate",
                    "sluice_spec_decode_acceptance_rate",
                    "Accepted over verified draft tokens since start (0-1; 0 before any).",
                ),
                (
                    "spec_mean_accepted_length",
                    "sluice_spec_decode_mean_accepted_length",
                    "Tokens emitted per verification since start (1 when no draft passes; "
                    "0 before any).",
                ),
                *_KV_OFFLOAD_GAUGES,
                *_PD_GAUGES,
                (
                    "rss_bytes",
                    "sluice_process_resident_bytes",
                    "Resident memory of the engine's process (weights, KV pages in use, runtime).",
                ),
            )
        }

        # What runs: constant 1, the facts in labels (the Prometheus "info" idiom), so a
        # dashboard can tell which kernel level (avx512, avx2, generic) served a figure.
        self._engine_info = Gauge(
            "sluice_engine_info",
            "The engine's configuration: dtype, weight quantization, KV cache dtype, CPU "
            "kernel level.",
            [*labels, "dtype", "quantization", "kv_cache_dtype", "cpu_kernels"],
            registry=r,
        )

        # Data-parallel replicas, one series each (labelled by replica index); present
        # only when the server runs replicas. Counts since start are mirrored as gauges.
        self._replica_gauges = {
            key: Gauge(name, doc, [*labels, "replica"], registry=r)
            for key, name, doc in (
                ("alive", "sluice_replica_up", "1 while the replica serves, 0 while it restarts."),
                ("load", "sluice_replica_load", "Requests in flight on the replica."),
                ("kv_usage", "sluice_replica_kv_cache_usage_perc", "Replica's KV use (0-1)."),
                (
                    "prefix_cache_hit_rate",
                    "sluice_replica_prefix_cache_hit_rate",
                    "Fraction of the replica's queried prompt tokens found in its cache (0-1).",
                ),
                ("routed", "sluice_replica_requests_routed", "Requests routed to the replica."),
                (
                    "routed_by_prefix",
                    "sluice_replica_requests_routed_by_prefix",
                    "Requests routed to the replica because it held part of their prompt.",
                ),
                ("restarts", "sluice_replica_restarts", "Times the replica was restarted."),
            )
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

    def render(self, stats: dict[str, Any]) -> bytes:
        # Read at the scrape, not in every step's stats: it costs a file read.
        stats = {**stats, "rss_bytes": _resident_bytes()}
        for key, gauge in self._gauges.items():
            value = stats.get(key)
            if isinstance(value, int | float):
                gauge.set(float(value))
        for replica in stats.get("replicas", ()):
            for key, family in self._replica_gauges.items():
                family.labels(self._model, str(replica["replica"])).set(float(replica[key]))
        keys = ("dtype", "quantization", "kv_cache_dtype", "cpu_kernels")
        info = [str(stats.get(k, "unknown")) for k in keys]
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
