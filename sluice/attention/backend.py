"""What every attention backend receives: the step's layout over the paged cache.

The runner orders the flat batch as [single-query rows | prefill chunks],
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
    # (slots, mask) of a sliding window's part of the context, by window size, built
    # at the first layer with that window (see attention/window.py).
    windowed: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = field(
        default_factory=dict
    )


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    # The first `num_small_tokens` tokens belong to sequences computing a short chunk
    # (a decode, or a few tokens): query j of sequence s sees positions
    # 0 .. ctx_end[s] - q_len + j of its blocks.
    num_small_tokens: int = 0
    small_block_tables: torch.Tensor | None = None  # [S, max_blocks] int64
    small_query_start: torch.Tensor | None = None  # [S + 1] int64 offsets into the batch
    small_ctx_end: torch.Tensor | None = None  # [S] int64
    # The same, one row per token, for backends that attend over a padded gather
    # (uses_row_mask): each row's block table and its visible positions.
    row_block_tables: torch.Tensor | None = None  # [num_small_tokens, max_blocks]
    row_mask: torch.Tensor | None = None  # [num_small_tokens, 1, 1, max_blocks*block_size]
    row_positions: torch.Tensor | None = None  # [num_small_tokens] each row's position
    prefills: list[PrefillSpan] = field(default_factory=list)
    # Filled in by the backend at the first layer and reused by the others.
    cache_rows: torch.Tensor | None = None
    # Row masks of sliding windows, by window size (see attention/window.py).
    window_row_masks: dict[int, torch.Tensor] = field(default_factory=dict)


class AttentionBackend(abc.ABC):
    name = "abstract"
    uses_row_mask = True

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        window: int | None = None,  # each query sees its last `window` positions
        scale: float | None = None,  # score scale; None: 1/sqrt(head_dim)
        # Each head's attention-sink logit [num_heads] (gpt-oss): it joins every
        # softmax's denominator as a key with no value. None: no sinks.
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write this step's K/V into the cache, then attend for every query token."""
