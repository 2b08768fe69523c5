"""How a model layer reaches attention: through the step's context, not its arguments.

The runner sets the step's metadata, backend and KV tensors once per forward pass;
each layer calls `attend(q, k, v, layer_index)` (with its sliding window and its score
scale where the model has them). Keeping them out of the model's
arguments is what lets `torch.compile` trace the model once for every batch layout:
under compilation the call goes through an opaque custom op, so the compiler fuses
everything around attention and never looks inside (block tables, per-request spans
and our C++ kernel stay eager).

Where a split KV cache keeps the windowed layers' K/V in a pool of their own (Gemma
3), the context also carries each layer's metadata (`layer_meta`): the local layers'
slots and block tables index the local pool. A layer finds its metadata by its index,
as it finds its K/V tensors, so the compiled graph does not change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from sluice.attention.backend import AttentionBackend, AttentionMetadata


@dataclass
class StepContext:
    backend: AttentionBackend
    meta: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (K, V) block pools
    # Per layer, the metadata over its cache group's block tables where a split KV
    # cache gives the windowed layers a pool of their own; None: every layer reads meta.
    layer_meta: list[AttentionMetadata] | None = None


_current: StepContext | None = None


@contextlib.contextmanager
def step_context(ctx: StepContext) -> Iterator[None]:
    global _current
    previous, _current = _current, ctx
    try:
        yield
    finally:
        _current = previous


def _run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    window: int | None,
    scale: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    ctx = _current
    if ctx is None:
        raise RuntimeError("attention called outside a step (use step_context)")
    k_cache, v_cache = ctx.kv_caches[layer]
    meta = ctx.meta if ctx.layer_meta is None else ctx.layer_meta[layer]
    return ctx.backend.forward(
        q, k, v, k_cache, v_cache, meta, window=window, scale=scale, sinks=sinks
    )


# No mutated arguments as far as the compiler knows: the cache it writes is reached
# through the context, so no functionalization copies of the pool are ever made.
@torch.library.custom_op("sluice::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    window: int | None,
    scale: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    return _run(q, k, v, layer, window, scale, sinks)


@_attention_op.register_fake
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    window: int | None,
    scale: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    return torch.empty_like(q)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    window: int | None = None,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write this step's K/V for `layer` into the cache and attend; [T, heads, head_dim].

    window: a sliding window (each query sees its last `window` positions), None for
    full causal attention. scale: the score scale, None for 1/sqrt(head_dim). sinks:
    each head's attention-sink logit [heads] (gpt-oss), None for none."""
    if torch.compiler.is_compiling():
        out: torch.Tensor = _attention_op(q, k, v, layer, window, scale, sinks)
        return out
    return _run(q, k, v, layer, window, scale, sinks)  # eager: skip the custom op's dispatch cost
