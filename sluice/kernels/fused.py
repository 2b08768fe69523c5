"""Bindings of the fused elementwise ops (csrc/fused_ops.cpp): RMSNorm with the residual
add, rotary embedding, SiLU-and-multiply, Mixture-of-Experts routing. fp32 or bf16, one
C++ call each.

The layout checks (contiguity, dtypes, the row limit) are the caller's, in
`sluice.layers.fused`, which falls back to torch where they fail.
"""

from __future__ import annotations

import torch

from sluice.kernels._ffi import (
    FLOAT,
    INT,
    INT64,
    POINTER,
    Library,
    c_function,
    is_bf16,
    ptr,
    ptr_or_null,
)

_MAX_DIM = c_function("sluice_fused_max_dim", INT)
# bf16, x (may be null), residual, weight, out, rows, dim, eps
_ADD_RMS_NORM = c_function(
    "sluice_add_rms_norm", None, INT, POINTER, POINTER, POINTER, POINTER, INT64, INT, FLOAT
)
# x (bf16, may be null), residual (bf16), weight (fp32), out, rows, dim, eps
_ADD_RMS_NORM_F32_WEIGHT = c_function(
    "sluice_add_rms_norm_f32_weight", None, POINTER, POINTER, POINTER, POINTER, INT64, INT, FLOAT
)
# bf16, x, rows, row stride, heads, head_dim, cos, sin
_ROTARY = c_function("sluice_rotary", None, INT, POINTER, INT64, INT64, INT, INT, POINTER, POINTER)
# bf16, gate_up, out, rows, inter
_SILU_AND_MUL = c_function("sluice_silu_and_mul", None, INT, POINTER, POINTER, INT64, INT)
# bf16, gate_up, out, rows, inter, alpha, limit
_CLAMPED_SWIGLU = c_function(
    "sluice_clamped_swiglu", None, INT, POINTER, POINTER, INT64, INT, FLOAT, FLOAT
)
# bf16, x, rows, hidden, router, router bias (may be null), experts, k, renormalize,
# softmax_after_top_k, weights, ids
_MOE_ROUTE = c_function(
    "sluice_moe_route",
    None,
    *(INT, POINTER, INT, INT, POINTER, POINTER, INT, INT, INT, INT, POINTER, POINTER),
)


def max_dim(lib: Library) -> int:
    """The longest row the RMSNorm kernel takes (its row buffer)."""
    return int(_MAX_DIM(lib))


def add_rms_norm(
    lib: Library,
    x: torch.Tensor | None,  # [..., dim] added into the residual first; None: no add
    residual: torch.Tensor,  # [..., dim] contiguous; updated in place when x is given
    weight: torch.Tensor,  # [dim], residual's dtype, or fp32 beside bf16 rows
    eps: float,
) -> torch.Tensor:
    """norm(residual (+ x)) * weight, a new tensor; residual += x in place."""
    dim = residual.shape[-1]
    out = torch.empty_like(residual)
    if weight.dtype != residual.dtype:
        assert weight.dtype == torch.float32 and is_bf16(residual), "fp32 weights, bf16 rows"
        _ADD_RMS_NORM_F32_WEIGHT(
            lib, ptr_or_null(x), ptr(residual), ptr(weight), ptr(out), residual.numel() // dim,
            dim, eps,
        )  # fmt: skip
        return out
    _ADD_RMS_NORM(
        lib,
        is_bf16(residual),
        ptr_or_null(x),
        ptr(residual),
        ptr(weight),
        ptr(out),
        residual.numel() // dim,
        dim,
        eps,
    )
    return out


def rotary(
    lib: Library,
    qk: torch.Tensor,  # [T, heads, head_dim], heads contiguous; rows may be strided
    cos: torch.Tensor,  # [T, 1, head_dim / 2] contiguous, qk's dtype
    sin: torch.Tensor,
) -> torch.Tensor:
    """Rotate qk in place (and return it)."""
    t, heads, d = qk.shape
    _ROTARY(lib, is_bf16(qk), ptr(qk), t, qk.stride(0), heads, d, ptr(cos), ptr(sin))
    return qk


def silu_and_mul(lib: Library, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] (contiguous) along the last dimension."""
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    _SILU_AND_MUL(
        lib, is_bf16(gate_up), ptr(gate_up), ptr(out), gate_up.numel() // (2 * inter), inter
    )
    return out


def clamped_swiglu(lib: Library, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's (up + 1) * gate * sigmoid(alpha * gate), the gate clamped above at limit
    and up to [-limit, limit], for gate_up = [gate | up] (contiguous); the decode stack
    runs the same compiled code."""
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    rows = gate_up.numel() // (2 * inter)
    _CLAMPED_SWIGLU(lib, is_bf16(gate_up), ptr(gate_up), ptr(out), rows, inter, alpha, limit)
    return out


def moe_route(
    lib: Library,
    x: torch.Tensor,  # [T, hidden] contiguous, fp32 or bf16
    router: torch.Tensor,  # [E, hidden] fp32 contiguous
    top_k: int,
    renormalize: bool,
    bias: torch.Tensor | None = None,  # [E] fp32 (gpt-oss)
    softmax_after_top_k: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k] int64): a softmax of x @ router.T (+ bias,
    in fp32) over the experts, its k largest (largest first), renormalized to sum 1 where
    asked; or, where softmax_after_top_k, the k largest logits and a softmax over them.
    The decode stack routes with the same compiled code."""
    t, hidden = x.shape
    weights = torch.empty(t, top_k, dtype=torch.float32)
    ids = torch.empty(t, top_k, dtype=torch.int64)
    _MOE_ROUTE(
        lib,
        is_bf16(x),
        ptr(x),
        t,
        hidden,
        ptr(router),
        ptr_or_null(bias),
        router.shape[0],
        top_k,
        int(renormalize),
        int(softmax_after_top_k),
        ptr(weights),
        ptr(ids),
    )
    return weights, ids
