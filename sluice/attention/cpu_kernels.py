"""Python side of the paged decode-attention kernel (sluice/kernels/csrc/paged_attention.cpp)."""

from __future__ import annotations

import ctypes

import torch

from sluice.kernels import load

__all__ = ["load", "paged_attention", "supports"]


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    return dtype in (torch.float32, torch.bfloat16) and head_dim <= 256


def paged_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [num_queries, heads, d]; rows may be strided (a slice of qkv)
    k_cache: torch.Tensor,  # [blocks, kv_heads, block_size, d], contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int64, contiguous
    query_start: torch.Tensor,  # [S + 1] int64: sequence s owns queries qs[s] .. qs[s+1]-1
    ctx_end: torch.Tensor,  # [S] int64: context length seen by each sequence's last query
    scale: float,
    out: torch.Tensor | None = None,  # [num_queries, heads, d] contiguous, written in place
) -> torch.Tensor:
    heads, d = q.shape[1], q.shape[2]
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    if out is None:
        out = q.new_empty(q.shape)
    bf16 = q.dtype == torch.bfloat16
    fn = lib.sluice_paged_attention_bf16 if bf16 else lib.sluice_paged_attention_f32
    fn(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        query_start.data_ptr(),
        ctx_end.data_ptr(),
        out.data_ptr(),
        block_tables.shape[0],
        heads,
        k_cache.shape[1],
        d,
        k_cache.shape[2],
        scale,
        q.stride(0),
    )
    return out


def write_kv(
    lib: ctypes.CDLL,
    k: torch.Tensor,  # [T, kv_heads, d], heads contiguous; tokens may be strided
    v: torch.Tensor,  # same shape and strides as k
    k_cache: torch.Tensor,  # [blocks, kv_heads, block_size, d], contiguous
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [T] int64, contiguous
) -> None:
    if k.stride(2) != 1 or k.stride(1) != k.shape[2] or k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    lib.sluice_write_kv(
        k.data_ptr(),
        v.data_ptr(),
        k.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        k.shape[0],
        k_cache.shape[1],
        k_cache.shape[2],
        k_cache.shape[3],
        k.element_size(),
    )
