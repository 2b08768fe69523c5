"""What every attention backend receives: the step's layout over the paged cache.

The runner orders the flat batch as [decode tokens (one per request) | prefill chunks],
and builds this metadata once per step; every layer reuses it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSpan:
    """One request computing several tokens (a prompt chunk, or a draft to verify)."""

    q_start: int  # offset of its first token in the flat batch
    q_len: int
    # None when the request has no earlier tokens in the cache: attention then runs
    # on this step's fresh K/V with a plain causal mask, without touching the cache.
    context_slots: torch.Tensor | None = None  # [ctx_len] cache slots of positions 0..ctx-1
    mask: torch.Tensor | None = None  # [q_len, ctx_len] bool, True = may attend


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks]
    decode_ctx_lens: torch.Tensor | None = None  # [num_decodes] int64
    # Only built for backends that attend over a padded gather (uses_decode_mask).
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks*block_size]
    prefills: list[PrefillSpan] = field(default_factory=list)


class AttentionBackend(abc.ABC):
    name = "abstract"
    uses_decode_mask = True

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write this step's K/V into the cache, then attend for every query token."""
