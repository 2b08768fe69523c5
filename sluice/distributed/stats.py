"""The replicas' stats as one engine's (sums, and rates from the summed counts), plus
one entry per replica for /stats and the per-replica gauges of /metrics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sluice.distributed.replica_client import ReplicaClient
from sluice.distributed.router import RouteCounts

# Counts that add up across replicas; the rest of an engine's stats are rates (derived
# below) or facts every replica shares (dtype, block size), taken from the first up.
_SUMMED = (
    "num_running",
    "num_waiting",
    "num_requests",
    "kv_total_blocks",
    "kv_free_blocks",
    "kv_local_total_blocks",
    "kv_local_free_blocks",
    "prefix_cache_queried_tokens",
    "prefix_cache_hit_tokens",
    "num_preemptions",
    "num_steps",
    "num_generated_tokens",
    "num_forced_tokens",
    "grammars_compiled",
    "weight_bytes",
    "spec_drafted_tokens",
    "spec_accepted_tokens",
    "spec_emitted_tokens",
    "spec_verify_steps",
)
# A prefill/decode instance's counters (kv_connector/pd_*.py), where replicas have them.
_PD_SUMMED = (
    "pd_held_transfers",
    "pd_held_blocks",
    "pd_held_bytes",
    "pd_sent_transfers",
    "pd_expired_transfers",
    "pd_broken_transfers",
    "pd_refused_pulls",
    "pd_dropped_holds",
    "pd_bytes_sent",
    "pd_pending_pulls",
    "pd_pulled_transfers",
    "pd_failed_transfers",
    "pd_loaded_blocks",
    "pd_loaded_tokens",
    "pd_bytes_pulled",
    "pd_pull_seconds",
)
_SHARED = (
    "block_size",
    "max_model_len",
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "cpu_kernels",
    "spec_method",
)


def merged_stats(
    replicas: Sequence[ReplicaClient], loads: Sequence[int], counts: Sequence[RouteCounts]
) -> dict[str, Any]:
    up = [r.stats for r in replicas if r.alive and r.stats]
    out: dict[str, Any] = {k: sum(int(s.get(k, 0)) for s in up) for k in _SUMMED}
    for key in _SHARED:
        out[key] = next((s[key] for s in up if key in s), None)
    for key in _PD_SUMMED:
        if any(key in s for s in up):
            out[key] = sum(s.get(key, 0) for s in up)
    # The fuller pool's use, as one engine reports it (a split cache has two pools).
    out["kv_usage"] = max(
        1.0 - out[free] / out[total] if out[total] else 0.0
        for total, free in (
            ("kv_total_blocks", "kv_free_blocks"),
            ("kv_local_total_blocks", "kv_local_free_blocks"),
        )
    )
    queried = out["prefix_cache_queried_tokens"]
    out["prefix_cache_hit_rate"] = out["prefix_cache_hit_tokens"] / queried if queried else 0.0
    drafted, steps = out["spec_drafted_tokens"], out["spec_verify_steps"]
    out["spec_acceptance_rate"] = out["spec_accepted_tokens"] / drafted if drafted else 0.0
    out["spec_mean_accepted_length"] = out["spec_emitted_tokens"] / steps if steps else 0.0
    out["data_parallel_size"] = len(replicas)
    out["replicas"] = [_one(r, loads[r.index], counts[r.index]) for r in replicas]
    return out


def _one(r: ReplicaClient, load: int, counts: RouteCounts) -> dict[str, Any]:
    s = r.stats if r.alive else {}
    return {
        "replica": r.index,
        "alive": r.alive,
        "pid": r.pid,
        "restarts": r.restarts,
        "load": load,
        "routed": counts.routed,
        "routed_by_prefix": counts.routed_by_prefix,
        "num_running": s.get("num_running", 0),
        "num_waiting": s.get("num_waiting", 0),
        "num_requests": s.get("num_requests", 0),
        "num_generated_tokens": s.get("num_generated_tokens", 0),
        "kv_usage": s.get("kv_usage", 0.0),
        "kv_free_blocks": s.get("kv_free_blocks", 0),
        "kv_total_blocks": s.get("kv_total_blocks", 0),
        "prefix_cache_hit_rate": s.get("prefix_cache_hit_rate", 0.0),
    }
