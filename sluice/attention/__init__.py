"""Attention backends over the paged KV cache. The model only sees `AttentionBackend`."""

import torch

from sluice import kernels
from sluice.attention.backend import AttentionBackend, AttentionMetadata, PrefillSpan
from sluice.attention.sdpa import SDPABackend
from sluice.kernels import attention as paged


def select_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> AttentionBackend:
    """SDPA everywhere (fused on CPU and CUDA), with our paged decode kernel on CPU."""
    kernel = None
    if device.type == "cpu" and paged.supports(dtype, head_dim):
        kernel = kernels.load()
    return SDPABackend(kernel)


__all__ = ["AttentionBackend", "AttentionMetadata", "PrefillSpan", "SDPABackend", "select_backend"]
