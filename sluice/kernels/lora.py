"""Bindings of the LoRA shrink and expand (csrc/lora.h): each row of a step gathers its
own adapter's matrices by its slot index, so one call serves a batch that mixes
adapters and rows without one.

The layout checks (contiguity, dtypes) are the caller's, in `sluice.layers.lora`,
which runs torch ops where they fail.
"""

from __future__ import annotations

import torch

from sluice.kernels._ffi import (
    INT,
    INT64,
    POINTER,
    Library,
    c_function,
    is_bf16,
    ptr,
    ptr_or_null,
)

# B^T is stored in tiles of this many columns, each tile's rank rows one after another
# (csrc/lora.h's kLoraTile, which `tile_columns` reads back; a test compares them).
TILE_COLUMNS = 64

_TILE_COLUMNS = c_function("sluice_lora_tile_columns", INT)
# bf16, x, rows, in_dim, a, scale, r_total, rank, slots, ranks, u
_SHRINK = c_function("sluice_lora_shrink", None, INT, POINTER, INT64, INT, POINTER, POINTER, INT,
                     INT, POINTER, POINTER, POINTER)  # fmt: skip
# bf16, u, rows, rank, n_slices, offsets, bt, bt_int8, out_dim, slots, ranks, y
_EXPAND = c_function(
    "sluice_lora_expand", None, INT, POINTER, INT64, INT, INT, POINTER, POINTER, INT, INT,
    POINTER, POINTER, POINTER,
)  # fmt: skip


def tile_columns(lib: Library) -> int:
    """The library's tile width of B^T (TILE_COLUMNS, as compiled)."""
    return int(_TILE_COLUMNS(lib))


def shrink(
    lib: Library,
    x: torch.Tensor,  # [rows, in] contiguous, fp32 or bf16
    a: torch.Tensor,  # [slots, slices * rank, in], x's dtype or int8
    scale: torch.Tensor | None,  # int8 A: [slots, slices * rank] fp32, u's factors
    rank: int,  # rows of A per slice
    slots: torch.Tensor,  # [rows] int32, -1: no adapter
    ranks: torch.Tensor,  # [slots] int32: the rows of each slice a slot uses
) -> torch.Tensor:
    """u [rows, slices * rank] fp32: each row times its slot's A, times `scale` where A
    is int8 (zeros where the slot is -1 and past the slot's rank: A's zero padding is
    not read)."""
    rows, in_dim = x.shape
    r_total = a.shape[1]
    u = torch.zeros(rows, r_total, dtype=torch.float32)  # the kernel skips rows at -1
    _SHRINK(
        lib, is_bf16(x), ptr(x), rows, in_dim, ptr(a), ptr_or_null(scale), r_total, rank,
        ptr(slots), ptr(ranks), ptr(u),
    )  # fmt: skip
    return u


def expand(
    lib: Library,
    u: torch.Tensor,  # [rows, n_slices * rank] fp32 (shrink's)
    bt: torch.Tensor,  # [slots, tiles, rank, TILE_COLUMNS], y's dtype or int8 (scales in u)
    offsets: torch.Tensor,  # [n_slices + 1] int32: each slice's first output column
    slots: torch.Tensor,  # [rows] int32
    ranks: torch.Tensor,  # [slots] int32
    y: torch.Tensor,  # [rows, out] contiguous: updated in place
) -> None:
    """y[t, slice j] += u[t, slice j's ranks] @ bt[slot(t)][:, slice j], in place."""
    rows, out_dim = y.shape
    rank = bt.shape[2]
    n_slices = offsets.numel() - 1
    _EXPAND(
        lib, is_bf16(y), ptr(u), rows, rank, n_slices, ptr(offsets), ptr(bt),
        int(bt.dtype == torch.int8), out_dim, ptr(slots), ptr(ranks), ptr(y),
    )  # fmt: skip
