"""Paged attention on torch's scaled_dot_product_attention (fused on CPU and CUDA).

On CPU, decodes go to our paged kernel when it could be built: it reads K/V in place
from the blocks, where SDPA needs them gathered into a padded copy first (several
times slower at high concurrency).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from sluice.attention import cpu_kernels
from sluice.attention.backend import AttentionBackend, AttentionMetadata


class SDPABackend(AttentionBackend):
    name = "sdpa"

    def __init__(self, cpu_decode_kernel: ctypes.CDLL | None = None) -> None:
        self.kernel = cpu_decode_kernel
        self.uses_decode_mask = cpu_decode_kernel is None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)
        flat_v = v_cache.view(-1, num_kv_heads, head_dim)
        # Every new token's K/V goes into the cache before anyone reads it, so requests
        # that share blocks within one step see each other's writes.
        flat_k.index_copy_(0, meta.slot_mapping, k)
        flat_v.index_copy_(0, meta.slot_mapping, v)

        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd and self.kernel is not None:
            assert meta.decode_block_tables is not None and meta.decode_ctx_lens is not None
            out[:nd] = cpu_kernels.paged_decode(
                self.kernel,
                q[:nd].contiguous(),
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_ctx_lens,
                q.shape[-1] ** -0.5,
            )
        elif nd:
            assert meta.decode_block_tables is not None
            # Gather whole blocks: [nd, max_blocks, block_size, kvh, d] -> [nd, kvh, L, d].
            kd = k_cache[meta.decode_block_tables].flatten(1, 2).transpose(1, 2)
            vd = v_cache[meta.decode_block_tables].flatten(1, 2).transpose(1, 2)
            qd = q[:nd].unsqueeze(2)  # [nd, heads, 1, d]
            od = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=meta.decode_mask, enable_gqa=True
            )
            out[:nd] = od.squeeze(2)
        for span in meta.prefills:
            s, e = span.q_start, span.q_start + span.q_len
            qp = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, d]
            if span.context_slots is None:
                kp, vp = k[s:e], v[s:e]
                causal, mask = True, None
            else:
                kp = flat_k.index_select(0, span.context_slots)
                vp = flat_v.index_select(0, span.context_slots)
                causal, mask = False, span.mask
            op = F.scaled_dot_product_attention(
                qp,
                kp.transpose(0, 1).unsqueeze(0),
                vp.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=causal,
                enable_gqa=True,
            )
            out[s:e] = op.squeeze(0).transpose(0, 1)
        return out
