"""Host memory for the large tensors a model holds for its lifetime (weights, the KV
pool): anonymous mappings advised for transparent huge pages.

Why: a decode step streams every weight once, and with 4 KiB pages each 4 KiB of that
stream costs a TLB miss and the hardware prefetchers stop at every page boundary; the
same weights read faster from 2 MiB pages (benchmarks/huge_pages.py, its result in
docs/benchmarks.md). Most distributions leave THP at `madvise`, so memory from the
default allocator stays in 4 KiB pages unless asked."""

from __future__ import annotations

import contextlib
import math
import mmap

import numpy as np
import torch

HUGE_PAGE = 2 << 20
"""x86-64's and most arm64 kernels' transparent huge page size."""


def zeroed(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A zero-filled tensor. On the CPU, one of 2 MiB or more is an anonymous mapping
    whose start is 2 MiB-aligned and whose whole 2 MiB spans are advised for huge pages:
    the OS supplies zero pages lazily (a large KV pool costs no seconds at start-up and
    blocks never used take no memory), and the partial span at the end stays in 4 KiB
    pages, so no tensor takes more resident memory than its bytes."""
    device = torch.device(device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    # Room to move the start to a 2 MiB boundary; the slack is never touched, so never
    # resident.
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -int(np.frombuffer(buf, dtype=np.uint8, count=1).ctypes.data) % HUGE_PAGE
    with contextlib.suppress(OSError):  # THP off or unsupported: 4 KiB pages then
        buf.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    flat = torch.frombuffer(buf, dtype=torch.uint8)[start : start + nbytes]
    return flat.view(dtype).view(shape)


def copied(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t, in memory as `zeroed` gives it."""
    return zeroed(tuple(t.shape), t.dtype, t.device).copy_(t)
