"""Bindings of the panel-order K-quant weights (csrc/qpanel.cpp, layout in csrc/qpanel.h).

A Q4_K or Q6_K weight (integer scales) whose rows come in whole panels of 32 can be
stored in the order the int8 GEMM multiplies (`to_panels`): its five tensors keep their
shapes and hold the same values, permuted panel by panel, so it costs what the
row-major layout does. On it one kernel serves every row count: a step of one row and
one of hundreds run the same sums, nothing is unpacked but nibbles, and a group's scale
is applied once per 16 columns (AVX-512) or 8 (avx2). The sums are the int8 GEMM's
(equal to `qblock.qblock_gemm` on the row-major weight) where `gemm_sums` says so; at
avx2, which has no VNNI, a super-block's group scales are applied in int32 instead (exact
integer sums, one float step per 256 values). Only these kernels read a panel weight.
"""

from __future__ import annotations

import dataclasses

import torch

from sluice.core import host_memory
from sluice.core.quantized_tensor import SUPER, QuantizedTensor
from sluice.kernels._ffi import INT, POINTER, Library, c_function
from sluice.kernels.qblock import HEAD_FIRST_PANELS, run_experts, run_head, run_matmul, weight_args

# (bits, group) of the formats with a panel layout: Q4_K and Q6_K's.
FORMATS = frozenset({(4, 32), (6, 16)})
PANEL_ROWS = 32  # weight rows of a panel

_GEMM_SUMS = c_function("sluice_qpanel_gemm_sums", INT)
# (bits, group, packed, hbits, d, m, s, K, N, out_packed, out_hbits, out_d, out_m, out_s)
_REPACK = c_function(
    "sluice_qpanel_repack",
    INT,
    *(INT, INT, POINTER, POINTER, POINTER, POINTER, POINTER, INT, INT),
    *(POINTER, POINTER, POINTER, POINTER, POINTER),
)
# (x, bf16, M, K, bits, group, packed, hbits, d, m, s, N, y)
_MATMUL = c_function(
    "sluice_qpanel_matmul",
    None,
    *(POINTER, INT, INT, INT, INT, INT, POINTER, POINTER, POINTER, POINTER, POINTER, INT),
    POINTER,
)
# (x, bf16, M, K, bits, group, packed, hbits, d, m, s, N, num_groups, group_start,
#  group_expert, y)
_EXPERTS = c_function(
    "sluice_qpanel_experts",
    None,
    *(POINTER, INT, INT, INT, INT, INT, POINTER, POINTER, POINTER, POINTER, POINTER, INT),
    *(INT, POINTER, POINTER, POINTER),
)


def gemm_sums(lib: Library) -> bool:
    """Whether `lib`'s panel kernel computes the int8 GEMM's sums, bit for bit (else its
    own, from exact integer sums a super-block: avx2)."""
    return bool(_GEMM_SUMS(lib))


def can_panel(w: QuantizedTensor) -> bool:
    """Whether `w` has a panel layout: Q4_K or Q6_K with integer scales, whole panels."""
    rows, cols = w.shape
    return (
        not w.panels
        and (w.bits, w.group) in FORMATS
        and w.integer_scales
        and rows % PANEL_ROWS == 0
        and cols % SUPER == 0
    )


def to_panels(lib: Library, w: QuantizedTensor) -> QuantizedTensor:
    """w in panel order (new tensors of the same shapes; w is left as it was)."""
    if not can_panel(w):
        raise ValueError(
            f"no panel layout for a {w.source or f'{w.bits}-bit/{w.group}'} weight of shape "
            f"{w.shape} (Q4_K or Q6_K with integer scales, rows a multiple of {PANEL_ROWS})"
        )
    n, k, src = weight_args(*w.parts(), w.bits, w.group)
    # In memory as the loader holds weights (host_memory: huge pages, which the stream
    # of a decode step reads faster than 4 KiB ones).
    packed, hbits, scale, minimum, sup = (
        host_memory.zeroed(tuple(t.shape), t.dtype, t.device) for t in w.parts()
    )
    # The same layout, the same checks; empty parts (none for Q4_K's hbits) stay null.
    _, _, dst = weight_args(packed, hbits, scale, minimum, sup, w.bits, w.group)
    if _REPACK(lib, w.bits, w.group, *src, k, n, *dst):
        raise ValueError(f"the kernels have no panel layout for {w.bits} bits / {w.group}")
    return dataclasses.replace(
        w, packed=packed, hbits=hbits, scale=scale, minimum=minimum, super_scale=sup, panels=True
    )


def _check_panels(w: QuantizedTensor) -> None:
    if not w.panels:
        raise ValueError("qpanel kernels take a weight in panel order (to_panels)")


def qpanel_matmul(lib: Library, x: torch.Tensor, w: QuantizedTensor) -> torch.Tensor:
    """y [M, N] = x @ W.T in x's dtype (fp32 or bf16 [M, K]) for a panel weight, x
    quantized to int8 per 256 values; any M, each row's sums the same."""
    _check_panels(w)
    return run_matmul(_MATMUL, lib, x, *w.parts(), w.bits, w.group)


def qpanel_matmul_head(
    lib: Library, x: torch.Tensor, w: QuantizedTensor, row_norm: torch.Tensor
) -> torch.Tensor:
    """The output head (qblock.qblock_matmul_head) on a panel weight: the first int8
    level from the panel kernel (where gemm_sums, as first_level="gemm" has it), and
    each token that may be the greedy pick two-level, bit for bit the block kernel's on
    the row-major weight (its row rebuilt from the panel). row_norm: the row-major
    weight's row norms (block_quant.row_norms), one per row."""
    _check_panels(w)
    return run_head(lib, x, (*w.parts(), w.bits, w.group), row_norm, HEAD_FIRST_PANELS)


def qpanel_experts(
    lib: Library,
    x: torch.Tensor,  # [M, K]: the (token, expert) pairs' rows, by group
    w: QuantizedTensor,  # E experts' weights stacked, [E * N, K], in panel order
    num_experts: int,
    group_start: torch.Tensor,  # [G + 1] int64: group j is rows group_start[j] .. [j + 1]
    group_expert: torch.Tensor,  # [G] int64: group j's expert
) -> torch.Tensor:
    """y [M, N]: each group's rows @ W_e.T (qblock.qblock_matmul_experts on panels), the
    activations quantized once for all groups; only the named experts are read."""
    _check_panels(w)
    rows, k, weight = weight_args(*w.parts(), w.bits, w.group)
    if num_experts < 1 or rows % num_experts or (rows // num_experts) % PANEL_ROWS:
        raise ValueError(f"{rows} weight rows do not split into {num_experts} experts of panels")
    groups = (num_experts, group_start, group_expert)
    return run_experts(_EXPERTS, lib, x, rows, k, weight, w.bits, w.group, *groups)
