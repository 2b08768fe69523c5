"""All-reduce and gather between the tensor-parallel ranks of one host through shared
memory, synchronised by sequence numbers in the same mapping rather than by gloo.

Why: a decode step all-reduces two small tensors per layer (a few KiB each). gloo moves
each through loopback TCP, with its syscalls and wake-ups on both sides; here a rank
copies its part into its own slot of a mapping every rank has open, publishes a
sequence number, spins until every rank's number has caught up, and sums the slots.
That is vLLM's CPU backend's idea (its C++ shm all-reduce), in torch and numpy.

Layout: one 64-byte line per rank holding its int64 sequence number (own cache line, so
spinning readers do not slow the writer), then per rank two data slots of `slot_bytes`.
Operation s uses slot s % 2: a rank overwrites a slot at s + 2 only after it saw every
rank reach s + 1, and a rank publishes s + 1 only after it finished reading s, so a slot
is never rewritten while someone reads it. A tensor larger than a slot goes through in
slot-sized pieces, one operation each.

Ordering: data is written before the flag and read after it. x86 keeps stores in order
and loads in order (TSO), which this relies on; a weakly ordered CPU (ARM) would need
fences, so `shm_supported()` says no there and gloo is used.
"""

from __future__ import annotations

import mmap
import os
import platform
import time
from collections.abc import Callable

import numpy as np
import torch

from sluice.core.errors import TensorParallelError

FLAG_LINE = 64  # bytes per rank's sequence number: one cache line
DEFAULT_SLOT_BYTES = 4 << 20  # a 2048-token prefill of hidden 896 in fp32 is 7 MiB: 2 pieces
_SPINS_PER_CHECK = 4096  # spins between looks at the clock and the other ranks' liveness


def shm_supported() -> bool:
    """Whether this host can run the shared-memory collectives: /dev/shm exists and the
    CPU orders stores and loads as the protocol assumes (x86)."""
    return os.path.isdir("/dev/shm") and platform.machine().lower() in ("x86_64", "amd64")


def segment_bytes(world_size: int, slot_bytes: int) -> int:
    return FLAG_LINE * world_size + 2 * world_size * slot_bytes


def create_segment(path: str, world_size: int, slot_bytes: int) -> None:
    """Create the zero-filled mapping file (rank 0, before the workers start)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, segment_bytes(world_size, slot_bytes))
    finally:
        os.close(fd)


class ShmCollectives:
    """One rank's end of the shared segment at `path` (created by `create_segment`)."""

    def __init__(
        self,
        path: str,
        rank: int,
        world_size: int,
        slot_bytes: int,
        timeout_s: float,
        alive: Callable[[], bool] | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        # Rank 0 asks whether the worker processes still live: a dead peer is an error
        # at once, not after the timeout.
        self.alive = alive
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, segment_bytes(world_size, slot_bytes))
        finally:
            os.close(fd)
        words = np.frombuffer(self._map, dtype=np.int64, count=world_size * FLAG_LINE // 8)
        self._flags = words.reshape(world_size, FLAG_LINE // 8)[:, 0]
        data = torch.frombuffer(self._map, dtype=torch.uint8, offset=FLAG_LINE * world_size).view(
            world_size, 2, slot_bytes
        )
        self._slots = data
        self._seq = 0

    def _publish(self, chunk: torch.Tensor) -> int:
        """Put `chunk` (flat, contiguous) in this rank's next slot, announce it and wait
        for every rank to have done the same; the slot's index."""
        self._seq += 1
        slot = self._seq % 2
        nbytes = chunk.numel() * chunk.element_size()
        self._slots[self.rank, slot, :nbytes].copy_(chunk.view(torch.uint8))
        self._flags[self.rank] = self._seq
        self._wait(self._seq)
        return slot

    def _wait(self, seq: int) -> None:
        flags = self._flags
        deadline = 0.0
        spins = 0
        while flags.min() < seq:
            spins += 1
            if spins % 64 == 0:
                os.sched_yield()  # let a rank that shares this core finish its part
            if spins % _SPINS_PER_CHECK:
                continue
            now = time.monotonic()
            deadline = deadline or now + self.timeout_s
            late = [r for r in range(self.world_size) if flags[r] < seq]
            if self.alive is not None and not self.alive():
                raise TensorParallelError(f"tensor-parallel rank(s) {late} died mid-step")
            if now > deadline:
                raise TensorParallelError(
                    f"tensor-parallel rank(s) {late} did not reach the shared-memory "
                    f"collective within {self.timeout_s:.0f}s"
                )

    def _pieces(self, flat: torch.Tensor) -> range:
        return range(0, flat.numel(), self.slot_bytes // flat.element_size())

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; every rank gets the same bits (the slots
        are added in rank order, bf16 in an fp32 accumulator)."""
        in_place = x.is_contiguous()  # else the sums go to a copy, written back at the end
        flat = x.view(-1) if in_place else x.contiguous().view(-1)
        step = self.slot_bytes // flat.element_size()
        for start in self._pieces(flat):
            part = flat[start : start + step]
            nbytes = part.numel() * part.element_size()
            slot = self._publish(part)
            views = [self._slots[r, slot, :nbytes].view(x.dtype) for r in range(self.world_size)]
            if x.dtype == torch.float32:
                torch.add(views[0], views[1], out=part)
                for v in views[2:]:
                    part.add_(v)
            else:
                acc = views[0].float()
                for v in views[1:]:
                    acc.add_(v.float())
                part.copy_(acc)
        if not in_place:
            x.copy_(flat.view(x.shape))
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `x` (all of one shape) at rank 0, in rank order; None elsewhere."""
        flat = x.contiguous().view(-1)
        outs = [torch.empty_like(flat) for _ in range(self.world_size)] if self.rank == 0 else []
        step = self.slot_bytes // flat.element_size()
        for start in self._pieces(flat):
            part = flat[start : start + step]
            nbytes = part.numel() * part.element_size()
            slot = self._publish(part)
            for r, out in enumerate(outs):
                out[start : start + part.numel()].copy_(self._slots[r, slot, :nbytes].view(x.dtype))
        return [o.view(x.shape) for o in outs] if self.rank == 0 else None

    def close(self) -> None:
        # The views into the mapping must go before it can close.
        del self._flags, self._slots
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still referenced somewhere; the OS unmaps at exit
