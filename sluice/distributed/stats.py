"""The replicas' stats as one engine's, plus one entry per replica for /stats and the
per-replica gauges of /metrics.

How each key merges is declared on its field in sluice/engine/stats.py (`Merge`):
summed counts, facts every replica shares (taken from the first up), rates and
fractions recomputed from the summed counts; a connector's keys appear where some
replica reports them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sluice.distributed.replica_client import ReplicaClient
from sluice.distributed.router import RouteCounts
from sluice.engine.stats import Derive, FrontEndStats, Merge, ReplicaStats, stat_fields


def merged_stats(
    replicas: Sequence[ReplicaClient], loads: Sequence[int], counts: Sequence[RouteCounts]
) -> dict[str, Any]:
    up = [r.stats for r in replicas if r.alive and r.stats]
    out = merge(up)
    entries = [_one(r, loads[r.index], counts[r.index]) for r in replicas]
    out.update(FrontEndStats(data_parallel_size=len(replicas), replicas=entries).as_dict())
    return out


def merge(up: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One engine's stats (EngineStats.as_dict()'s keys, less the UNMERGED ones) from
    the up replicas' dicts, in /stats' order."""
    out: dict[str, Any] = {}
    derived: list[tuple[str, Derive]] = []
    for f in stat_fields():
        if f.merge is Merge.UNMERGED or (f.group is not None and not any(f.key in s for s in up)):
            continue  # not merged, or that connector is off on every replica
        if f.merge is Merge.SUMMED:
            # Absent (an older or partial replica): 0. Counts stay ints.
            values = (s.get(f.key, 0) for s in up)
            out[f.key] = sum(int(v) if f.type is int else v for v in values)
        elif f.merge is Merge.CELLWISE:
            out[f.key] = _cellwise_sum([s[f.key] for s in up if f.key in s])
        elif f.merge is Merge.KEYWISE:
            out[f.key] = _keywise_sum([s[f.key] for s in up if f.key in s])
        elif f.merge is Merge.SHARED:
            out[f.key] = next((s[f.key] for s in up if f.key in s), None)
        elif f.merge is Merge.DERIVED and f.derive is not None:
            out[f.key] = None  # its place in the order; computed once the sums are in
            derived.append((f.key, f.derive))
        else:
            raise TypeError(f"stat {f.key!r} declares no merge (sluice/engine/stats.py)")
    for key, derive in derived:
        out[key] = derive(out)
    return out


def _cellwise_sum(tables: Sequence[Sequence[Sequence[int]]]) -> list[list[int]]:
    """Tables of one shape (the replicas run one model) added cell by cell."""
    if not tables:
        return []
    return [[sum(cells) for cells in zip(*rows, strict=True)] for rows in zip(*tables, strict=True)]


def _keywise_sum(counts: Sequence[Mapping[str, int]]) -> dict[str, int]:
    """Counts by name added name by name (a name one replica lacks counts 0 there)."""
    out: dict[str, int] = {}
    for c in counts:
        for name, n in c.items():
            out[name] = out.get(name, 0) + n
    return out


def _one(r: ReplicaClient, load: int, counts: RouteCounts) -> dict[str, Any]:
    return ReplicaStats(
        replica=r.index,
        alive=r.alive,
        pid=r.pid,
        restarts=r.restarts,
        load=load,
        routed=counts.routed,
        routed_by_prefix=counts.routed_by_prefix,
        **ReplicaStats.mirrored(r.stats if r.alive else {}),
    ).as_dict()
