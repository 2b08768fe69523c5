"""Bindings of the paged decode-attention kernel (csrc/paged_attention.cpp): attention of
a few queries per sequence over K/V read in place from the block pool, and the write of
new K/V into it. A pool is either the activations' dtype or int8 rows (a uint8 tensor
whose last dimension is a row's bytes; sluice/attention/kv_int8.py)."""

from __future__ import annotations

import torch

from sluice.kernels._ffi import (
    FLOAT,
    INT,
    INT64,
    POINTER,
    Library,
    c_function,
    ptr,
    ptr_or_null,
)

# q, k_cache, v_cache, block_tables, max_blocks, query_start, ctx_end, out, seqs, heads,
# kv_heads, head_dim, block_size, scale, q_stride, window, sinks
_PAGED_ARGS = (
    *(POINTER, POINTER, POINTER, POINTER, INT64, POINTER, POINTER, POINTER),
    *(INT, INT, INT, INT, INT, FLOAT, INT64, INT64, POINTER),
)
_PAGED_ATTENTION_F32 = c_function("sluice_paged_attention_f32", None, *_PAGED_ARGS)
_PAGED_ATTENTION_BF16 = c_function("sluice_paged_attention_bf16", None, *_PAGED_ARGS)
_PAGED_ATTENTION_F32_KV8 = c_function("sluice_paged_attention_f32_kv8", None, *_PAGED_ARGS)
_PAGED_ATTENTION_BF16_KV8 = c_function("sluice_paged_attention_bf16_kv8", None, *_PAGED_ARGS)
# k, v, src_stride, k_cache, v_cache, slots, tokens, kv_heads, block_size, head_dim,
# element size
_WRITE_KV = c_function(
    "sluice_write_kv",
    None,
    *(POINTER, POINTER, INT64, POINTER, POINTER, POINTER, INT64, INT, INT, INT, INT),
)
# k, v, src_stride, k_cache, v_cache, slots, tokens, kv_heads, block_size, head_dim, bf16
_WRITE_KV_INT8 = c_function(
    "sluice_write_kv_int8",
    None,
    *(POINTER, POINTER, INT64, POINTER, POINTER, POINTER, INT64, INT, INT, INT, INT),
)
_VECTORIZED = c_function("sluice_attention_vectorized", INT, INT)


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel takes this dtype and head size (kMaxHeadDim in csrc/paged_attention.h)."""
    return dtype in (torch.float32, torch.bfloat16) and head_dim <= 256


def vectorized(lib: Library, head_dim: int) -> bool:
    """Whether `head_dim` takes `lib`'s vectorized math (else the generic loops)."""
    return bool(_VECTORIZED(lib, head_dim))


def paged_attention(
    lib: Library,
    q: torch.Tensor,  # [num_queries, heads, d]; rows may be strided (a slice of qkv)
    k_cache: torch.Tensor,  # [blocks, kv_heads, block_size, d], contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int64, contiguous
    query_start: torch.Tensor,  # [S + 1] int64: sequence s owns queries qs[s] .. qs[s+1]-1
    ctx_end: torch.Tensor,  # [S] int64: context length seen by each sequence's last query
    scale: float,
    out: torch.Tensor | None = None,  # [num_queries, heads, d] contiguous, written in place
    window: int | None = None,  # sliding window: each query sees its last `window` positions
    sinks: torch.Tensor | None = None,  # [heads] fp32: each head's attention-sink logit
) -> torch.Tensor:
    heads, d = q.shape[1], q.shape[2]  # d, not the pool's last dim: an int8 row is longer
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    if out is None:
        out = q.new_empty(q.shape)
    bf16 = q.dtype == torch.bfloat16
    sink_logits = None if sinks is None else _sinks(sinks, heads)  # alive through the call
    if k_cache.dtype == torch.uint8:  # int8 rows
        fn = _PAGED_ATTENTION_BF16_KV8 if bf16 else _PAGED_ATTENTION_F32_KV8
    else:
        fn = _PAGED_ATTENTION_BF16 if bf16 else _PAGED_ATTENTION_F32
    fn(
        lib,
        ptr(q),
        ptr(k_cache),
        ptr(v_cache),
        ptr(block_tables),
        block_tables.shape[1],
        ptr(query_start),
        ptr(ctx_end),
        ptr(out),
        block_tables.shape[0],
        heads,
        k_cache.shape[1],
        d,
        k_cache.shape[2],
        scale,
        q.stride(0),
        window or 0,
        ptr_or_null(sink_logits),
    )
    return out


def _sinks(sinks: torch.Tensor, heads: int) -> torch.Tensor:
    """Sink logits as the kernel reads them: `heads` contiguous fp32 values."""
    if sinks.shape != (heads,):
        raise ValueError(f"attention sinks have shape {tuple(sinks.shape)}, expected ({heads},)")
    return sinks.float().contiguous()


def write_kv(
    lib: Library,
    k: torch.Tensor,  # [T, kv_heads, d], heads contiguous; tokens may be strided
    v: torch.Tensor,  # same shape and strides as k
    k_cache: torch.Tensor,  # [blocks, kv_heads, block_size, d], contiguous
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [T] int64, contiguous
) -> None:
    """Copy each token's K/V into its cache slot, in place (quantized, into an int8 pool)."""
    if k.stride(2) != 1 or k.stride(1) != k.shape[2] or k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    if k_cache.dtype == torch.uint8:
        _WRITE_KV_INT8(
            lib,
            *(ptr(k), ptr(v), k.stride(0), ptr(k_cache), ptr(v_cache), ptr(slots)),
            *(k.shape[0], k_cache.shape[1], k_cache.shape[2], k.shape[2]),
            int(k.dtype == torch.bfloat16),
        )
        return
    _WRITE_KV(
        lib,
        ptr(k),
        ptr(v),
        k.stride(0),
        ptr(k_cache),
        ptr(v_cache),
        ptr(slots),
        k.shape[0],
        k_cache.shape[1],
        k_cache.shape[2],
        k_cache.shape[3],
        k.element_size(),
    )
