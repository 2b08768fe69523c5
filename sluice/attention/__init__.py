"""Attention backends over the paged KV cache. The model only sees `AttentionBackend`."""

import torch

from sluice.attention import cpu_kernels
from sluice.attention.backend import AttentionBackend, AttentionMetadata, PrefillSpan
from sluice.attention.sdpa import SDPABackend


def select_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> AttentionBackend:
    """SDPA everywhere (fused on CPU and CUDA), with our paged decode kernel on CPU."""
    kernel = None
    if device.type == "cpu" and cpu_kernels.supports(dtype, head_dim):
        kernel = cpu_kernels.load()
    return SDPABackend(kernel)


__all__ = ["AttentionBackend", "AttentionMetadata", "PrefillSpan", "SDPABackend", "select_backend"]
