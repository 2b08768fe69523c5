"""Attention backends over the paged KV cache. The model only sees `AttentionBackend`."""

from sluice.attention.backend import AttentionBackend, AttentionMetadata, PrefillSpan
from sluice.attention.sdpa import SDPABackend


def select_backend() -> AttentionBackend:
    # One portable backend for now: torch SDPA runs fused kernels on CPU and CUDA.
    return SDPABackend()


__all__ = ["AttentionBackend", "AttentionMetadata", "PrefillSpan", "SDPABackend", "select_backend"]
