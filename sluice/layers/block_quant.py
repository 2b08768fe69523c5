"""Linear layers and the token embedding on weights kept in a GGUF file's quantization.

`quantization="gguf"` (what "auto" picks for a quantized GGUF on CPU) runs the file as
stored: each weight is a `QuantizedTensor` (sluice/core/quantized_tensor.py) and no
float copy of it exists. Two kernels serve every batch size:

* few rows (decode): the block kernel (csrc/qblock.h) reads the quantized blocks and
  multiplies them with int8-quantized activations; memory-bound, so fewer bytes win;
* many rows (prefill, many streams): the matmul is compute-bound, and a dense GEMM on
  the compute dtype beats integer dot products with per-block scales. The weight is
  dequantized a tile of rows at a time into a scratch tile that stays in cache and
  multiplied there, so the float weight never exists whole.

The crossover (`dense_min_rows`) was measured per instruction-set level
(benchmarks/qblock_crossover.py). The output head multiplies unquantized activations
(int8 activation blocks flip near-tied logits), as Int8WeightOnly's head does.
Without our kernels (CUDA, or SLUICE_CPU_KERNELS=0) the same layouts run on torch ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sluice import kernels
from sluice.core.quantized_tensor import QuantizedTensor, dequantize
from sluice.kernels import Library, qblock
from sluice.layers.linear import Linear, LinearMethod

# Rows at or above which dequantized tiles + the dense GEMM beat the block kernel, per
# kernel level (see the module docstring).
DENSE_MIN_ROWS = {"avx512": 16, "avx2": 16, "generic": 4}
# Elements of a dequantized tile: 1M (2 MB in bf16) stays in the L2/L3 caches.
TILE_ELEMENTS = 1 << 20


def _dequantized_rows(
    lib: Library | None, qt: QuantizedTensor, start: int, stop: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rows start..stop of W as a dense [rows, K] tensor in `dtype`."""
    part = qt if (start, stop) == (0, qt.shape[0]) else qt.row_slice(start, stop)
    if lib is None:
        return dequantize(part, dtype)
    return qblock.qblock_dequantize(lib, *_kernel_args(part), dtype)


def _kernel_args(
    qt: QuantizedTensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    return qt.packed, qt.hbits, qt.scale, qt.minimum, qt.bits, qt.group


class BlockQuantized(LinearMethod):
    """A Linear whose weight stays in its GGUF block quantization. A weight the file
    stores as floats (or in a type we have no layout for) stays dense: this method
    then behaves as the plain one."""

    name = "gguf"

    def __init__(self, output_head: bool = False) -> None:
        self.output_head = output_head
        self.weight: QuantizedTensor | None = None
        self.lib: Library | None = None
        self.dense_min_rows = 1

    @property
    def bits(self) -> int:
        assert self.weight is not None
        return self.weight.bits

    @property
    def group(self) -> int:
        assert self.weight is not None
        return self.weight.group

    def load_quantized(self, layer: Linear, weight: QuantizedTensor) -> None:
        if weight.shape != (layer.out_features, layer.in_features):
            raise ValueError(
                f"shape mismatch: expected {(layer.out_features, layer.in_features)}, "
                f"got {weight.shape}"
            )
        self.weight = weight
        # The kernel and the decode stack find the tensors on the layer by name.
        layer.qb_packed, layer.qb_hbits = weight.packed, weight.hbits
        layer.qb_scale, layer.qb_min = weight.scale, weight.minimum
        dtype = layer.weight.dtype
        layer.weight = nn.Parameter(layer.weight.new_empty(0), requires_grad=False)
        on_cpu = layer.weight.device.type == "cpu"
        self.lib = kernels.load() if on_cpu and dtype in (torch.float32, torch.bfloat16) else None
        level = kernels.variant() if self.lib is not None else "generic"
        self.dense_min_rows = DENSE_MIN_ROWS.get(level, 4) if self.lib is not None else 1

    def process_weight(self, layer: Linear) -> None:
        if self.weight is None:
            super().process_weight(layer)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return super().apply(layer, x)
        if self.lib is not None and x.shape[0] < self.dense_min_rows:
            args = (x.contiguous(), *_kernel_args(self.weight))
            if self.output_head:
                y = qblock.qblock_matmul_float(self.lib, *args)
            else:
                y = qblock.qblock_matmul(self.lib, *args)
        else:
            y = self._dense_tiles(x)
        return y if layer.bias is None else y + layer.bias

    def _dense_tiles(self, x: torch.Tensor) -> torch.Tensor:
        assert self.weight is not None
        n, k = self.weight.shape
        rows = max(64, TILE_ELEMENTS // k)
        if rows >= n:
            return F.linear(x, _dequantized_rows(self.lib, self.weight, 0, n, x.dtype))
        y = x.new_empty(x.shape[0], n)
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            tile = _dequantized_rows(self.lib, self.weight, start, stop, x.dtype)
            y[:, start:stop] = F.linear(x, tile)
        return y


class Embedding(nn.Module):
    """Token embedding whose table may stay quantized: a lookup dequantizes only the
    rows it gathers."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.quantized: QuantizedTensor | None = None
        self.lib: Library | None = None

    def load_quantized(self, weight: QuantizedTensor) -> None:
        if weight.shape != tuple(self.weight.shape):
            raise ValueError(
                f"shape mismatch: expected {tuple(self.weight.shape)}, got {weight.shape}"
            )
        self.quantized = weight
        on_cpu = self.weight.device.type == "cpu"
        self.lib = kernels.load() if on_cpu else None
        # Empty, but keeps the compute dtype and device that callers read off it.
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is None:
            return F.embedding(ids, self.weight)
        if self.lib is not None and self.weight.dtype in (torch.float32, torch.bfloat16):
            args = _kernel_args(self.quantized)
            return qblock.qblock_embedding(self.lib, ids, *args, self.weight.dtype)
        return dequantize(self.quantized.rows(ids), self.weight.dtype)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as held (quantized blocks, dense or packed
    tensors), counting a tensor shared between modules (a tied head) once. Rotary
    tables and other caches are not weights and are left out."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if not isinstance(module, Linear | Embedding) and not hasattr(module, "eps"):
            continue  # RMSNorm has eps; rotary tables and containers are skipped
        tensors: list[torch.Tensor] = list(module.parameters(recurse=False))
        # Kernel layouts are plain tensor attributes (q4_packed, qb_scale, ...).
        tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        if isinstance(module, Embedding) and module.quantized is not None:
            q = module.quantized
            tensors += [q.packed, q.hbits, q.scale, q.minimum]
        for t in tensors:
            # A shared weight (the tied head) is the same tensor object in both places.
            if t.numel() and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total
