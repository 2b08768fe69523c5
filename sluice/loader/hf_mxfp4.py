"""MXFP4 tensors of a Hugging Face checkpoint (gpt-oss as released): `X_blocks` [..., rows,
G, 16] uint8, two E2M1 codes a byte (value 2j in the low nibble, 2j + 1 in the high),
and `X_scales` [..., rows, G] uint8, an E8M0 exponent a 32-value block: W = E2M1[code] *
2**(scale - 127), rows by 32 * G columns (transformers' convert_moe_packed_tensors).

That is GGUF's MXFP4 block with the nibbles in another order (GGUF keeps values j and
j + 16 in byte j, and writes the same exponent byte against doubled values, 2**(e -
128)), so each row is rewritten as GGUF blocks and repacked as a GGUF file's are
(gguf_blocks): the experts stay 4-bit codes in memory, never a float copy. A row whose
length the layout cannot take is dequantized to float32 instead.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from sluice.core.quantized_tensor import QuantizedTensor

from . import gguf_blocks

SUFFIXES = ("_blocks", "_scales")
_BLOCK_VALUES = 32


def base_name(name: str) -> str | None:
    """The weight an MXFP4 part belongs to (gate_up_proj for gate_up_proj_blocks)."""
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return None


def _check(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}_blocks and {name}_scales must be uint8 (MXFP4)")
    if blocks.dim() < 3 or blocks.shape[-1] != _BLOCK_VALUES // 2:
        raise ValueError(
            f"{name}_blocks has shape {list(blocks.shape)}; MXFP4 blocks are [..., rows, "
            f"blocks, {_BLOCK_VALUES // 2}]"
        )
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(
            f"{name}_scales has shape {list(scales.shape)}; its blocks "
            f"{list(blocks.shape)} need {list(blocks.shape[:-1])}"
        )


def _as_gguf_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[rows, G, 16] blocks and [rows, G] exponents -> [rows, G * 17] GGUF MXFP4 bytes."""
    low, high = blocks & 0x0F, blocks >> 4
    codes = torch.stack((low, high), dim=-1).flatten(-2)  # [rows, G, 32], natural order
    gguf = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat((scales.unsqueeze(-1), gguf), dim=-1).flatten(-2)


def to_weight(
    name: str, blocks: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor | QuantizedTensor:
    """`name`'s blocks and scales as one [rows, cols] weight (leading dims folded into
    rows, as a stack of experts is kept): E2M1 codes where the layout takes the row
    length, else float32. A defect names the tensor."""
    _check(name, blocks, scales)
    cols = blocks.shape[-2] * _BLOCK_VALUES
    flat_blocks = blocks.reshape(-1, blocks.shape[-2], blocks.shape[-1])
    flat_scales = scales.reshape(-1, scales.shape[-1])
    rows = flat_blocks.shape[0]

    def read_rows(r0: int, r1: int) -> torch.Tensor:
        return _as_gguf_rows(flat_blocks[r0:r1], flat_scales[r0:r1])

    try:
        if gguf_blocks.can_keep("MXFP4", cols):
            return gguf_blocks.repack(read_rows, "MXFP4", rows, cols)
        # As the GGUF loader widens a type it keeps no layout for: gguf's dequantize.
        values = dequantize(read_rows(0, rows).numpy(), GGMLQuantizationType.MXFP4)
        return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(rows, cols))
    except ValueError as exc:
        raise ValueError(f"{name}_scales: {exc}") from None

