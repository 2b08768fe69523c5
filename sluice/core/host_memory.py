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

import torch

HUGE_PAGE = 2 << 20
"""x86-64's and most arm64 kernels' transparent huge page size."""


def zeroed(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A zero-filled tensor. On the CPU, one of 2 MiB or more is an anonymous mapping
    whose whole 2 MiB spans are advised for huge pages: the OS supplies zero pages
    lazily (a large KV pool costs no seconds at start-up and blocks never used take no
    memory), and the partial span at the end stays in 4 KiB pages, so no tensor is
    resident beyond its bytes."""
    device = torch.device(device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    # A length in whole huge pages: Linux (6.7 on) then starts the mapping on a 2 MiB
    # boundary, so the advised spans are the huge pages. The rounding's slack is never
    # touched, so never resident.
    buf = mmap.mmap(
        -1, -(-nbytes // HUGE_PAGE) * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    )
    with contextlib.suppress(OSError):  # THP off or unsupported: 4 KiB pages then
        buf.madvise(mmap.MADV_HUGEPAGE, 0, nbytes // HUGE_PAGE * HUGE_PAGE)
    flat = torch.frombuffer(buf, dtype=torch.uint8)[:nbytes]
    return flat.view(dtype).view(shape)


def copied(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t, in memory as `zeroed` gives it."""
    return zeroed(tuple(t.shape), t.dtype, t.device).copy_(t)
