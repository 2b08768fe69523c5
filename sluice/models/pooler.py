"""An embedding model's last stage: hidden states of each input -> one vector.

Pooling (the mean of an input's tokens, its first or its last), then the dense
projections its sentence-transformers folder lists, in fp32 whatever the encoder ran
in (they are small, and the vectors are compared by cosine). Normalization and
Matryoshka cuts are per request, so the engine applies them (PoolingParams).
"""

from __future__ import annotations

import torch
from torch import nn

from sluice.config import PoolerConfig


class Pooler(nn.Module):
    def __init__(self, config: PoolerConfig) -> None:
        super().__init__()
        self.config = config
        self.dense = nn.ModuleList(
            nn.Linear(d.in_features, d.out_features, bias=d.bias) for d in config.dense
        )

    def forward(self, hidden: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """[T, hidden] packed rows of len(lens) inputs -> [len(lens), dimension] fp32."""
        length = torch.tensor(lens, device=hidden.device)
        ends = length.cumsum(0)
        mode = self.config.mode
        if mode == "mean":
            owner = torch.repeat_interleave(torch.arange(len(lens), device=hidden.device), length)
            sums = hidden.new_zeros(len(lens), hidden.shape[1], dtype=torch.float32)
            pooled = sums.index_add_(0, owner, hidden.float()) / length[:, None]
        elif mode == "cls":
            pooled = hidden[ends - length].float()
        else:
            pooled = hidden[ends - 1].float()
        for layer, spec in zip(self.dense, self.config.dense, strict=True):
            pooled = layer(pooled)
            if spec.activation == "tanh":
                pooled = torch.tanh(pooled)
        return pooled
