"""The int8 KV cache's row format (kv_cache_dtype="int8"), in torch.

A pool of int8 rows is a uint8 tensor [blocks, kv_heads, block_size, row_bytes]: each
(token, kv head) row holds head_dim signed bytes and then one fp16 scale per group of
32 channels (llama.cpp's q8_0 grouping, laid out per row so that a block keeps the
shape the paged kernel streams and a block's bytes stay one slice of the pool, which
copy-on-write and anything that moves whole blocks rely on). Symmetric rounding:
x ~= q * scale, scale = max|x| / 127 rounded to fp16, q = round(x / scale) in
[-127, 127]. The C++ kernels (sluice/kernels/csrc/kv_int8.h) quantize the same way;
these functions serve the torch attention paths (prefills over cached context, the
no-kernel fallback) and the tests.

Per-row scales cost 4 bytes per 64-channel row: 68 bytes against bf16's 128, so the
same memory holds 1.88x the tokens of a bf16 cache (3.76x of an fp32 one).
"""

from __future__ import annotations

import torch

GROUP = 32  # channels per scale


def row_bytes(head_dim: int) -> int:
    """Bytes of one (token, kv head) row of an int8 pool."""
    return head_dim + 2 * (head_dim // GROUP)


def check_head_dim(head_dim: int) -> None:
    if head_dim % GROUP:
        raise ValueError(
            f"kv_cache_dtype='int8' needs head_dim divisible by {GROUP}, got {head_dim}"
        )


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] floats -> [..., row_bytes] uint8 rows."""
    d = x.shape[-1]
    groups = x.float().unflatten(-1, (d // GROUP, GROUP))
    scale = (groups.abs().amax(-1) / 127).to(torch.float16)
    s = scale.float()
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    q = torch.round(groups * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    values = q.flatten(-2).view(torch.uint8)
    scales = scale.view(torch.uint8).reshape(*x.shape[:-1], 2 * (d // GROUP))
    return torch.cat([values, scales], dim=-1)


def dequantize(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """[..., row_bytes] uint8 rows -> [..., head_dim] in `dtype`."""
    values = rows[..., :head_dim].contiguous().view(torch.int8).float()
    scale = rows[..., head_dim:].contiguous().view(torch.float16).float()
    out: torch.Tensor = values.unflatten(-1, (head_dim // GROUP, GROUP)) * scale.unsqueeze(-1)
    return out.flatten(-2).to(dtype)
