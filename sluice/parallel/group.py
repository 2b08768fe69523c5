"""A tensor-parallel group as the model sees it: this rank's place, an all-reduce and a
gather to rank 0, each counted and timed.

The process group is torch.distributed (gloo on CPU, nccl on CUDA); on a CPU host the
all-reduce and the gather go through shared memory instead where they can
(`shm.ShmCollectives`; SLUICE_TP_ALLREDUCE picks). The counters are what a test holds
the design's number of collectives per step to, and what the benchmark divides by.
"""

from __future__ import annotations

import datetime
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sluice.core.choices import TPAllReduce
from sluice.core.errors import TensorParallelError
from sluice.parallel.shm import DEFAULT_SLOT_BYTES, ShmCollectives, create_segment, shm_supported

logger = logging.getLogger("sluice")

# How long a rank waits for the others at a collective before the step fails. Long
# enough for a slow rank's prefill chunk; a dead rank is found sooner (gloo sees its
# socket close; the shm wait asks whether the workers live).
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class GroupSpec:
    """What every rank needs to join the group (pickled to the workers)."""

    world_size: int
    backend: str  # torch.distributed's: "gloo" or "nccl"
    allreduce: str  # "shm", "gloo" or "nccl"
    directory: str  # a private directory: the rendezvous file, the shm segment
    slot_bytes: int = DEFAULT_SLOT_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def init_method(self) -> str:
        return f"file://{os.path.join(self.directory, 'rendezvous')}"

    @property
    def shm_path(self) -> str:
        return os.path.join(self.directory, "allreduce")


def make_spec(
    world_size: int,
    device: torch.device,
    allreduce: TPAllReduce,
    slot_bytes: int = DEFAULT_SLOT_BYTES,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> GroupSpec:
    """Decide the collectives and create what the ranks meet in (rank 0, before the
    workers start). The segment lives in /dev/shm where there is one (memory, not disk)."""
    if device.type == "cuda":
        backend, chosen = "nccl", "nccl"
    else:
        backend = "gloo"
        chosen = "gloo" if allreduce == "gloo" or not shm_supported() else "shm"
        if allreduce == "shm" and chosen != "shm":
            logger.warning("SLUICE_TP_ALLREDUCE=shm needs /dev/shm on x86; using gloo")
    base = "/dev/shm" if chosen == "shm" else None
    directory = tempfile.mkdtemp(prefix="sluice-tp-", dir=base)
    spec = GroupSpec(world_size, backend, chosen, directory, slot_bytes, timeout_s)
    if chosen == "shm":
        create_segment(spec.shm_path, world_size, slot_bytes)
    return spec


@dataclass
class CollectiveStats:
    all_reduces: int = 0
    gathers: int = 0
    all_reduce_seconds: float = 0.0
    gather_seconds: float = 0.0


class TPGroup:
    """This rank's view of the group. Rank 0 is the engine's process; it alone keeps
    the gathered logits."""

    def __init__(self, spec: GroupSpec, rank: int, shm: ShmCollectives | None) -> None:
        self.spec = spec
        self.rank = rank
        self.world_size = spec.world_size
        self.shm = shm
        self.stats = CollectiveStats()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks (in place where it can be)."""
        t0 = time.perf_counter()
        try:
            if self.shm is not None:
                out = self.shm.all_reduce(x)
            elif x.dtype == torch.bfloat16 and self.spec.backend == "gloo":
                # gloo sums bf16 in bf16 pairwise in its own order; fp32 keeps every
                # rank's result the same and as precise as the shm path.
                wide = x.float()
                dist.all_reduce(wide)
                out = x.copy_(wide)
            else:
                dist.all_reduce(x)
                out = x
        except RuntimeError as exc:
            raise _group_error(exc) from exc
        self.stats.all_reduces += 1
        self.stats.all_reduce_seconds += time.perf_counter() - t0
        return out

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` (one shape on all ranks) concatenated along the last
        dimension at rank 0 (the vocabulary slices of the logits); None elsewhere."""
        t0 = time.perf_counter()
        x = x.contiguous()
        parts: list[torch.Tensor] | None = None
        try:
            if self.shm is not None:
                parts = self.shm.gather(x)
            else:
                if self.rank == 0:
                    parts = [torch.empty_like(x) for _ in range(self.world_size)]
                dist.gather(x, parts, dst=0)
        except RuntimeError as exc:
            raise _group_error(exc) from exc
        self.stats.gathers += 1
        self.stats.gather_seconds += time.perf_counter() - t0
        return None if parts is None else torch.cat(parts, dim=-1)

    def reset_stats(self) -> CollectiveStats:
        """The counts so far; counting starts again from zero."""
        stats, self.stats = self.stats, CollectiveStats()
        return stats

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.rank == 0:
            remove_spec_files(self.spec)


def _group_error(exc: RuntimeError) -> TensorParallelError:
    if isinstance(exc, TensorParallelError):
        return exc
    return TensorParallelError(f"a tensor-parallel collective failed (a rank died?): {exc}")


def join_group(spec: GroupSpec, rank: int, alive: Callable[[], bool] | None = None) -> TPGroup:
    """Join the process group as `rank` (blocks until every rank has joined). Rank 0
    then unlinks the shm segment: every rank has it open, and nothing is left behind
    in /dev/shm if a process dies later."""
    dist.init_process_group(
        spec.backend,
        init_method=spec.init_method,
        rank=rank,
        world_size=spec.world_size,
        timeout=datetime.timedelta(seconds=spec.timeout_s),
    )
    shm = None
    if spec.allreduce == "shm":
        shm = ShmCollectives(
            spec.shm_path, rank, spec.world_size, spec.slot_bytes, spec.timeout_s, alive
        )
    dist.barrier()  # every rank has the segment open
    if rank == 0 and shm is not None:
        os.unlink(spec.shm_path)
    return TPGroup(spec, rank, shm)


def remove_spec_files(spec: GroupSpec) -> None:
    """Delete the rendezvous directory (also after a failed start)."""
    for name in ("rendezvous", "allreduce"):
        try:
            os.unlink(os.path.join(spec.directory, name))
        except FileNotFoundError:
            pass
    try:
        os.rmdir(spec.directory)
    except OSError:
        pass
