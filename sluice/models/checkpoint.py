"""The named weights being loaded into a model (Hugging Face names, as the loaders
return them), converted into what each layer keeps."""

from __future__ import annotations

import torch

from sluice.core.quantized_tensor import QuantizedTensor, Weight, concat_rows, dequantize
from sluice.layers.block_quant import BlockQuantized
from sluice.layers.linear import Linear


class Checkpoint:
    """The named weights being loaded into a model, converted as each layer keeps them."""

    def __init__(self, tensors: dict[str, Weight], dtype: torch.dtype) -> None:
        self.tensors = tensors
        self.dtype = dtype

    def take(self, name: str) -> Weight:
        """The weight, removed from the dict: once its layer holds it (fused,
        converted), the loader's copy is freed layer by layer instead of all at the end,
        which would double the peak memory of a load."""
        if name not in self.tensors:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        return self.tensors.pop(name)

    def dense_float(self, value: Weight) -> torch.Tensor:
        """The weight as fp32, whatever the model's dtype (for arithmetic at load)."""
        if isinstance(value, QuantizedTensor):
            return dequantize(value, torch.float32)
        return value.float()

    def put_float(self, param: torch.Tensor, name: str) -> None:
        """Weight `name` into fp32 `param` (a router, its bias, sink logits: kept in fp32
        whatever the model's dtype), its shape checked against the parameter's."""
        value = self.dense_float(self.take(name))
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(
                f"{name} has shape {tuple(value.shape)}, expected {tuple(param.shape)}"
            )
        param.copy_(value)

    def dense(self, value: Weight) -> torch.Tensor:
        if isinstance(value, QuantizedTensor):
            return dequantize(value, self.dtype)  # quantization="none", int8 or int4
        return value.to(self.dtype)

    def put(self, param: torch.Tensor, value: Weight) -> None:
        value = self.dense(value)
        if tuple(param.shape) != tuple(value.shape):
            raise ValueError(
                f"shape mismatch: expected {tuple(param.shape)}, got {tuple(value.shape)}"
            )
        param.copy_(value)

    def put_linear(self, layer: Linear, names: list[str]) -> None:
        """One layer's weight from one or more checkpoint tensors stacked along rows."""
        parts = [self.take(n) for n in names]
        quantized = [p for p in parts if isinstance(p, QuantizedTensor)]
        if isinstance(layer.method, BlockQuantized) and len(quantized) == len(parts):
            layer.method.load_quantized(layer, concat_rows(quantized))
        else:
            self.put(layer.weight, torch.cat([self.dense(p) for p in parts]))
