"""Binding of the GGUF block repack (csrc/gguf_repack.cpp): a GGUF tensor's raw blocks
written into the qblock layout (sluice/core/quantized_tensor.py) in one pass, byte for
byte what sluice/loader/gguf_blocks.py's torch path writes, in a fraction of that
path's time (which was most of a 7B file's load)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sluice.kernels._ffi import INT, INT64, POINTER, Library, c_function, ptr

# The formats it writes, by the code the C function takes (its `Format` enum).
FORMAT_CODES = {
    name: code
    for code, name in enumerate(
        ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
    )
}

# (raw, format, rows, cols, packed, hbits, scale, minimum, super)
_REPACK = c_function("sluice_gguf_repack", INT, POINTER, INT, INT64, INT, *(POINTER,) * 5)


def gguf_repack(
    lib: Library,
    raw: torch.Tensor,
    type_name: str,
    cols: int,
    outputs: Sequence[torch.Tensor],
) -> None:
    """raw (uint8, contiguous: rows of blocks of `type_name`) into `outputs`: packed,
    hbits, scale, minimum and super_scale rows, each contiguous, preallocated in the
    layout's shapes and dtypes for raw's rows (an empty tensor where the format has
    no such part)."""
    if type_name not in FORMAT_CODES:
        raise ValueError(f"no repack for {type_name}")
    if len(outputs) != 5:
        raise ValueError("outputs: packed, hbits, scale, minimum and super_scale")
    packed = outputs[0]
    if raw.dtype != torch.uint8 or not raw.is_contiguous():
        raise ValueError("raw must be contiguous uint8")
    if not all(t.is_contiguous() for t in outputs):
        raise ValueError("the outputs must be contiguous")
    rows = packed.shape[0]
    code = _REPACK(lib, ptr(raw), FORMAT_CODES[type_name], rows, cols, *map(ptr, outputs))
    if code == -2:
        raise ValueError(f"{type_name} block scale beyond float16's range (above 2**15)")
    if code != 0:
        raise ValueError(f"no repack for {type_name}")
