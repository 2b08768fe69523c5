"""Bindings of the weight-only matmuls (csrc/q4_matmul.cpp, csrc/q8_matmul.cpp): int4 or
int8 weights times int8-quantized activations (or, for the output head, unquantized
ones), for a few rows.

The weight layouts are made by `sluice.layers.quantization`; the kernels take fp32 or
bf16 activations whose row length (K) is a multiple of 64.
"""

from __future__ import annotations

import torch

from sluice.kernels._ffi import INT, POINTER, CFunction, Library, c_function, is_bf16, ptr

# All share one shape: (x, bf16, M, K, packed weight, its scale tensors..., N, y).
_Q4_MATMUL = c_function(
    "sluice_q4_matmul", None, POINTER, INT, INT, INT, POINTER, POINTER, POINTER, INT, POINTER
)
_Q8_MATMUL = c_function(
    "sluice_q8_matmul", None, POINTER, INT, INT, INT, POINTER, POINTER, INT, POINTER
)


_Q8_MATMUL_FLOAT = c_function(
    "sluice_q8_matmul_float", None, POINTER, INT, INT, INT, POINTER, POINTER, INT, POINTER
)


def _weight_only_matmul(
    fn: CFunction, lib: Library, x: torch.Tensor, packed: torch.Tensor, *weights: torch.Tensor
) -> torch.Tensor:
    x = x.contiguous()
    m, n = x.shape[0], packed.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    fn(lib, ptr(x), is_bf16(x), m, x.shape[1], ptr(packed), *map(ptr, weights), n, ptr(y))
    return y


def q4_matmul(
    lib: Library,
    x: torch.Tensor,  # [M, K] fp32 or bf16
    packed: torch.Tensor,  # [N, K / 2] uint8: two 4-bit values a byte, blocks of 32
    scale: torch.Tensor,  # [N, K / 32] fp16
    minimum: torch.Tensor,  # [N, K / 32] fp16
) -> torch.Tensor:
    """y [M, N] = x @ W.T in x's dtype, W = q * scale + minimum per block of 32."""
    return _weight_only_matmul(_Q4_MATMUL, lib, x, packed, scale, minimum)


def q8_matmul(
    lib: Library,
    x: torch.Tensor,  # [M, K] fp32 or bf16
    packed: torch.Tensor,  # [N, K] uint8: q + 128, block pairs in the activations' order
    scale: torch.Tensor,  # [N] fp32
) -> torch.Tensor:
    """y [M, N] = x @ W.T in x's dtype, W = q * scale per output channel."""
    return _weight_only_matmul(_Q8_MATMUL, lib, x, packed, scale)


def q8_matmul_float(
    lib: Library,
    x: torch.Tensor,  # [M, K] fp32 or bf16
    packed: torch.Tensor,  # [N, K] uint8, as for q8_matmul
    scale: torch.Tensor,  # [N] fp32
) -> torch.Tensor:
    """q8_matmul with unquantized activations (fp32 accumulation): the output head."""
    return _weight_only_matmul(_Q8_MATMUL_FLOAT, lib, x, packed, scale)
