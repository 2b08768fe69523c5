"""Linear layers with a pluggable method that owns the weight layout and the matmul.

Quantization plugs in here: a method converts the loaded dense weight once
(`process_weight`) and computes `apply(x)`; the model never knows which one it has.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from sluice.kernels import cpu
from sluice.layers.lora import LoRASlots


def onednn_packable(weight: torch.Tensor) -> bool:
    """bf16 weights on CPU go through oneDNN with a prepacked layout: torch's default bf16
    matmul (MKL) takes a generic path on CPUs without AMX, 1.2-2x slower here. oneDNN's
    bf16 path needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; elsewhere (AVX2, or a level
    forced below avx512) the plain matmul it is."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and cpu.at_least("avx512")
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class LinearMethod:
    """Dense weights in the model's dtype: a plain matmul (oneDNN-packed on CPU bf16)."""

    name = "none"
    packed = False

    def process_weight(self, layer: Linear) -> None:
        """Pack CPU bf16 weights for oneDNN once; the plain copy is then dropped (a
        weight tied to the embedding lives on there)."""
        if not onednn_packable(layer.weight):
            return
        # The batch-size hint picks the blocking; results are the same for every M.
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), 256)
        layer.weight = nn.Parameter(layer.weight.new_empty(0), requires_grad=False)
        self.packed = True

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            packed = cast(torch.Tensor, layer.packed_weight)
            if torch.compiler.is_compiling():
                # Inductor lowers this op only for weights it froze itself; ours are
                # module state, so the call stays opaque to it.
                return cast(
                    torch.Tensor, _onednn_linear_op(x, packed, layer.bias, layer.out_features)
                )
            return _onednn_linear(x, packed, layer.bias)
        return F.linear(x, layer.weight, layer.bias)


def _onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


@torch.library.custom_op("sluice::onednn_linear", mutates_args=())
def _onednn_linear_op(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return _onednn_linear(x, packed, bias)


@_onednn_linear_op.register_fake
def _(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.method = method or LinearMethod()
        # Tensor parallelism sets this on row-parallel layers (o_proj, down_proj): each
        # rank's output is a partial sum, made whole by the group's all-reduce.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        # Adapter slots (LoRASlotTable.attach, with LoRA enabled): each row of a step adds
        # its own adapter's low-rank product to the base output.
        self.lora: LoRASlots | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        if self.lora is not None:
            y = self.lora(x, y)
        return y if self.reduce is None else self.reduce(y)

    def extra_repr(self) -> str:
        return (
            f"{self.in_features}, {self.out_features}, bias={self.bias is not None}, "
            f"method={self.method.name}"
        )
