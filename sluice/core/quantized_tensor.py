"""A weight kept in a block-quantized layout: what a GGUF file's tensors become in memory.

Every GGUF block format is repacked once, at load, into one of three layouts that our
kernels read (sluice/kernels/csrc/qblock.h): 4, 5 or 8 unsigned bits a value, with one
float16 scale d and offset m per group of G = 16 or 32 values along the input
dimension, W = d * u + m. One structure for every format keeps one kernel per layout
instead of one per file type, at a small cost in bytes where a format's own scales
are finer-packed (Q4_K's 6-bit scales become fp16: 5.0 bits a weight where the file
has 4.5).

Along K the values are stored in pairs of 32-blocks whose 64 positions hold
b0[0:16], b1[0:16], b0[16:32], b1[16:32]: the order the kernels quantize activations
in, so their inner loops never shuffle. 4- and 5-bit values keep their low nibbles two
a byte (position j low, 32 + j high, per pair); 5-bit values add a bit plane (bit i of
a pair's little-endian uint64 is bit 4 of position i).

This module is pure torch: the layout, packing, and a reference dequantization that
also serves devices without our kernels.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

LAYOUT_BITS = (4, 5, 8)
GROUPS = (16, 32)


@dataclass(frozen=True)
class QuantizedTensor:
    """W [rows, cols] = scale * u + minimum per group of `group` values along cols."""

    bits: int  # 4, 5 or 8
    group: int  # 16 or 32
    packed: torch.Tensor  # uint8 [rows, cols * min(bits, 4 or 8) / 8]: nibbles or bytes
    hbits: torch.Tensor  # uint8 [rows, cols / 8] for 5 bits, else empty
    scale: torch.Tensor  # float16 [rows, cols / group]
    minimum: torch.Tensor  # float16 [rows, cols / group]
    source: str = ""  # the file's type name (Q4_K, ...), for logs and stats

    @property
    def shape(self) -> tuple[int, int]:
        return (self.scale.shape[0], self.scale.shape[1] * self.group)

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.packed, self.hbits, self.scale, self.minimum)
        )

    def rows(self, index: torch.Tensor) -> QuantizedTensor:
        """The rows `index` (rows are independent in every layout)."""
        hbits = self.hbits[index] if self.hbits.numel() else self.hbits
        return QuantizedTensor(
            self.bits,
            self.group,
            self.packed[index].contiguous(),
            hbits.contiguous(),
            self.scale[index].contiguous(),
            self.minimum[index].contiguous(),
            self.source,
        )

    def row_slice(self, start: int, stop: int) -> QuantizedTensor:
        """Rows start..stop, as views (no copy)."""
        hbits = self.hbits[start:stop] if self.hbits.numel() else self.hbits
        return dataclasses.replace(
            self,
            packed=self.packed[start:stop],
            hbits=hbits,
            scale=self.scale[start:stop],
            minimum=self.minimum[start:stop],
        )

    def widened(self, bits: int, group: int) -> QuantizedTensor:
        """The same values in a layout of at least as many bits and as fine a group:
        exact (u is unchanged; a finer group repeats the scale and offset)."""
        if bits < self.bits or group > self.group:
            raise ValueError(f"cannot widen {self.bits}/{self.group} to {bits}/{group}")
        if (bits, group) == (self.bits, self.group):
            return self
        u = unpack_values(self)
        repeat = self.group // group
        scale = self.scale.repeat_interleave(repeat, dim=1)
        minimum = self.minimum.repeat_interleave(repeat, dim=1)
        return pack(u, scale, minimum, bits, group, self.source)


def concat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Stack weights along rows (q, k and v into one QKV weight), widening them to
    one common layout first where their formats differ (exact, see `widened`)."""
    if len(parts) == 1:
        return parts[0]
    bits = max(p.bits for p in parts)
    group = min(p.group for p in parts)
    parts = [p.widened(bits, group) for p in parts]
    sources = sorted({p.source for p in parts})
    return QuantizedTensor(
        bits,
        group,
        torch.cat([p.packed for p in parts]),
        torch.cat([p.hbits for p in parts]) if bits == 5 else parts[0].hbits,
        torch.cat([p.scale for p in parts]),
        torch.cat([p.minimum for p in parts]),
        "+".join(sources),
    )


def _to_positions(u: torch.Tensor) -> torch.Tensor:
    """[N, K] natural order -> [N, K/64, 64] pair positions."""
    n, k = u.shape
    return u.reshape(n, k // 64, 2, 2, 16).permute(0, 1, 3, 2, 4).reshape(n, k // 64, 64)


def _from_positions(pos: torch.Tensor) -> torch.Tensor:
    """[N, K/64, 64] pair positions -> [N, K] natural order."""
    n, p, _ = pos.shape
    return pos.reshape(n, p, 2, 2, 16).permute(0, 1, 3, 2, 4).reshape(n, p * 64)


_BIT_WEIGHTS = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)


def pack(
    u: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    bits: int,
    group: int,
    source: str = "",
) -> QuantizedTensor:
    """Pack unsigned values u [N, K] (uint8, each below 2**bits) with their per-group
    float scale and offset [N, K / group] into the layout."""
    if bits not in LAYOUT_BITS or group not in GROUPS:
        raise ValueError(f"no layout for {bits} bits in groups of {group}")
    n, k = u.shape
    if k % 64:
        raise ValueError(f"the input dimension ({k}) must be a multiple of 64")
    pos = _to_positions(u.to(torch.uint8))
    hbits = torch.empty(0, dtype=torch.uint8)
    if bits == 8:
        packed = pos.reshape(n, k)
    else:
        low = pos & 0x0F
        packed = (low[..., :32] | (low[..., 32:] << 4)).reshape(n, k // 2)
        if bits == 5:
            plane = ((pos >> 4) & 1).reshape(n, k // 64, 8, 8)
            hbits = (plane * _BIT_WEIGHTS).sum(-1, dtype=torch.uint8).reshape(n, k // 8)
    return QuantizedTensor(
        bits,
        group,
        packed.contiguous(),
        hbits.contiguous(),
        scale.to(torch.float16).contiguous(),
        minimum.to(torch.float16).contiguous(),
        source,
    )


def unpack_values(qt: QuantizedTensor) -> torch.Tensor:
    """The unsigned values u [N, K] (uint8) in natural order."""
    n, k = qt.shape
    if qt.bits == 8:
        return _from_positions(qt.packed.reshape(n, k // 64, 64))
    pairs = qt.packed.reshape(n, k // 64, 32)
    pos = torch.cat([pairs & 0x0F, pairs >> 4], dim=-1)
    if qt.bits == 5:
        plane = qt.hbits.reshape(n, k // 64, 8, 1) & _BIT_WEIGHTS
        pos = pos | ((plane != 0).to(torch.uint8) << 4).reshape(n, k // 64, 64)
    return _from_positions(pos)


def dequantize(qt: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [N, K] in `dtype`, computed in fp32 (the reference the kernels are held to)."""
    n, k = qt.shape
    u = unpack_values(qt).float().reshape(n, k // qt.group, qt.group)
    w = u * qt.scale.float()[..., None] + qt.minimum.float()[..., None]
    return w.reshape(n, k).to(dtype)
