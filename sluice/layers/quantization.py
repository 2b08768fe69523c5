"""Weight-only quantization methods for `Linear`, on torch's CPU kernels.

Decoding a few sequences is bound by reading weights: 4-bit weights are a quarter of
bf16's bytes. A large batch is bound by arithmetic instead, where the dense matmul is
fastest, so each method keeps the dense weight too (cheap for small models) and picks
per call by the number of rows.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from sluice.layers.linear import Linear, LinearMethod

# Rows at or above which the dense matmul beats the weight-only kernels on this CPU
# class (measured by benchmarks/quantization.py).
DENSE_MIN_ROWS = 32


class _WeightOnly(LinearMethod, abc.ABC):
    def __init__(self, dense_min_rows: int = DENSE_MIN_ROWS) -> None:
        self.dense_min_rows = dense_min_rows

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= self.dense_min_rows:
            return F.linear(x, layer.weight, layer.bias)
        y = self._matmul(layer, x)
        return y if layer.bias is None else y + layer.bias

    @abc.abstractmethod
    def _matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """The weight-only kernel for a small batch of rows."""


class Int8WeightOnly(_WeightOnly):
    """Symmetric per-output-channel int8."""

    name = "int8"

    def process_weight(self, layer: Linear) -> None:
        w = layer.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-10)
        layer.qweight = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        layer.qscale = scale.to(layer.weight.dtype)

    def _matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, layer.qweight, layer.qscale)


class Int4WeightOnly(_WeightOnly):
    """Asymmetric int4 in groups of `group_size` along the input dimension."""

    name = "int4"

    def __init__(self, group_size: int = 32, dense_min_rows: int = DENSE_MIN_ROWS) -> None:
        super().__init__(dense_min_rows)
        self.group_size = group_size

    def process_weight(self, layer: Linear) -> None:
        w = layer.weight.detach().float()
        n, k = w.shape
        g = self.group_size
        if k % g or n % 16:
            # Shapes torch's int4 packing cannot take stay dense (one method per layer).
            self.dense_min_rows = 0
            return
        groups = w.view(n, k // g, g)
        lo = groups.amin(dim=-1, keepdim=True)
        hi = groups.amax(dim=-1, keepdim=True)
        scale = ((hi - lo) / 15.0).clamp(min=1e-10)
        q = ((groups - lo) / scale).round().clamp(0, 15).to(torch.int32).view(n, k)
        layer.qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        # torch's kernel computes (q - 8) * scale + zero, so zero = lo + 8 * scale.
        zero = lo + 8 * scale
        sz = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], dim=-1)  # [n, k/g, 2]
        layer.qscale_zero = sz.transpose(0, 1).contiguous().to(layer.weight.dtype)

    def _matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, layer.qweight, self.group_size, layer.qscale_zero
        )


@contextlib.contextmanager
def quantized_kernels_only(model: torch.nn.Module) -> Iterator[None]:
    """Send every batch size through the weight-only kernels (prefills included), so an
    accuracy measurement sees the weights that decoding multiplies by."""
    methods = [
        m.method
        for m in model.modules()
        if isinstance(m, Linear) and isinstance(m.method, _WeightOnly)
    ]
    saved = [m.dense_min_rows for m in methods]
    for m in methods:
        if m.dense_min_rows:  # 0 marks a layer that must stay dense
            m.dense_min_rows = 1 << 30
    try:
        yield
    finally:
        for m, rows in zip(methods, saved, strict=True):
            m.dense_min_rows = rows


def make_linear_method(quantization: str) -> LinearMethod:
    if quantization == "none":
        return LinearMethod()
    if quantization == "int8":
        return Int8WeightOnly()
    if quantization == "int4":
        return Int4WeightOnly()
    raise ValueError(f"quantization must be one of none, int8, int4; got {quantization!r}")
