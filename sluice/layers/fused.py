"""A decoder layer's elementwise steps, fused on CPU by our kernels when running eagerly.

A decode step multiplies one token's activations: torch's per-op overhead (a few
microseconds each, eight ops for one RMSNorm) then outweighs the arithmetic. Each
function here is one C++ call on CPU (sluice/kernels/csrc/fused_ops.cpp, bound in
sluice/kernels/fused.py) where the layout allows, and plain torch ops elsewhere: on
CUDA, without a compiler, and under torch.compile, which fuses the torch version itself.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from sluice import kernels
from sluice.kernels import Library
from sluice.kernels import fused as fused_kernels


def _lib(t: torch.Tensor) -> Library | None:
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
    # The kernel takes the weight in x's dtype, or fp32 beside bf16 (an encoder's norms).
    weight_ok = weight.dtype == x.dtype or (
        weight.dtype == torch.float32 and x.dtype == torch.bfloat16
    )
    if (
        lib is None
        or not weight_ok
        or dim > fused_kernels.max_dim(lib)  # the kernel's row buffer
        or not x.is_contiguous()
        or (residual is not None and not residual.is_contiguous())
    ):
        h = x if residual is None else residual + x
        out = F.rms_norm(h.float(), (dim,), weight.float(), eps).to(x.dtype)
        return out, h
    h, add = (x, None) if residual is None else (residual, x)
    out = fused_kernels.add_rms_norm(lib, add, h, weight, eps)
    return out, h


def rotate(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of qk [T, heads, head_dim] (rows may be strided slices);
    cos/sin [T, 1, head_dim / 2]. In place on the fused path."""
    lib = _lib(qk)
    d = qk.shape[2]
    if (
        lib is None
        or qk.stride(2) != 1
        or qk.stride(1) != d
        or cos.dtype != qk.dtype
        or not (cos.is_contiguous() and sin.is_contiguous())
    ):
        x1, x2 = qk.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return fused_kernels.rotary(lib, qk, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension."""
    inter = gate_up.shape[-1] // 2
    lib = _lib(gate_up)
    if lib is None or not gate_up.is_contiguous():
        gate, up = gate_up.split(inter, dim=-1)
        # Tensor.__mul__ is typed as returning Any in torch's stubs.
        return cast(torch.Tensor, F.silu(gate) * up)
    return fused_kernels.silu_and_mul(lib, gate_up)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation of gate_up = [gate | up]: the gate clamped above at
    `limit`, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate). Our
    kernel on the CPU (the decode stack's too, so both paths round alike), else torch in
    the reference's order of operations."""
    lib = _lib(gate_up)
    if lib is not None and gate_up.is_contiguous():
        return fused_kernels.clamped_swiglu(lib, gate_up, alpha, limit)
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up for gate_up = [gate | up] (GeGLU: Gemma).
    Plain torch ops: no model that runs it is on the fused decode path yet."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return cast(torch.Tensor, F.gelu(gate, approximate="tanh") * up)
