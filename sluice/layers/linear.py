"""Linear layers with a pluggable method that owns the weight layout and the matmul.

Quantization plugs in here: a method converts the loaded dense weight once
(`process_weight`) and computes `apply(x)`; the model never knows which one it has.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod:
    """Dense weights in the model's dtype: a plain matmul."""

    name = "none"

    def process_weight(self, layer: Linear) -> None:
        """Dense weights are used as loaded."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def extra_repr(self) -> str:
        return (
            f"{self.in_features}, {self.out_features}, bias={self.bias is not None}, "
            f"method={self.method.name}"
        )
