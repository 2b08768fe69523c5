"""Tensor parallelism's communication: the group each rank's model all-reduces and
gathers through (torch.distributed, or shared memory on one CPU host)."""

from sluice.parallel.group import (
    CollectiveStats,
    GroupSpec,
    TPGroup,
    join_group,
    make_spec,
    remove_spec_files,
)
from sluice.parallel.shm import ShmCollectives, create_segment, shm_supported

__all__ = [
    "CollectiveStats",
    "GroupSpec",
    "ShmCollectives",
    "TPGroup",
    "create_segment",
    "join_group",
    "make_spec",
    "remove_spec_files",
    "shm_supported",
]
