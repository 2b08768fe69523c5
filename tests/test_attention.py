"""The paged attention paths agree with a dense reference on small shapes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from sluice import kernels
from sluice.attention import AttentionMetadata, PrefillSpan, SDPABackend, kv_int8
from sluice.kernels import Library
from sluice.kernels import attention as paged
from tests.conftest import LEVELS, kernels_at


def dense_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None = None,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [n, heads, d] attending over k/v [ctx, kv_heads, d], last n positions, causal;
    with a window, each query sees only its last `window` positions; with sinks, each
    head's sink logit joins the softmax as transformers' gpt-oss adds it (a column
    concatenated to the scores, dropped after the softmax)."""
    n, ctx = q.shape[0], k.shape[0]
    qpos = (ctx - n + torch.arange(n))[:, None]
    mask = torch.arange(ctx)[None, :] <= qpos
    if window is not None:
        mask &= torch.arange(ctx)[None, :] > qpos - window
    if sinks is not None:
        group = q.shape[1] // k.shape[1]
        kf = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, ctx, d]
        vf = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = q.double().transpose(0, 1) @ kf.transpose(1, 2) * (scale or q.shape[2] ** -0.5)
        scores = scores.masked_fill(~mask, float("-inf"))
        sink = sinks.double().view(-1, 1, 1).expand(-1, n, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        return (probs @ vf).transpose(0, 1).float()
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        k.float().transpose(0, 1)[None],
        v.float().transpose(0, 1)[None],
        attn_mask=mask,
        enable_gqa=True,
        scale=scale,
    )
    return out[0].transpose(0, 1)


@pytest.fixture(params=[*LEVELS, "torch"])
def attention_kernel(request: pytest.FixtureRequest) -> Iterator[Library | None]:
    """Our paged kernel at each instruction-set level this CPU has, and torch alone."""
    if request.param == "torch":
        yield None
        return
    with kernels_at(request.param):
        kernel = kernels.load()
        assert kernel is not None and kernels.built_level(kernel) == request.param
        yield kernel


def as_stored(x: torch.Tensor, kv: str) -> torch.Tensor:
    """x as an int8 pool holds it (quantized and back), or x itself."""
    return x if kv == "auto" else kv_int8.dequantize(kv_int8.quantize(x), x.shape[-1], x.dtype)


@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 64, 128 and 256 take the kernel's vectorized math at the avx2 and avx512 levels; 32 the
# generic loops (the generic level has only those).
@pytest.mark.parametrize("d", [32, 64, 128, 256])
# Sliding windows (with a score scale of their own, as Gemma's): 4 cuts into every
# context, mid-block; 9 leaves the shortest ones whole. Attention sinks (gpt-oss's,
# which alternates windows of its own with full layers) with and without a window.
@pytest.mark.parametrize(
    ("window", "scale", "with_sinks"),
    [(None, None, False), (4, 0.3, False), (9, None, False), (None, None, True), (4, 0.3, True)],
)
def test_paged_attention_matches_dense(
    kv: str,
    dtype: torch.dtype,
    attention_kernel: Library | None,
    d: int,
    window: int | None,
    scale: float | None,
    with_sinks: bool,
) -> None:
    kernel = attention_kernel
    if kernel is not None:
        vectorized = kernels.built_level(kernel) != "generic" and d in (64, 128, 256)
        assert paged.vectorized(kernel, d) == vectorized
    torch.manual_seed(0)
    heads, kv_heads, bs, num_blocks = 6, 2, 4, 64
    backend = SDPABackend(kernel)
    # An int8 pool (kv="int8") holds rows of bytes; every path attends to K/V as the
    # pool holds them, this step's new tokens included.
    if kv == "auto":
        k_cache = torch.zeros(num_blocks, kv_heads, bs, d, dtype=dtype)
    else:
        k_cache = torch.zeros(num_blocks, kv_heads, bs, kv_int8.row_bytes(d), dtype=torch.uint8)
    v_cache = torch.zeros_like(k_cache)

    def stored(x: torch.Tensor) -> torch.Tensor:
        return x if kv == "auto" else kv_int8.quantize(x)

    # Small group: three decodes (contexts 1, 19, 37) and a 5-token chunk after 16 cached
    # tokens; then an SDPA span: 7 tokens after 4 cached. Block ids scattered on purpose.
    perm = torch.randperm(num_blocks).tolist()
    ctxs, new = [1, 19, 37, 21, 11], [1, 1, 1, 5, 7]
    tables = [[perm.pop() for _ in range(-(-c // bs))] for c in ctxs]
    full_k = [torch.randn(c, kv_heads, d, dtype=dtype) for c in ctxs]
    full_v = [torch.randn(c, kv_heads, d, dtype=dtype) for c in ctxs]

    def slots(i: int, positions: range) -> list[int]:
        return [tables[i][p // bs] * bs + p % bs for p in positions]

    for i, c in enumerate(ctxs):  # the cache holds everything but the new tokens
        old = slots(i, range(c - new[i]))
        slots_old = torch.tensor(old, dtype=torch.long)
        blocks, offsets = slots_old // bs, slots_old % bs
        k_cache[blocks, :, offsets] = stored(full_k[i][: c - new[i]])
        v_cache[blocks, :, offsets] = stored(full_v[i][: c - new[i]])
    if window is not None:
        # Positions no query sees hold poison: a path that read them would show it
        # (NaN for the kernel, which must not read them at all; a masked-out value for
        # the padded torch path, which reads and masks).
        poison = float("nan") if kernel is not None else 1e4
        for i, c in enumerate(ctxs):
            hidden = range(max(0, c - new[i] - window + 1))
            gone = torch.tensor(slots(i, hidden), dtype=torch.long)
            bad = stored(torch.full((len(gone), kv_heads, d), poison, dtype=dtype))
            if kv == "int8" and kernel is not None:
                # NaN scales (fp16 0x7E00, little-endian): whatever reads them is NaN.
                bad[..., d::2], bad[..., d + 1 :: 2] = 0x00, 0x7E
            k_cache[gone // bs, :, gone % bs] = bad
            v_cache[gone // bs, :, gone % bs] = bad
    q = torch.randn(sum(new), heads, d, dtype=dtype)
    k = torch.cat([fk[-n:] for fk, n in zip(full_k, new, strict=True)])
    v = torch.cat([fv[-n:] for fv, n in zip(full_v, new, strict=True)])
    slot_mapping = torch.tensor(
        [s for i, c in enumerate(ctxs) for s in slots(i, range(c - new[i], c))]
    )
    width = max(len(t) for t in tables[:4])
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables[:4]])
    row_of = [0, 1, 2, 3, 3, 3, 3, 3]
    visible = torch.tensor([1, 19, 37, 17, 18, 19, 20, 21])
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        num_small_tokens=8,
        small_block_tables=bt,
        small_query_start=torch.tensor([0, 1, 2, 3, 8]),
        small_ctx_end=torch.tensor(ctxs[:4]),
        row_block_tables=bt[row_of],
        row_mask=(torch.arange(width * bs) < visible[:, None])[:, None, None, :],
        row_positions=visible - 1,
        prefills=[
            PrefillSpan(
                q_start=8,
                q_len=7,
                context_slots=torch.tensor(slots(4, range(11))),
                mask=torch.arange(11)[None, :] <= (4 + torch.arange(7))[:, None],
            )
        ],
    )
    # Sinks of either sign, as large as the scores: they move every row's weights.
    sinks = torch.randn(heads) * 2 if with_sinks else None
    out = backend.forward(q, k, v, k_cache, v_cache, meta, window=window, scale=scale, sinks=sinks)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    starts = [0, 1, 2, 3, 8]
    for i in range(5):
        qi = q[starts[i] : starts[i] + new[i]]
        fk, fv = as_stored(full_k[i], kv), as_stored(full_v[i], kv)
        ref = dense_reference(qi, fk, fv, window, scale, sinks)
        got = out[starts[i] : starts[i] + new[i]].float()
        assert torch.allclose(got, ref, atol=tol, rtol=tol), (i, (got - ref).abs().max())


def test_fresh_prefill_uses_causal_attention_on_new_tokens() -> None:
    torch.manual_seed(1)
    q, k, v = torch.randn(7, 4, 16), torch.randn(7, 2, 16), torch.randn(7, 2, 16)
    k_cache = torch.zeros(4, 2, 4, 16)  # [blocks, kv_heads, block_size, d]
    meta = AttentionMetadata(slot_mapping=torch.arange(7), prefills=[PrefillSpan(0, 7)])
    out = SDPABackend(None).forward(q, k, v, k_cache, torch.zeros_like(k_cache), meta)
    assert torch.allclose(out, dense_reference(q, k, v), atol=1e-5)
    assert torch.equal(k_cache.transpose(1, 2).reshape(-1, 2, 16)[:7], k)  # cache written


def test_fresh_prefill_longer_than_the_window_is_masked_to_it() -> None:
    torch.manual_seed(2)
    q, k, v = torch.randn(9, 4, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    k_cache = torch.zeros(4, 2, 4, 16)
    meta = AttentionMetadata(slot_mapping=torch.arange(9), prefills=[PrefillSpan(0, 9)])
    out = SDPABackend(None).forward(q, k, v, k_cache, torch.zeros_like(k_cache), meta, window=3)
    assert torch.allclose(out, dense_reference(q, k, v, window=3), atol=1e-5)
