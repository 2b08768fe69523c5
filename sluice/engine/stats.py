"""Every stat that reaches /stats or /metrics, declared once, as a typed field.

Each field of EngineStats (and of the connector stats inside it) says how the replicas'
values merge into one engine's (`Merge`) and how /metrics exports it (`Export`). /stats'
JSON (`as_dict`), the data-parallel merge (sluice/distributed/stats.py) and the
Prometheus gauges (sluice/server/metrics.py) are read off these declarations, so a stat
is added in one place, and one without both declarations fails tests/test_stats.py
instead of silently missing from a merge or a scrape. FrontEndStats and ReplicaStats
declare what the front ends add (pending requests, each replica's line) the same way.

A stat's key in /stats is its field's name: the keys are the public API.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar


class Merge(enum.Enum):
    """How data-parallel replicas' values become one engine's (merged_stats)."""

    SUMMED = "summed"  # a count: the replicas' values add up
    SHARED = "shared"  # a fact every replica shares (dtype): the first up replica's
    DERIVED = "derived"  # a rate or fraction: recomputed from the merged counts
    UNMERGED = "unmerged"  # left out of the merged stats; the declaration says why
    CELLWISE = "cellwise"  # a table of counts (one model's shape): added cell by cell
    KEYWISE = "keywise"  # counts by name (each LoRA adapter's): added name by name


@dataclass(frozen=True)
class AsGauge:
    """Exported as this Prometheus gauge (labelled by model name)."""

    name: str
    help: str


@dataclass(frozen=True)
class AsLabel:
    """Exported as a label named after the field: of sluice_engine_info for an engine
    stat (strings such as dtype: the Prometheus "info" idiom), of every
    sluice_replica_* series for ReplicaStats' replica index."""


@dataclass(frozen=True)
class PerReplica:
    """A list of ReplicaStats dicts: each entry exported as ReplicaStats declares."""


@dataclass(frozen=True)
class NotExported:
    """In /stats only; `reason` says why it has no gauge."""

    reason: str


@dataclass(frozen=True)
class PerLayerExpert:
    """A [layer][expert] table of counts, exported as this gauge with one series per
    cell, labelled by layer and expert (empty for a dense model: no series)."""

    name: str
    help: str


@dataclass(frozen=True)
class PerAdapter:
    """A {LoRA adapter name: count} dict, exported as this gauge with one series per
    adapter, labelled lora_name (no series without LoRA)."""

    name: str
    help: str


Export = AsGauge | AsLabel | PerReplica | PerLayerExpert | PerAdapter | NotExported
_PER_REPLICA = PerReplica()

# Keys of a dataclass field's metadata.
_MERGE = "sluice_merge"
_EXPORT = "sluice_export"
_DERIVE = "sluice_derive"
_UNMERGED_WHY = "sluice_unmerged_why"
_MIRRORED = "sluice_mirrored"
_GROUP = "sluice_group"

Derive = Callable[[Mapping[str, Any]], float]


def stat(merge: Merge, export: Export, *, derive: Derive | None = None, why: str = "") -> Any:
    """An engine stat's field: required (the engine sets every one), with its merge and
    its export. DERIVED takes `derive` (the merged stats -> the value); UNMERGED takes
    `why`. Checked here, so a half-declared stat fails at import."""
    if (merge is Merge.DERIVED) != (derive is not None):
        raise TypeError("a DERIVED stat, and only one, gives derive=")
    if (merge is Merge.UNMERGED) != bool(why):
        raise TypeError("an UNMERGED stat, and only one, says why=")
    if isinstance(export, NotExported) and not export.reason:
        raise TypeError("NotExported needs a reason")
    meta = {_MERGE: merge, _EXPORT: export, _DERIVE: derive, _UNMERGED_WHY: why}
    return field(metadata=meta)


def exported(export: Export, default: Any = dataclasses.MISSING, *, mirrored: bool = False) -> Any:
    """A front end's field (FrontEndStats, ReplicaStats): only an export, since it is
    made after the merge; required unless given a default. `mirrored`: copied from the
    replica's engine stat of the same name (ReplicaStats)."""
    return field(default=default, metadata={_EXPORT: export, _MIRRORED: mirrored})


def ratio(num: float, den: float) -> float:
    """num / den, 0.0 before any den: the one formula of every rate here."""
    return num / den if den else 0.0


def _ratio_of(num: str, den: str) -> Derive:
    # Keys of the merged stats: a wrong one raises KeyError at every merge (and in
    # tests/test_stats.py), never a silent 0.
    return lambda m: ratio(m[num], m[den])


def _fuller_pool_usage(m: Mapping[str, Any]) -> float:
    """The fuller pool's use, as one engine reports it (a split cache has two pools)."""
    pools = (
        ("kv_total_blocks", "kv_free_blocks"),
        ("kv_local_total_blocks", "kv_local_free_blocks"),
    )
    return float(max(1.0 - m[free] / m[total] if m[total] else 0.0 for total, free in pools))


# ---- the connectors' stats (present only while that connector is on) ------------------


class _ByKey:
    """Readable by key like the dicts these replaced (stats["pd_held_blocks"]), for
    code that reads one stat by name off a connector (its tests, a debugger)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    def __getitem__(self, key: str) -> Any:
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)


_TIER_WHY = (
    "replicas may share one directory, each store indexing all of its files, so sums "
    "would count them twice; not merged yet"
)


def _tier(export: Export) -> Any:
    return stat(Merge.UNMERGED, export, why=_TIER_WHY)


@dataclass(frozen=True, kw_only=True)
class DiskTierStats(_ByKey):
    """The disk tier under the prefix cache (--kv-offload-dir), since start."""

    kv_offload_queried_blocks: int = _tier(
        AsGauge(
            "sluice_kv_offload_queried_blocks",
            "Prompt blocks looked up on the disk tier after a RAM prefix-cache miss (since start).",
        )
    )
    kv_offload_hit_blocks: int = _tier(
        AsGauge(
            "sluice_kv_offload_hit_blocks",
            "KV blocks loaded from the disk tier instead of recomputed (since start).",
        )
    )
    kv_offload_miss_blocks: int = _tier(
        AsGauge(
            "sluice_kv_offload_miss_blocks",
            "Prompt blocks missing in RAM and on the disk tier, so recomputed (since start).",
        )
    )
    kv_offload_hit_rate: float = _tier(
        AsGauge("sluice_kv_offload_hit_rate", "Disk-tier hits over lookups since start (0-1).")
    )
    kv_offload_loaded_tokens: int = _tier(NotExported("hit blocks times the block size"))
    kv_offload_files: int = _tier(
        AsGauge("sluice_kv_offload_files", "Block files on the disk tier.")
    )
    kv_offload_disk_bytes: int = _tier(
        AsGauge("sluice_kv_offload_disk_bytes", "Bytes of block files on disk.")
    )
    kv_offload_bytes_read: int = _tier(
        AsGauge(
            "sluice_kv_offload_read_bytes",
            "Payload bytes loaded from the disk tier (since start).",
        )
    )
    kv_offload_bytes_written: int = _tier(
        AsGauge(
            "sluice_kv_offload_written_bytes",
            "Bytes of block files written to the disk tier (since start).",
        )
    )
    kv_offload_files_written: int = _tier(NotExported("a debugging count: /stats only"))
    kv_offload_files_evicted: int = _tier(NotExported("a debugging count: /stats only"))
    kv_offload_corrupt_files: int = _tier(
        AsGauge(
            "sluice_kv_offload_corrupt_files",
            "Truncated, corrupt or foreign block files found and deleted (since start).",
        )
    )
    kv_offload_write_errors: int = _tier(
        AsGauge(
            "sluice_kv_offload_write_errors",
            "Block files that could not be written, e.g. a full disk (since start).",
        )
    )
    kv_offload_saves_dropped: int = _tier(NotExported("a debugging count: /stats only"))


_PD_DEBUG = NotExported("a transfer-debugging count: /stats only")


@dataclass(frozen=True, kw_only=True)
class PDPrefillStats(_ByKey):
    """A prefill instance's block server (--role prefill): what it holds and sent."""

    pd_held_transfers: int = stat(
        Merge.SUMMED,
        AsGauge(
            "sluice_pd_held_transfers",
            "Prompts whose blocks a prefill instance holds for a decode instance.",
        ),
    )
    pd_held_blocks: int = stat(
        Merge.SUMMED,
        AsGauge(
            "sluice_pd_held_blocks",
            "KV blocks a prefill instance holds for decode instances to pull (copies).",
        ),
    )
    pd_held_bytes: int = stat(Merge.SUMMED, _PD_DEBUG)
    pd_sent_transfers: int = stat(Merge.SUMMED, _PD_DEBUG)
    pd_expired_transfers: int = stat(
        Merge.SUMMED,
        AsGauge(
            "sluice_pd_expired_transfers",
            "Held prompts dropped because no decode instance pulled them in time (since start).",
        ),
    )
    pd_broken_transfers: int = stat(Merge.SUMMED, _PD_DEBUG)
    pd_refused_pulls: int = stat(Merge.SUMMED, _PD_DEBUG)
    pd_dropped_holds: int = stat(Merge.SUMMED, _PD_DEBUG)
    pd_bytes_sent: int = stat(Merge.SUMMED, _PD_DEBUG)


@dataclass(frozen=True, kw_only=True)
class PDDecodeStats(_ByKey):
    """A decode instance's pulls (--role decode)."""

    pd_pending_pulls: int = stat(Merge.SUMMED, _PD_DEBUG)
    pd_pulled_transfers: int = stat(Merge.SUMMED, _PD_DEBUG)
    pd_failed_transfers: int = stat(
        Merge.SUMMED,
        AsGauge(
            "sluice_pd_failed_transfers",
            "Pulls that failed, so the decode instance computed the prompt (since start).",
        ),
    )
    pd_loaded_blocks: int = stat(
        Merge.SUMMED,
        AsGauge(
            "sluice_pd_loaded_blocks",
            "KV blocks a decode instance pulled and loaded instead of computing (since start).",
        ),
    )
    pd_loaded_tokens: int = stat(Merge.SUMMED, _PD_DEBUG)
    pd_bytes_pulled: int = stat(Merge.SUMMED, _PD_DEBUG)
    pd_pull_seconds: float = stat(Merge.SUMMED, _PD_DEBUG)


# One KV connector at most is on; a new connector's stats join this union.
ConnectorStats = DiskTierStats | PDPrefillStats | PDDecodeStats


# ---- the engine's stats -----------------------------------------------------------------

_ONLY_STATS = NotExported("no gauge asked for so far: /stats only")
_CONFIG = NotExported("a fact of the configuration: /stats only")
_DRAFT_WHY = "the draft model's pool and passes, per replica; not merged yet"


# kw_only: the optional connector member sits among required fields, where /stats
# has always shown its keys.
@dataclass(frozen=True, kw_only=True)
class EngineStats:
    """One engine's stats since start; field order is /stats' key order."""

    num_running: int = stat(
        Merge.SUMMED, AsGauge("sluice_num_requests_running", "Requests being computed.")
    )
    num_waiting: int = stat(
        Merge.SUMMED, AsGauge("sluice_num_requests_waiting", "Requests waiting to be run.")
    )
    num_requests: int = stat(Merge.SUMMED, _ONLY_STATS)
    kv_total_blocks: int = stat(
        Merge.SUMMED, AsGauge("sluice_kv_cache_total_blocks", "KV cache blocks in total.")
    )
    kv_free_blocks: int = stat(
        Merge.SUMMED, AsGauge("sluice_kv_cache_free_blocks", "Free KV cache blocks.")
    )
    # A split cache's windowed layers' pool (0 with one pool).
    kv_local_total_blocks: int = stat(
        Merge.SUMMED,
        AsGauge(
            "sluice_kv_cache_local_total_blocks",
            "Blocks of the windowed layers' own pool (0 with one pool).",
        ),
    )
    kv_local_free_blocks: int = stat(
        Merge.SUMMED,
        AsGauge(
            "sluice_kv_cache_local_free_blocks",
            "Free blocks of the windowed layers' own pool (0 with one pool).",
        ),
    )
    kv_usage: float = stat(  # of the fuller pool
        Merge.DERIVED,
        AsGauge("sluice_kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)."),
        derive=_fuller_pool_usage,
    )
    kv_waste: float = stat(
        Merge.UNMERGED,
        _ONLY_STATS,
        why="a fraction of slot counts the stats do not carry, so not recomputable",
    )
    prefix_cache_hit_rate: float = stat(
        Merge.DERIVED,
        AsGauge(
            "sluice_prefix_cache_hit_rate",
            "Fraction of queried prompt tokens found in the prefix cache (0-1).",
        ),
        derive=_ratio_of("prefix_cache_hit_tokens", "prefix_cache_queried_tokens"),
    )
    prefix_cache_queried_tokens: int = stat(Merge.SUMMED, _ONLY_STATS)
    prefix_cache_hit_tokens: int = stat(Merge.SUMMED, _ONLY_STATS)
    num_preemptions: int = stat(Merge.SUMMED, _ONLY_STATS)
    num_steps: int = stat(Merge.SUMMED, _ONLY_STATS)
    num_generated_tokens: int = stat(
        Merge.SUMMED, NotExported("the server counts them itself: sluice_generation_tokens")
    )
    num_forced_tokens: int = stat(
        Merge.SUMMED,
        AsGauge(
            "sluice_structured_forced_tokens",
            "Output tokens a grammar forced, appended without a decode step each (since start).",
        ),
    )
    # Speculative decoding. A verify step is one request verifying its drafts in one
    # engine step; it emits its accepted drafts and the target's own token (fewer where
    # a stop ends the run), so emitted / verify steps is the mean accepted length.
    spec_method: str | None = stat(Merge.SHARED, NotExported("a string, None when off"))
    spec_drafted_tokens: int = stat(
        Merge.SUMMED,
        AsGauge(
            "sluice_spec_decode_num_draft_tokens",
            "Draft tokens verified by speculative decoding (since start).",
        ),
    )
    spec_accepted_tokens: int = stat(
        Merge.SUMMED,
        AsGauge(
            "sluice_spec_decode_num_accepted_tokens",
            "Draft tokens accepted by verification (since start).",
        ),
    )
    spec_emitted_tokens: int = stat(
        Merge.SUMMED,
        AsGauge(
            "sluice_spec_decode_num_emitted_tokens",
            "Tokens emitted by steps that verified drafts: accepted drafts and the "
            "target's own token (since start).",
        ),
    )
    spec_verify_steps: int = stat(
        Merge.SUMMED,
        AsGauge(
            "sluice_spec_decode_num_drafts",
            "Verifications: a request checking its drafts in one step (since start).",
        ),
    )
    spec_acceptance_rate: float = stat(
        Merge.DERIVED,
        AsGauge(
            "sluice_spec_decode_acceptance_rate",
            "Accepted over verified draft tokens since start (0-1; 0 before any).",
        ),
        derive=_ratio_of("spec_accepted_tokens", "spec_drafted_tokens"),
    )
    spec_mean_accepted_length: float = stat(
        Merge.DERIVED,
        AsGauge(
            "sluice_spec_decode_mean_accepted_length",
            "Tokens emitted per verification since start (1 when no draft passes; 0 before any).",
        ),
        derive=_ratio_of("spec_emitted_tokens", "spec_verify_steps"),
    )
    # The draft model's KV pool (0 without one) and its forward passes.
    spec_draft_kv_total_blocks: int = stat(Merge.UNMERGED, _ONLY_STATS, why=_DRAFT_WHY)
    spec_draft_kv_free_blocks: int = stat(Merge.UNMERGED, _ONLY_STATS, why=_DRAFT_WHY)
    spec_draft_forwards: int = stat(Merge.UNMERGED, _ONLY_STATS, why=_DRAFT_WHY)
    # The KV connector's stats, None without one: a group, whose annotation names the
    # stats dataclasses it may hold; their keys are flattened into /stats here.
    connector: ConnectorStats | None = field(default=None, metadata={_GROUP: True})
    grammars_compiled: int = stat(
        Merge.SUMMED,
        AsGauge(
            "sluice_structured_grammars_compiled",
            "Distinct constraints compiled by the grammar library (since start).",
        ),
    )
    # Mixture-of-Experts routing: the tokens each expert of each layer was given since
    # start, [layer][expert] (empty for a dense model), so a user can see routing skew.
    moe_expert_tokens: list[list[int]] = stat(  # noqa: RUF009 (a field(), as every stat)
        Merge.CELLWISE,
        PerLayerExpert(
            "sluice_moe_expert_tokens",
            "Tokens routed to each expert of each Mixture-of-Experts layer (since start).",
        ),
    )
    # LoRA adapters: slots holding one now and adapters copied into slots since start
    # (summed: each replica has its own slots), and each adapter's requests and
    # generated tokens since start, by name.
    lora_loaded_slots: int = stat(
        Merge.SUMMED,
        AsGauge("sluice_lora_loaded_slots", "LoRA slots holding an adapter (0 without LoRA)."),
    )
    lora_slot_loads: int = stat(
        Merge.SUMMED,
        AsGauge("sluice_lora_slot_loads", "LoRA adapters copied into a slot (since start)."),
    )
    lora_requests: dict[str, int] = stat(  # noqa: RUF009 (a field(), as every stat)
        Merge.KEYWISE,
        PerAdapter("sluice_lora_requests", "Requests run through each LoRA adapter (since start)."),
    )
    lora_generated_tokens: dict[str, int] = stat(  # noqa: RUF009 (a field(), as every stat)
        Merge.KEYWISE,
        PerAdapter(
            "sluice_lora_generated_tokens",
            "Tokens generated through each LoRA adapter (since start).",
        ),
    )
    block_size: int = stat(Merge.SHARED, _CONFIG)
    max_model_len: int = stat(Merge.SHARED, _CONFIG)
    dtype: str = stat(Merge.SHARED, AsLabel())
    quantization: str = stat(Merge.SHARED, AsLabel())
    kv_cache_dtype: str = stat(Merge.SHARED, AsLabel())
    cpu_kernels: str = stat(Merge.SHARED, AsLabel())
    # Summed: each replica holds its own copy of the weights.
    weight_bytes: int = stat(
        Merge.SUMMED,
        AsGauge(
            "sluice_weight_bytes",
            "Bytes of the model's weights as held in memory (quantized or dense).",
        ),
    )

    def as_dict(self) -> dict[str, Any]:
        """/stats' JSON: one flat dict, the connector's keys among the engine's."""
        return _flat(self)


# ---- what the front ends add --------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ReplicaStats:
    """One data-parallel replica's entry in /stats' `replicas`. The `mirrored` fields
    are copied from the replica's engine stats (their default while it is down)."""

    replica: int = exported(AsLabel())
    alive: bool = exported(
        AsGauge("sluice_replica_up", "1 while the replica serves, 0 while it restarts.")
    )
    pid: int | None = exported(NotExported("an id, not a measure"))
    restarts: int = exported(AsGauge("sluice_replica_restarts", "Times the replica was restarted."))
    load: int = exported(AsGauge("sluice_replica_load", "Requests in flight on the replica."))
    routed: int = exported(
        AsGauge("sluice_replica_requests_routed", "Requests routed to the replica.")
    )
    routed_by_prefix: int = exported(
        AsGauge(
            "sluice_replica_requests_routed_by_prefix",
            "Requests routed to the replica because it held part of their prompt.",
        )
    )
    num_running: int = exported(_ONLY_STATS, 0, mirrored=True)
    num_waiting: int = exported(_ONLY_STATS, 0, mirrored=True)
    num_requests: int = exported(_ONLY_STATS, 0, mirrored=True)
    num_generated_tokens: int = exported(_ONLY_STATS, 0, mirrored=True)
    kv_usage: float = exported(
        AsGauge("sluice_replica_kv_cache_usage_perc", "Replica's KV use (0-1)."),
        0.0,
        mirrored=True,
    )
    kv_free_blocks: int = exported(_ONLY_STATS, 0, mirrored=True)
    kv_total_blocks: int = exported(_ONLY_STATS, 0, mirrored=True)
    prefix_cache_hit_rate: float = exported(
        AsGauge(
            "sluice_replica_prefix_cache_hit_rate",
            "Fraction of the replica's queried prompt tokens found in its cache (0-1).",
        ),
        0.0,
        mirrored=True,
    )

    @classmethod
    def mirrored(cls, engine_stats: Mapping[str, Any]) -> dict[str, Any]:
        """The mirrored fields' values found in a replica's engine stats."""
        return {
            f.name: engine_stats[f.name]
            for f in dataclasses.fields(cls)
            if f.metadata[_MIRRORED] and f.name in engine_stats
        }

    def as_dict(self) -> dict[str, Any]:
        return _flat(self)


@dataclass(frozen=True, kw_only=True)
class FrontEndStats:
    """What a front end (AsyncLLM; DataParallelLLM and its merge) adds to the engine's
    stats. Each sets its own fields; a None field is left out of /stats."""

    data_parallel_size: int | None = exported(_CONFIG, None)
    # exported() makes a dataclasses.field: no default list is shared.
    replicas: list[dict[str, Any]] | None = exported(_PER_REPLICA, None)  # noqa: RUF009
    num_pending: int | None = exported(
        AsGauge("sluice_num_requests_pending", "Requests not yet taken by the loop."), None
    )
    num_step_errors: int | None = exported(_ONLY_STATS, None)
    num_resent_after_replica_death: int | None = exported(_ONLY_STATS, None)
    num_lost_to_replica_death: int | None = exported(_ONLY_STATS, None)
    engine_alive: bool | None = exported(NotExported("/health answers it"), None)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in _flat(self).items() if v is not None}


# ---- reading the declarations -----------------------------------------------------------


@dataclass(frozen=True)
class StatField:
    """One key of the stats, as declared."""

    key: str
    type: Any  # the resolved annotation
    merge: Merge | None  # None: a front end's field, made after the merge
    export: Export
    derive: Derive | None
    unmerged_why: str
    mirrored: bool
    group: type | None  # the connector stats class it belongs to; None: always there


def _flat(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not f.metadata.get(_GROUP):
            out[f.name] = value
        elif value is not None:
            out.update(_flat(value))
    return out


def _group_members(hint: Any) -> tuple[type, ...]:
    """The stats dataclasses a group's annotation names (None aside)."""
    return tuple(
        a for a in typing.get_args(hint) if isinstance(a, type) and dataclasses.is_dataclass(a)
    )


def _fields_of(cls: type, group: type | None = None) -> Iterator[StatField]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get(_GROUP):
            for member in _group_members(hints[f.name]):
                yield from _fields_of(member, member)
            continue
        meta = f.metadata
        yield StatField(
            key=f.name,
            type=hints[f.name],
            merge=meta.get(_MERGE),
            export=meta.get(_EXPORT, NotExported("")),  # "" : undeclared, caught by tests
            derive=meta.get(_DERIVE),
            unmerged_why=meta.get(_UNMERGED_WHY, ""),
            mirrored=meta.get(_MIRRORED, False),
            group=group,
        )


@functools.cache
def stat_fields(cls: type = EngineStats) -> tuple[StatField, ...]:
    """Every key `cls` declares, in /stats' order (a connector's keys where its member
    sits, each connector's in turn)."""
    return tuple(_fields_of(cls))
