"""A weight kept in a block-quantized layout: what a GGUF file's tensors become in memory.

Every GGUF block format is repacked once, at load, into one of four layouts that our
kernels read (sluice/kernels/csrc/qblock.h): 4, 5, 6 or 8 unsigned bits a value, with
one float16 scale d and offset m per group of G = 16 or 32 values along the input
dimension, W = d * u + m. One structure for every format keeps one kernel per layout
instead of one per file type, at a small cost in bytes where a format's own scales
are finer-packed (Q4_K's 6-bit scales become fp16: 5.0 bits a weight where the file
has 4.5). A symmetric weight (Q4_0, Q5_0, Q8_0, Q6_K: the file stores no offsets)
stores no m: it is -2**(bits - 1) * d, and `minimum` is an empty tensor (Q6_K: 7 bits
a weight against the file's 6.56, where fp16 offsets would make it 8).

Along K the values are stored in pairs of 32-blocks whose 64 positions hold
b0[0:16], b1[0:16], b0[16:32], b1[16:32]: the order the kernels quantize activations
in, so their inner loops never shuffle. 4-, 5- and 6-bit values keep their low nibbles
two a byte (position j low, 32 + j high, per pair); 5-bit values add a bit plane (bit i
of a pair's little-endian uint64 is bit 4 of position i); 6-bit values add 16 bytes a
pair, byte i holding bits 4-5 of positions i, 16 + i, 32 + i, 48 + i in its bit pairs
0-1, 2-3, 4-5, 6-7 (one run's high bits are one shift of the same bytes).

This module is pure torch: the layout, packing, and a reference dequantization that
also serves devices without our kernels.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

LAYOUT_BITS = (4, 5, 6, 8)
GROUPS = (16, 32)


@dataclass(frozen=True)
class QuantizedTensor:
    """W [rows, cols] = scale * u + minimum per group of `group` values along cols."""

    bits: int  # 4, 5, 6 or 8
    group: int  # 16 or 32
    packed: torch.Tensor  # uint8 [rows, cols * min(bits, 4 or 8) / 8]: nibbles or bytes
    hbits: torch.Tensor  # uint8 [rows, cols / 8] for 5 bits, [rows, cols / 4] for 6, else empty
    scale: torch.Tensor  # float16 [rows, cols / group]
    minimum: torch.Tensor  # float16 [rows, cols / group]; empty when symmetric
    source: str = ""  # the file's type name (Q4_K, ...), for logs and stats

    @property
    def symmetric(self) -> bool:
        """No stored offsets: minimum = -2**(bits - 1) * scale."""
        return self.minimum.numel() == 0

    def offsets(self) -> torch.Tensor:
        """The per-group offsets m [rows, cols / group] as float16 (made for a
        symmetric weight: exact, a power-of-two multiple of the scale)."""
        if self.symmetric:
            return (self.scale.float() * -float(1 << (self.bits - 1))).to(torch.float16)
        return self.minimum

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

        def take(t: torch.Tensor) -> torch.Tensor:  # empty hbits/minimum stay empty
            return t[index].contiguous() if t.numel() else t

        return QuantizedTensor(
            self.bits,
            self.group,
            take(self.packed),
            take(self.hbits),
            take(self.scale),
            take(self.minimum),
            self.source,
        )

    def row_slice(self, start: int, stop: int) -> QuantizedTensor:
        """Rows start..stop, as views (no copy)."""

        def cut(t: torch.Tensor) -> torch.Tensor:
            return t[start:stop] if t.numel() else t

        return dataclasses.replace(
            self,
            packed=cut(self.packed),
            hbits=cut(self.hbits),
            scale=cut(self.scale),
            minimum=cut(self.minimum),
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
        # Explicit offsets: a symmetric weight's implied ones depend on its bits.
        minimum = self.offsets().repeat_interleave(repeat, dim=1)
        return pack(u, scale, minimum, bits, group, self.source)

    def with_offsets(self) -> QuantizedTensor:
        """The same weight with its offsets stored (for joining asymmetric ones)."""
        return dataclasses.replace(self, minimum=self.offsets()) if self.symmetric else self


def concat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Stack weights along rows (q, k and v into one QKV weight), widening them to
    one common layout first where their formats differ (exact, see `widened`)."""
    if len(parts) == 1:
        return parts[0]
    bits = max(p.bits for p in parts)
    group = min(p.group for p in parts)
    parts = [p.widened(bits, group) for p in parts]
    if not all(p.symmetric for p in parts):
        parts = [p.with_offsets() for p in parts]
    sources = sorted({p.source for p in parts})
    return QuantizedTensor(
        bits,
        group,
        torch.cat([p.packed for p in parts]),
        torch.cat([p.hbits for p in parts]) if bits in (5, 6) else parts[0].hbits,
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


_PAIR_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)


def pack(
    u: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor | None,
    bits: int,
    group: int,
    source: str = "",
) -> QuantizedTensor:
    """Pack unsigned values u [N, K] (uint8, each below 2**bits) with their per-group
    float scale and offset [N, K / group] into the layout; minimum None for a
    symmetric weight (offset -2**(bits - 1) * scale, not stored)."""
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
        elif bits == 6:
            runs = ((pos >> 4) & 3).reshape(n, k // 64, 4, 16)  # [.., run j, byte i]
            shifted = runs << _PAIR_SHIFTS.view(1, 1, 4, 1)
            hbits = shifted.sum(2, dtype=torch.uint8).reshape(n, k // 4)
    stored = (
        torch.empty(0, dtype=torch.float16)
        if minimum is None
        else minimum.to(torch.float16).contiguous()
    )
    return QuantizedTensor(
        bits,
        group,
        packed.contiguous(),
        hbits.contiguous(),
        scale.to(torch.float16).contiguous(),
        stored,
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
    elif qt.bits == 6:
        high = (qt.hbits.reshape(n, k // 64, 1, 16) >> _PAIR_SHIFTS.view(1, 1, 4, 1)) & 3
        pos = pos | (high << 4).reshape(n, k // 64, 64)
    return _from_positions(pos)


def dequantize(qt: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [N, K] in `dtype`, computed in fp32 (the reference the kernels are held to)."""
    n, k = qt.shape
    u = unpack_values(qt).float().reshape(n, k // qt.group, qt.group)
    w = u * qt.scale.float()[..., None] + qt.offsets().float()[..., None]
    return w.reshape(n, k).to(dtype)
