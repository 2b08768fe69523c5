"""Paged attention on torch's scaled_dot_product_attention (fused on CPU and CUDA).

On CPU, decodes and short chunks go to our paged kernel when it could be built: it
reads K/V in place from the blocks, where SDPA needs them gathered into a padded copy
first (several times slower at high concurrency).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sluice.attention import window as windows
from sluice.attention.backend import AttentionBackend, AttentionMetadata
from sluice.kernels import Library
from sluice.kernels import attention as paged


def cache_rows(slots: torch.Tensor, num_kv_heads: int, block_size: int) -> torch.Tensor:
    """Row of the [blocks * kv_heads * block_size, head_dim] view of a pool for each
    (token, kv head), flattened token-major: where index_copy_ writes new K/V."""
    blocks, offsets = slots // block_size, slots % block_size
    heads = torch.arange(num_kv_heads, device=slots.device)
    return ((blocks[:, None] * num_kv_heads + heads) * block_size + offsets[:, None]).flatten()


class SDPABackend(AttentionBackend):
    name = "sdpa"

    def __init__(self, cpu_kernel: Library | None = None) -> None:
        self.kernel = cpu_kernel
        self.uses_row_mask = cpu_kernel is None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        window: int | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        num_kv_heads, block_size, head_dim = k_cache.shape[1:]
        # Every new token's K/V goes into the cache before anyone reads it, so requests
        # that share blocks within one step see each other's writes.
        if self.kernel is not None:
            paged.write_kv(self.kernel, k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            if meta.cache_rows is None:  # once per step, shared by every layer
                meta.cache_rows = cache_rows(meta.slot_mapping, num_kv_heads, block_size)
            rows = meta.cache_rows
            k_cache.view(-1, head_dim).index_copy_(0, rows, k.reshape(-1, head_dim))
            v_cache.view(-1, head_dim).index_copy_(0, rows, v.reshape(-1, head_dim))

        out = q.new_empty(q.shape)  # contiguous even where q is a strided slice of qkv
        n = meta.num_small_tokens
        if n and self.kernel is not None:
            assert meta.small_block_tables is not None
            assert meta.small_query_start is not None and meta.small_ctx_end is not None
            paged.paged_attention(
                self.kernel,
                q[:n],
                k_cache,
                v_cache,
                meta.small_block_tables,
                meta.small_query_start,
                meta.small_ctx_end,
                q.shape[-1] ** -0.5 if scale is None else scale,
                out=out[:n],
                window=window,
            )
        elif n:
            assert meta.row_block_tables is not None
            # Gather whole blocks: [n, max_blocks, kvh, block_size, d] -> [n, kvh, L, d].
            kd = k_cache[meta.row_block_tables].transpose(1, 2).flatten(2, 3)
            vd = v_cache[meta.row_block_tables].transpose(1, 2).flatten(2, 3)
            mask = meta.row_mask if window is None else windows.row_mask(meta, window)
            od = F.scaled_dot_product_attention(
                q[:n].unsqueeze(2), kd, vd, attn_mask=mask, enable_gqa=True, scale=scale
            )
            out[:n] = od.squeeze(2)
        for span in meta.prefills:
            s, e = span.q_start, span.q_start + span.q_len
            qp = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, d]
            slots, mask = windows.span_context(span, window)
            if slots is None:
                kp, vp = k[s:e], v[s:e]
            else:
                kp = k_cache[slots // block_size, :, slots % block_size]  # [ctx, kvh, d]
                vp = v_cache[slots // block_size, :, slots % block_size]
            op = F.scaled_dot_product_attention(
                qp,
                kp.transpose(0, 1).unsqueeze(0),
                vp.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                enable_gqa=True,
                scale=scale,
            )
            out[s:e] = op.squeeze(0).transpose(0, 1)
        return out
