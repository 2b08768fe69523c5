"""Every stat declares its merge and its export, and both happen: a stat added without
them, or one the merge or a scrape leaves out, fails here (sluice/engine/stats.py).

The scrapes are ServerMetrics.render, the code behind /metrics, parsed back; the merge
is merged_stats, the code behind a data-parallel server's /stats.
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice.distributed.router import RouteCounts
from sluice.distributed.stats import merged_stats
from sluice.engine.stats import (
    AsGauge,
    AsLabel,
    ConnectorStats,
    DiskTierStats,
    EngineStats,
    FrontEndStats,
    Merge,
    NotExported,
    PDDecodeStats,
    PDPrefillStats,
    PerAdapter,
    PerLayerExpert,
    PerReplica,
    ReplicaStats,
    StatField,
    stat_fields,
)
from sluice.server.metrics import ServerMetrics

CONNECTORS: list[type[Any]] = [DiskTierStats, PDPrefillStats, PDDecodeStats]


def _value(f: StatField, n: int) -> Any:
    """A distinct value of the field's type (n > 0)."""
    if f.type is int:
        return n
    if f.type is float:
        return n / 1000
    if isinstance(f.export, PerLayerExpert):  # 2 layers of 3 experts
        return [[n, n + 1, n + 2], [n + 3, n + 4, n + 5]]
    if isinstance(f.export, PerAdapter):  # two adapters, one only some replicas know
        return {"sql": n, f"only-{n}": n + 1}
    return f"{f.key}-{n}"


def _connector(cls: type[Any], n: int) -> ConnectorStats:
    stats: ConnectorStats = cls(**{f.key: _value(f, n + i) for i, f in enumerate(stat_fields(cls))})
    return stats


def full_stats(connector: type[Any] | None, n: int = 1) -> EngineStats:
    """An EngineStats with every field set, and `connector`'s stats if given."""
    values = {f.key: _value(f, n + i) for i, f in enumerate(stat_fields()) if f.group is None}
    return EngineStats(**values, connector=_connector(connector, n) if connector else None)


def scrape(stats: dict[str, Any]) -> dict[str, float]:
    """/metrics' samples, keyed by name and labels (model_name left out)."""
    text = ServerMetrics("m").render(stats).decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


# ---- the declarations ---------------------------------------------------------------------


def _export_declared(f: StatField) -> bool:
    if isinstance(f.export, NotExported):
        return bool(f.export.reason)  # "": no declaration at all
    return isinstance(f.export, AsGauge | AsLabel | PerReplica | PerLayerExpert | PerAdapter)


def test_every_engine_stat_declares_its_merge_and_export() -> None:
    fields = stat_fields()
    assert {f.group for f in fields} == {None, *CONNECTORS}  # each connector's are in
    for f in fields:
        assert isinstance(f.merge, Merge), f"{f.key} does not declare how replicas merge it"
        assert _export_declared(f), f"{f.key} does not declare how /metrics exports it"
        assert (f.merge is Merge.DERIVED) == (f.derive is not None), f.key
        assert (f.merge is Merge.UNMERGED) == bool(f.unmerged_why), f.key
        assert not isinstance(f.export, PerReplica), f.key


def test_every_front_end_stat_declares_its_export() -> None:
    for cls in (FrontEndStats, ReplicaStats):
        for f in stat_fields(cls):
            assert f.merge is None, f"{f.key}: a front end's stat is made after the merge"
            assert _export_declared(f), f"{cls.__name__}.{f.key} declares no export"
    engine_keys = {f.key for f in stat_fields()}
    for f in stat_fields(ReplicaStats):
        if f.mirrored:
            assert f.key in engine_keys, f"ReplicaStats.{f.key} mirrors no engine stat"


def test_keys_and_metric_names_are_unique() -> None:
    keys = [f.key for cls in (EngineStats, FrontEndStats) for f in stat_fields(cls)]
    assert len(keys) == len(set(keys))
    names = [
        f.export.name
        for cls in (EngineStats, FrontEndStats, ReplicaStats)
        for f in stat_fields(cls)
        if isinstance(f.export, AsGauge)
    ]
    assert len(names) == len(set(names))
    assert all(n.startswith("sluice_") for n in names)


# ---- /stats -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "connector", [None, *CONNECTORS], ids=lambda c: getattr(c, "__name__", "none")
)
def test_as_dict_is_flat_json_with_the_connectors_keys_only_when_on(
    connector: type[Any] | None,
) -> None:
    out = full_stats(connector).as_dict()
    want = [f.key for f in stat_fields() if f.group in (None, connector)]
    assert list(out) == want  # /stats' key order is the declarations'
    assert json.loads(json.dumps(out)) == out


# ---- /metrics -----------------------------------------------------------------------------


@pytest.mark.parametrize("connector", CONNECTORS, ids=lambda c: c.__name__)
def test_every_gauge_is_on_a_scrape_with_its_value(connector: type[Any]) -> None:
    stats = full_stats(connector).as_dict()
    extra = FrontEndStats(num_pending=7, num_step_errors=1, engine_alive=True).as_dict()
    samples = scrape({**stats, **extra})
    labels: dict[str, str] = {}
    for f in (*stat_fields(), *stat_fields(FrontEndStats)):
        if f.key not in stats and f.key not in extra:
            continue  # another connector's
        value = stats.get(f.key, extra.get(f.key))
        if isinstance(f.export, AsGauge):
            assert samples.get(f.export.name) == float(value), f"{f.key} -> {f.export.name}"
        elif isinstance(f.export, AsLabel):
            labels[f.key] = str(value)
        elif isinstance(f.export, PerLayerExpert):
            for layer, row in enumerate(value):
                for expert, count in enumerate(row):
                    name = f"{f.export.name}{{expert={expert},layer={layer}}}"
                    assert samples[name] == float(count), name
        elif isinstance(f.export, PerAdapter):
            assert value
            for adapter, count in value.items():
                name = f"{f.export.name}{{lora_name={adapter}}}"
                assert samples[name] == float(count), name
    info = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    assert samples[f"sluice_engine_info{{{info}}}"] == 1.0
    assert labels  # the info gauge has its labels


def test_each_replicas_gauges_are_on_a_scrape() -> None:
    entries = [
        ReplicaStats(
            replica=i, alive=True, pid=10 + i, restarts=i, load=2 + i, routed=5, routed_by_prefix=3,
            kv_usage=0.5, prefix_cache_hit_rate=0.25,
        ).as_dict()
        for i in range(2)
    ]  # fmt: skip
    samples = scrape(FrontEndStats(data_parallel_size=2, replicas=entries).as_dict())
    (label,) = (f.key for f in stat_fields(ReplicaStats) if isinstance(f.export, AsLabel))
    gauges = [f for f in stat_fields(ReplicaStats) if isinstance(f.export, AsGauge)]
    assert gauges
    for entry in entries:
        for f in gauges:
            assert isinstance(f.export, AsGauge)
            name = f"{f.export.name}{{{label}={entry[label]}}}"
            assert samples[name] == float(entry[f.key]), name


# ---- the data-parallel merge --------------------------------------------------------------


def _replica(i: int, stats: dict[str, Any], alive: bool = True) -> Any:
    return SimpleNamespace(index=i, alive=alive, pid=100 + i, restarts=0, stats=stats)


@pytest.mark.parametrize(
    "connector", [None, *CONNECTORS], ids=lambda c: getattr(c, "__name__", "none")
)
def test_merged_stats_handle_every_stat(connector: type[Any] | None) -> None:
    ones = [full_stats(connector, n).as_dict() for n in (1, 50)]
    replicas = [_replica(0, ones[0]), _replica(1, ones[1]), _replica(2, {}, alive=False)]
    counts = [RouteCounts(), RouteCounts(), RouteCounts()]
    out = merged_stats(replicas, [0, 0, 0], counts)  # type: ignore[arg-type]
    for f in stat_fields():
        if f.group not in (None, connector) or f.merge is Merge.UNMERGED:
            assert f.key not in out, f"{f.key} should not be merged"
        elif f.merge is Merge.SUMMED:
            assert out[f.key] == ones[0][f.key] + ones[1][f.key], f.key
        elif f.merge is Merge.SHARED:
            assert out[f.key] == ones[0][f.key], f.key
        elif f.merge is Merge.CELLWISE:
            a, b = ones[0][f.key], ones[1][f.key]
            want = [[x + y for x, y in zip(*r, strict=True)] for r in zip(a, b, strict=True)]
            assert out[f.key] == want, f.key
        elif f.merge is Merge.KEYWISE:
            a, b = ones[0][f.key], ones[1][f.key]
            want = {k: a.get(k, 0) + b.get(k, 0) for k in {*a, *b}}
            assert out[f.key] == want, f.key
        else:
            assert f.derive is not None
            assert isinstance(out[f.key], float) and out[f.key] == f.derive(out), f.key
    # Rates come from the summed counts, not from the replicas' rates.
    hits, queried = (
        sum(s[k] for s in ones) for k in ("prefix_cache_hit_tokens", "prefix_cache_queried_tokens")
    )
    assert out["prefix_cache_hit_rate"] == hits / queried
    assert out["data_parallel_size"] == 3
    dead = out["replicas"][2]
    assert (dead["alive"], dead["num_running"], dead["kv_usage"]) == (False, 0, 0.0)
    live = out["replicas"][1]
    assert list(live) == [f.name for f in dataclasses.fields(ReplicaStats)]
    for f in stat_fields(ReplicaStats):
        if f.mirrored:
            assert live[f.key] == ones[1][f.key], f.key


def test_merged_stats_of_no_replica_up() -> None:
    out = merged_stats([_replica(0, {}, alive=False)], [0], [RouteCounts()])  # type: ignore[list-item]
    assert out["num_running"] == 0 and out["dtype"] is None and out["kv_usage"] == 0.0


# ---- a real engine ------------------------------------------------------------------------


def test_an_engines_stats_are_its_declared_keys_and_scrape(llm_fp32: Any) -> None:
    stats = llm_fp32.stats()
    assert list(stats) == [f.key for f in stat_fields() if f.group is None]
    samples = scrape(stats)
    for f in stat_fields():
        if f.group is None and isinstance(f.export, AsGauge):
            assert samples[f.export.name] == float(stats[f.key]), f.key
