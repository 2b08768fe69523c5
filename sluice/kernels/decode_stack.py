"""Bindings of the one-call decoder stack (csrc/decode_stack.cpp), and its per-layer
pointer table.

The table's fields are defined once, in csrc/decode_stack_fields.h; the library reports
their names in order (`field_names`). A caller fills each layer as a mapping from those
names to tensors, and `LayerTable` orders it by the library's names, so a field that is
added, removed or moved on the C++ side cannot shift the table silently: a name the
caller does not fill, or one the library does not know, is an error. A field is a
tensor (its address), None (null) or an int stored as is (a linear's format, a
layer's window).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch

from sluice.kernels._ffi import (
    FLOAT,
    INT,
    INT64,
    POINTER,
    STRING,
    Library,
    c_function,
    is_bf16,
    ptr,
    ptr_or_null,
)

_FIELDS = c_function("sluice_decode_stack_fields", INT)
_FIELD = c_function("sluice_decode_stack_field", STRING, INT)
_DECODE_STACK = c_function(
    "sluice_decode_stack",
    None,
    # bf16, the layer table
    *(INT, POINTER),
    # layers, hidden, heads, kv_heads, head_dim, inter, block_size, eps, scale
    *(INT, INT, INT, INT, INT, INT, INT, FLOAT, FLOAT),
    # h, cos, sin, rows
    *(POINTER, POINTER, POINTER, INT),
    # slots, block tables, max_blocks, query_start, ctx_end, seqs, kv_int8
    *(POINTER, POINTER, INT64, POINTER, POINTER, INT, INT),
    # qk_norm, experts, top_k, moe_inter, renormalize
    *(INT, INT, INT, INT, INT),
    # lora_slots, lora_rank, residual_scale, gemm_min_rows, gemm_tiles
    *(POINTER, INT, FLOAT, INT, INT),
    # softmax_after_top_k, swiglu_alpha, swiglu_limit
    *(INT, FLOAT, FLOAT),
)


# A field's value: a tensor's address, null, or an integer such as a linear's format.
Field: TypeAlias = torch.Tensor | int | None

# A linear's format field (csrc/decode_stack_fields.h): which kernel reads its weight.
FORMAT_INT4 = 4  # the int4 kernel (q4_matmul)
FORMAT_INT8 = 8  # the per-channel int8 kernel (q8_matmul)
FORMAT_PANELS = 10000  # added to a qblock format: a weight in panel order (qpanel)

# The stack's qk_norm argument (csrc/decode_stack.cpp's QkNorm).
QK_NORM_NONE = 0
QK_NORM_PER_HEAD = 1  # each q and k head (Qwen3)
QK_NORM_WHOLE = 2  # the whole q and the whole k projection (OLMoE)


def qblock_format(bits: int, group: int, panels: bool = False) -> int:
    """The format field of a qblock weight (csrc/qblock.h), or of one in panel order
    (csrc/qpanel.h)."""
    return bits * 100 + group + (FORMAT_PANELS if panels else 0)


def field_names(lib: Library) -> tuple[str, ...]:
    """The names of a layer's fields, in the order the library reads them."""
    names = []
    for i in range(int(_FIELDS(lib))):
        name: bytes | None = _FIELD(lib, i)
        assert name is not None, f"the library names no field {i}"
        names.append(name.decode())
    return tuple(names)


class LayerTable:
    """Every layer's fields as int64 pointers, [layers, fields], in the library's order.

    It holds the tensors it points to, so none of them is freed while the table lives.
    """

    def __init__(self, lib: Library, layers: Sequence[Mapping[str, Field]]) -> None:
        self.names = field_names(lib)
        known = set(self.names)
        self.tensors: list[list[Field]] = []
        for i, layer in enumerate(layers):
            unknown, missing = set(layer) - known, known - set(layer)
            if unknown or missing:
                raise ValueError(
                    f"decode stack layer {i}: fields the library does not know "
                    f"{sorted(unknown)}, fields it needs that are not filled {sorted(missing)}"
                )
            self.tensors.append([layer[name] for name in self.names])
        rows = [[t if isinstance(t, int) else ptr_or_null(t) for t in row] for row in self.tensors]
        self.pointers = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), len(self.names))


@dataclass(frozen=True)
class StackShape:
    """The model's sizes, as the stack takes them."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    block_size: int
    eps: float
    scale: float  # of the attention scores
    kv_int8: bool = False  # the K/V pools hold int8 rows (sluice/attention/kv_int8.py)
    qk_norm: int = QK_NORM_NONE
    # Mixture-of-Experts layers (a router in their fields): experts (0: none), chosen
    # per row, each expert's intermediate size, the top k's weights renormalized.
    experts: int = 0
    top_k: int = 0
    moe_inter: int = 0
    renormalize: bool = False
    # The k largest logits, then a softmax over those (Granite-MoE, gpt-oss).
    softmax_after_top_k: bool = False
    # The experts' activation: gpt-oss's clamped SwiGLU where swiglu_limit > 0, else SiLU.
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    # The LoRA slots' rank per slice (sluice/layers/lora.py); 0 without LoRA.
    lora_rank: int = 0
    # Each sublayer's output times this before it joins the residual stream (Granite's
    # residual_multiplier; 1.0: none).
    residual_scale: float = 1.0
    # Rows from which qblock linears, and experts by their own rows, take the int8 GEMM
    # as the eager layers do (block_quant.GEMM_MIN_ROWS); 0: never.
    gemm_min_rows: int = 0
    # That GEMM on AMX-INT8 tiles (csrc/qblock_gemm_amx.h), as eager runs it where
    # kernels.tiles() (the amx level); the same sums as the VNNI GEMM.
    gemm_tiles: bool = False


def decode_stack(
    lib: Library,
    table: LayerTable,
    shape: StackShape,
    h: torch.Tensor,  # [rows, hidden] contiguous: the embeddings in, the output out
    cos: torch.Tensor,  # [rows, head_dim / 2] contiguous, h's dtype
    sin: torch.Tensor,
    slots: torch.Tensor,  # [rows] int64: each new token's cache slot
    block_tables: torch.Tensor,  # [S, max_blocks] int64, contiguous
    query_start: torch.Tensor,  # [S + 1] int64
    ctx_end: torch.Tensor,  # [S] int64
    lora_slots: torch.Tensor | None = None,  # [rows] int32: each row's LoRA slot, -1: none
) -> torch.Tensor:
    """Run every layer on h, in place: h becomes the stack's output (before the final
    norm), which is returned. With lora_slots, each adapted linear adds each row's
    adapter product (the layers' slots are in the table)."""
    _DECODE_STACK(
        lib,
        is_bf16(h),
        ptr(table.pointers),
        shape.layers,
        shape.hidden,
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
        shape.inter,
        shape.block_size,
        shape.eps,
        shape.scale,
        ptr(h),
        ptr(cos),
        ptr(sin),
        h.shape[0],
        ptr(slots),
        ptr(block_tables),
        block_tables.shape[1],
        ptr(query_start),
        ptr(ctx_end),
        block_tables.shape[0],
        int(shape.kv_int8),
        shape.qk_norm,
        shape.experts,
        shape.top_k,
        shape.moe_inter,
        int(shape.renormalize),
        ptr_or_null(lora_slots),
        shape.lora_rank,
        shape.residual_scale,
        shape.gemm_min_rows,
        int(shape.gemm_tiles),
        int(shape.softmax_after_top_k),
        shape.swiglu_alpha,
        shape.swiglu_limit,
    )
    return h
