"""A decoder layer's elementwise steps, fused on CPU by our kernels when running eagerly.

A decode step multiplies one token's activations: torch's per-op overhead (a few
microseconds each, eight ops for one RMSNorm) then outweighs the arithmetic. Each
function here is one C++ call on CPU (sluice/kernels/csrc/fused_ops.cpp) and plain torch
ops elsewhere: on CUDA, without a compiler, and under torch.compile, which fuses the
torch version itself.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from sluice import kernels


def _lib(t: torch.Tensor) -> ctypes.CDLL | None:
    if (
        t.device.type != "cpu"
        or t.dtype not in (torch.float32, torch.bfloat16)
        or torch.compiler.is_compiling()
    ):
        return None
    return kernels.load()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(h) * weight, h) with h = residual + x, or h = x without a residual.

    On the fused path the residual tensor is updated in place."""
    lib = _lib(x)
    dim = x.shape[-1]
    if (
        lib is None
        or weight.dtype != x.dtype
        or dim > lib.sluice_fused_max_dim()  # the kernel's row buffer
        or not x.is_contiguous()
        or (residual is not None and not residual.is_contiguous())
    ):
        h = x if residual is None else residual + x
        out = F.rms_norm(h.float(), (dim,), weight.float(), eps).to(x.dtype)
        return out, h
    out = torch.empty_like(x)
    h, add = (x, None) if residual is None else (residual, x)
    lib.sluice_add_rms_norm(
        int(x.dtype == torch.bfloat16),
        None if add is None else add.data_ptr(),
        h.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.numel() // dim,
        dim,
        ctypes.c_float(eps),
    )
    return out, h


def rotate(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of qk [T, heads, head_dim] (rows may be strided slices);
    cos/sin [T, 1, head_dim / 2]. In place on the fused path."""
    lib = _lib(qk)
    t, heads, d = qk.shape
    if (
        lib is None
        or qk.stride(2) != 1
        or qk.stride(1) != d
        or cos.dtype != qk.dtype
        or not (cos.is_contiguous() and sin.is_contiguous())
    ):
        x1, x2 = qk.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    lib.sluice_rotary(
        int(qk.dtype == torch.bfloat16),
        qk.data_ptr(),
        t,
        qk.stride(0),
        heads,
        d,
        cos.data_ptr(),
        sin.data_ptr(),
    )
    return qk


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension."""
    inter = gate_up.shape[-1] // 2
    lib = _lib(gate_up)
    if lib is None or not gate_up.is_contiguous():
        gate, up = gate_up.split(inter, dim=-1)
        return F.silu(gate) * up
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    lib.sluice_silu_and_mul(
        int(gate_up.dtype == torch.bfloat16),
        gate_up.data_ptr(),
        out.data_ptr(),
        gate_up.numel() // (2 * inter),
        inter,
    )
    return out
