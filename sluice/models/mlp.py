"""The gated MLP of the Llama family: down(act(gate(x)) * up(x)), gate and up in one
matmul (one weight read, one kernel launch)."""

from __future__ import annotations

import torch
from torch import nn

from sluice.layers import fused
from sluice.layers.linear import Linear


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.inter = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(fused.silu_and_mul(self.gate_up_proj(x)))
        return out
