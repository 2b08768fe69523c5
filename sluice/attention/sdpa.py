"""Paged attention on torch's scaled_dot_product_attention (fused on CPU and CUDA).

On CPU, decodes and short chunks go to our paged kernel when it could be built: it
reads K/V in place from the blocks, where SDPA needs them gathered into a padded copy
first (several times slower at high concurrency).

An int8 pool (kv_cache_dtype="int8", a uint8 tensor of rows: attention/kv_int8.py) is
read by the paged kernel in place; the torch paths dequantize only the rows they
gather. Every query attends to K/V as the cache holds them, the fresh K/V of a prompt's
first chunk included, so a prompt's result does not depend on how it was chunked or
whether its prefix came from the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sluice.attention import kv_int8
from sluice.attention import window as windows
from sluice.attention.backend import AttentionBackend, AttentionMetadata, PrefillSpan
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
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Every new token's K/V goes into the cache before anyone reads it, so requests
        # that share blocks within one step see each other's writes.
        self._write(k, v, k_cache, v_cache, meta)

        out = q.new_empty(q.shape)  # contiguous even where q is a strided slice of qkv
        n = meta.num_small_tokens
        if n and self.kernel is not None:
            self._small_on_kernel(q[:n], k_cache, v_cache, meta, out[:n], window, scale, sinks)
        elif n:
            out[:n] = _small_on_sdpa(q[:n], k_cache, v_cache, meta, window, scale, sinks)
        for span in meta.prefills:
            s, e = span.q_start, span.q_start + span.q_len
            kp, vp, mask = _span_kv(span, k, v, k_cache, v_cache, meta, window, q)
            out[s:e] = _attend_span(q[s:e], kp, vp, mask, scale, sinks)
        return out

    def _small_on_kernel(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
        window: int | None,
        scale: float | None,
        sinks: torch.Tensor | None,
    ) -> None:
        """The small group (decodes and short chunks) through our paged kernel, which
        reads K/V in place from the blocks, into out."""
        assert self.kernel is not None
        assert meta.small_block_tables is not None
        assert meta.small_query_start is not None and meta.small_ctx_end is not None
        paged.paged_attention(
            self.kernel,
            q,
            k_cache,
            v_cache,
            meta.small_block_tables,
            meta.small_query_start,
            meta.small_ctx_end,
            q.shape[-1] ** -0.5 if scale is None else scale,
            out=out,
            window=window,
            sinks=sinks,
        )

    def _write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        if self.kernel is not None:
            paged.write_kv(self.kernel, k, v, k_cache, v_cache, meta.slot_mapping)
            return
        num_kv_heads, block_size, row = k_cache.shape[1:]
        if meta.cache_rows is None:  # once per step, shared by every layer
            meta.cache_rows = cache_rows(meta.slot_mapping, num_kv_heads, block_size)
        if k_cache.dtype == torch.uint8:
            k, v = kv_int8.quantize(k), kv_int8.quantize(v)
        k_cache.view(-1, row).index_copy_(0, meta.cache_rows, k.reshape(-1, row))
        v_cache.view(-1, row).index_copy_(0, meta.cache_rows, v.reshape(-1, row))


def _read(rows: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Gathered cache rows as q's dtype: int8 rows dequantized, others as they are."""
    if rows.dtype != torch.uint8:
        return rows
    return kv_int8.dequantize(rows, q.shape[-1], q.dtype)


def _small_on_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None,
    scale: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """The small group without the kernel: one query row per token over its request's
    blocks, gathered into a padded copy and masked to what the row may see."""
    assert meta.row_block_tables is not None
    # Gather whole blocks: [n, max_blocks, kvh, block_size, d] -> [n, kvh, L, d].
    kd = _read(k_cache[meta.row_block_tables], q).transpose(1, 2).flatten(2, 3)
    vd = _read(v_cache[meta.row_block_tables], q).transpose(1, 2).flatten(2, 3)
    mask = meta.row_mask if window is None else windows.row_mask(meta, window)
    qd = q.unsqueeze(2)
    if sinks is not None:
        assert mask is not None  # the runner fills row_mask where the kernel is absent
        kd, vd, mask = _with_sinks(qd, kd, vd, mask, sinks)
    od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=True, scale=scale)
    return od.squeeze(2)


def _span_kv(
    span: PrefillSpan,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None,
    q: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """K/V [ctx, kvh, d] a prefill span attends to (as q's dtype), and its mask (None:
    plain causal): its own fresh k/v when it sees nothing else, else its context's rows
    read back from the cache (an int8 pool's own fresh rows too, as quantized)."""
    s, e = span.q_start, span.q_start + span.q_len
    slots, mask = windows.span_context(span, window)
    if slots is None and k_cache.dtype == torch.uint8:
        slots = meta.slot_mapping[s:e]  # the span's own rows, as quantized
    if slots is None:
        return k[s:e], v[s:e], mask
    block_size = k_cache.shape[2]
    kp = _read(k_cache[slots // block_size, :, slots % block_size], q)
    vp = _read(v_cache[slots // block_size, :, slots % block_size], q)
    return kp, vp, mask


def _attend_span(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One prefill span's queries [q_len, heads, d] over its K/V [ctx, kvh, d]."""
    qs = q.transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, d]
    ks, vs = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    if sinks is not None:
        if mask is None:  # the span sees only itself: causal, as is_causal would make it
            mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril()
        ks, vs, mask = _with_sinks(qs, ks, vs, mask, sinks)
    op = F.scaled_dot_product_attention(
        qs, ks, vs, attn_mask=mask, is_causal=mask is None, enable_gqa=True, scale=scale
    )
    return op.squeeze(0).transpose(0, 1)


def _with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SDPA's inputs with attention sinks: k and v [B, kvh, L, d] gain a zero row, and
    the boolean mask (broadcast to [B, heads, Q, L]) becomes an additive one whose last
    column is each head's sink logit. That row's score is then the sink itself (q . 0 =
    0), it joins the softmax's denominator and adds nothing to the output: the
    reference's concatenated sink logit, exactly."""
    b, heads, nq, _ = q.shape
    zero = k.new_zeros(*k.shape[:2], 1, k.shape[3])
    k, v = torch.cat([k, zero], dim=2), torch.cat([v, zero.to(v.dtype)], dim=2)
    ctx = k.shape[2] - 1
    bias = q.new_zeros(b, heads, nq, ctx + 1)
    bias[..., :ctx].masked_fill_(~mask.expand(b, heads, nq, ctx), float("-inf"))
    bias[..., ctx] = sinks.to(q.dtype).view(1, heads, 1)
    return k, v, bias
