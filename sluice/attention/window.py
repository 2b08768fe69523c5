"""Sliding-window views of a step's attention metadata.

The runner builds one metadata per step, for full causal attention; a model whose
layers have different windows (Gemma 3: local and global layers) needs, per window,
narrower masks and, for prefill chunks with earlier context, only the part of the
context the window can see. Each is derived here once per step and window, at the
first layer that asks, and reused by the others. Reading only the window (never a
masked-out slot) also matters for correctness: with window-aware freeing the blocks
before the window may already hold another request's K/V.

A query at position p sees positions p - window + 1 .. p (Hugging Face's and
llama.cpp's convention: the window counts the query itself).
"""

from __future__ import annotations

import torch

from sluice.attention.backend import AttentionMetadata, PrefillSpan


def row_mask(meta: AttentionMetadata, window: int) -> torch.Tensor:
    """The padded row mask of meta (rows of single queries) narrowed to the window."""
    cached = meta.window_row_masks.get(window)
    if cached is None:
        assert meta.row_mask is not None and meta.row_positions is not None
        width = meta.row_mask.shape[-1]
        first = (meta.row_positions - window + 1)[:, None]
        inside = torch.arange(width, device=first.device)[None, :] >= first
        cached = meta.row_mask & inside[:, None, None, :]
        meta.window_row_masks[window] = cached
    return cached


def span_context(
    span: PrefillSpan, window: int | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(context slots, mask) of a prefill chunk for this window.

    Slots None means the chunk attends only to its own fresh K/V; a mask None then
    means plain causal."""
    if window is None:
        return span.context_slots, span.mask
    cached = span.windowed.get(window)
    if cached is not None:
        return cached
    if span.context_slots is None:
        if span.q_len <= window:
            cached = (None, None)
        else:
            cached = (None, _window_mask(0, span.q_len, 0, span.q_len, window))
    else:
        ctx = span.context_slots.shape[0]
        start = ctx - span.q_len  # position of the chunk's first query
        lo = max(0, start - window + 1)  # the first query's first visible position
        mask = _window_mask(start, span.q_len, lo, ctx, window)
        cached = (span.context_slots[lo:], mask.to(span.context_slots.device))
    span.windowed[window] = cached
    return cached


def _window_mask(start: int, q_len: int, lo: int, hi: int, window: int) -> torch.Tensor:
    """[q_len, hi - lo] bool: query start + j sees key position p (lo <= p < hi)."""
    pos = torch.arange(lo, hi)[None, :]
    qpos = (start + torch.arange(q_len))[:, None]
    return (pos <= qpos) & (pos > qpos - window)
