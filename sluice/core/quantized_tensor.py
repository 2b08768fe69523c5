"""A weight kept in a block-quantized layout: what a GGUF file's tensors become in memory.

Every GGUF block format is repacked once, at load, into one of four layouts that our
kernels read (sluice/kernels/csrc/qblock.h): 4, 5, 6 or 8 unsigned bits a value, with
one scale d and offset m per group of G = 16 or 32 values along the input dimension,
W = d * u + m (and MXFP4's 4-bit E2M1 codes, looked up into u: E2M1 below). One
structure for every format keeps one kernel per layout instead of one per file type.
A symmetric weight (Q4_0, Q5_0, Q8_0, Q6_K: the file stores no offsets) stores no m:
it is -2**(bits - 1) * d, and `minimum` is an empty tensor.

Scales are float16 a group (Q4_0, Q4_1, Q5_x, Q8_0: what the file has), or integer
(the K-quants): int8 d and m a group times float16 multipliers per 256 values, the
file's super-block (`super_scale` [rows, 1 or 2, cols / 256]: d's multiplier, then m's
unless symmetric). Integer scales keep Q4_K at 4.625 bits a weight (the file: 4.5;
fp16 scales and offsets would make it 5.0) and Q6_K at 6.56 (7.0), and are exact.

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
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sluice.core import host_memory

# MXFP4's values (gpt-oss's experts): 4-bit codes, packed as 4-bit values are, each
# naming an E2M1 number. Where a layout's bit count is asked for, E2M1 stands for
# them (csrc/qblock.h's kQbE2M1, the same code): a code's value u is E2M1_VALUES[code]
# (its E2M1 number doubled, as ggml keeps them, + 16: 4..28) and the weight is
# symmetric with the implied offset -16 scales, a 5-bit weight's.
E2M1 = 20
E2M1_VALUES = torch.tensor([16, 17, 18, 19, 20, 22, 24, 28, 16, 15, 14, 13, 12, 10, 8, 4])
# u -> its code (negative zero, code 8, packs as code 0: the same weight); -1: no code.
_E2M1_CODES = torch.tensor(
    [min((c for c, v in enumerate(E2M1_VALUES.tolist()) if v == u), default=-1) for u in range(29)]
)
LAYOUT_BITS = (4, 5, 6, 8, E2M1)
GROUPS = (16, 32)
# Values under one multiplier of integer scales (a K-quant super-block), and the
# layouts the kernels read with integer scales: Q4_K's, Q5_K's, and Q6_K's (which
# also takes a Q4_K or Q5_K widened to it: q/k beside a Q6_K v).
SUPER = 256
INTEGER_SCALE_LAYOUTS = frozenset({(4, 32), (5, 32), (6, 16)})
_EMPTY_F16 = torch.empty(0, dtype=torch.float16)


@dataclass(frozen=True)
class QuantizedTensor:
    """W [rows, cols] = scale * u + minimum per group of `group` values along cols."""

    bits: int  # 4, 5, 6 or 8, or E2M1 (MXFP4's codes)
    group: int  # 16 or 32
    packed: torch.Tensor  # uint8 [rows, cols * min(bits, 4 or 8) / 8]: nibbles or bytes
    hbits: torch.Tensor  # uint8 [rows, cols / 8] for 5 bits, [rows, cols / 4] for 6, else empty
    scale: torch.Tensor  # [rows, cols / group] float16, or int8 (integer scales)
    minimum: torch.Tensor  # as scale; empty when symmetric
    super_scale: torch.Tensor  # float16 [rows, 1 or 2, cols / 256]; empty for fp16 scales
    source: str = ""  # the file's type name (Q4_K, ...), for logs and stats
    # The same tensors permuted into panels of 32 rows in the int8 GEMM's order
    # (sluice/kernels/qpanel.py): only the qpanel kernels read them; row operations and
    # the reference dequantization refuse.
    panels: bool = False

    @property
    def symmetric(self) -> bool:
        """No stored offsets: minimum = -2**(bits - 1) * scale."""
        return self.minimum.numel() == 0

    @property
    def integer_scales(self) -> bool:
        """int8 scales and offsets with float16 multipliers per 256 values."""
        return self.super_scale.numel() > 0

    @property
    def implied(self) -> float:
        """A symmetric weight's offset as a multiple of its scale."""
        return -16.0 if self.bits == E2M1 else -float(1 << (self.bits - 1))

    def _expand(self, values: torch.Tensor, which: int) -> torch.Tensor:
        """Per-group values as fp32, times their multipliers (integer scales)."""
        if not self.integer_scales:
            return values.float()
        mult = self.super_scale[:, which].float()
        return values.float() * mult.repeat_interleave(SUPER // self.group, dim=1)

    def scales(self) -> torch.Tensor:
        """The per-group scales d [rows, cols / group] as fp32 (exact)."""
        return self._expand(self.scale, 0)

    def offsets(self) -> torch.Tensor:
        """The per-group offsets m [rows, cols / group] as fp32 (exact)."""
        if self.symmetric:
            return self.scales() * self.implied
        return self._expand(self.minimum, 1)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.scale.shape[0], self.scale.shape[1] * self.group)

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(packed, hbits, scale, minimum, super_scale): the kernels' arguments."""
        return (self.packed, self.hbits, self.scale, self.minimum, self.super_scale)

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return self.parts()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def row_major(self) -> QuantizedTensor:
        """self, checked to be in rows (not panels: sluice/kernels/qpanel.py)."""
        if self.panels:
            raise ValueError("this weight is stored in panels; only the qpanel kernels read it")
        return self

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedTensor:
        """fn applied to every tensor along rows (empty ones stay empty)."""
        self.row_major()
        packed, hbits, scale, minimum, sup = (fn(t) if t.numel() else t for t in self._tensors())
        return dataclasses.replace(
            self, packed=packed, hbits=hbits, scale=scale, minimum=minimum, super_scale=sup
        )

    def rows(self, index: torch.Tensor) -> QuantizedTensor:
        """The rows `index` (rows are independent in every layout)."""
        return self._map(lambda t: _take_rows(t, index))

    def row_slice(self, start: int, stop: int) -> QuantizedTensor:
        """Rows start..stop, as views (no copy)."""
        return self._map(lambda t: t[start:stop])

    def widened(self, bits: int, group: int) -> QuantizedTensor:
        """The same values in a layout of at least as many bits and as fine a group:
        exact (u is unchanged; a finer group repeats the scale and offset)."""
        self.row_major()
        if (bits, group) == (self.bits, self.group):
            return self
        if bits == E2M1 or _width(bits) < _width(self.bits) or group > self.group:
            raise ValueError(f"cannot widen {self.bits}/{self.group} to {bits}/{group}")
        # Explicit offsets: a symmetric weight's implied ones depend on its bits.
        w = self.with_offsets()
        repeat = self.group // group
        return pack(
            unpack_values(w),
            w.scale.repeat_interleave(repeat, dim=1),
            w.minimum.repeat_interleave(repeat, dim=1),
            bits,
            group,
            w.source,
            w.super_scale if w.integer_scales else None,
        )

    def with_offsets(self) -> QuantizedTensor:
        """The same weight with its offsets stored (for joining asymmetric ones); exact:
        m = implied * d, a power-of-two multiple (of the multiplier, with integer
        scales, whose offsets are then the scales themselves)."""
        if not self.symmetric:
            return self
        if not self.integer_scales:
            return dataclasses.replace(self, minimum=self.offsets().to(torch.float16))
        sup = torch.cat([self.super_scale, self.super_scale * self.implied], dim=1)
        return dataclasses.replace(self, minimum=self.scale.clone(), super_scale=sup)

    def with_float_scales(self) -> QuantizedTensor:
        """The same weight with float16 scales and offsets a group (rounded: d =
        multiplier * integer has up to 19 significant bits)."""
        if not self.integer_scales:
            return self
        minimum = _EMPTY_F16 if self.symmetric else self.offsets().to(torch.float16)
        return dataclasses.replace(
            self, scale=self.scales().to(torch.float16), minimum=minimum, super_scale=_EMPTY_F16
        )


def concat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Stack weights along rows (q, k and v into one QKV weight), widening them to
    one common layout first where their formats differ (exact, see `widened`).
    Integer scales are kept where every part has them in a layout that has them."""
    if len(parts) == 1:
        return parts[0]
    formats = {p.bits for p in parts}
    # E2M1 joins only E2M1; with others, the values it stands for (5 bits) are widened.
    bits = E2M1 if formats == {E2M1} else max(_width(b) for b in formats)
    group = min(p.group for p in parts)
    integer = all(p.integer_scales for p in parts) and (bits, group) in INTEGER_SCALE_LAYOUTS
    if not integer:
        parts = [p.with_float_scales() for p in parts]
    parts = [p.widened(bits, group) for p in parts]
    if not all(p.symmetric for p in parts):
        parts = [p.with_offsets() for p in parts]
    sources = sorted({p.source for p in parts})
    return QuantizedTensor(
        bits,
        group,
        _cat([p.packed for p in parts]),
        _cat([p.hbits for p in parts]) if bits in (5, 6) else parts[0].hbits,
        _cat([p.scale for p in parts]),
        _cat([p.minimum for p in parts]),
        _cat([p.super_scale for p in parts]) if integer else _EMPTY_F16,
        "+".join(sources),
    )


def _take_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[index] as a tensor of its own, a 1-D index's in memory held for the model's
    lifetime (host_memory: a load reorders and selects whole weights this way)."""
    if index.dim() != 1 or index.dtype == torch.bool:
        return t[index].contiguous()
    out = host_memory.zeroed((index.numel(), *t.shape[1:]), t.dtype, t.device)
    return torch.index_select(t, 0, index.to(t.device), out=out)


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Rows stacked into memory held for the model's lifetime (host_memory)."""
    shape = (sum(t.shape[0] for t in tensors), *tensors[0].shape[1:])
    return torch.cat(tensors, out=host_memory.zeroed(shape, tensors[0].dtype, tensors[0].device))


def _width(bits: int) -> int:
    """The bits a layout's values u need (E2M1's 4..28: 5)."""
    return 5 if bits == E2M1 else bits


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
    super_scale: torch.Tensor | None = None,
) -> QuantizedTensor:
    """Pack unsigned values u [N, K] (uint8, each below 2**bits; for E2M1 entries of
    E2M1_VALUES) with their per-group scale and offset [N, K / group] into the layout;
    minimum None (or empty) for a symmetric weight (offset -2**(bits - 1) * scale, -16
    for E2M1, not stored). Float scales are
    stored as float16; with `super_scale` [N, 1 or 2, K / 256] the scales and offsets
    are integers in int8's range, multiplied by it (see QuantizedTensor)."""
    if bits not in LAYOUT_BITS or group not in GROUPS:
        raise ValueError(f"no layout for {bits} bits in groups of {group}")
    n, k = u.shape
    if k % 64:
        raise ValueError(f"the input dimension ({k}) must be a multiple of 64")
    if minimum is not None and not minimum.numel():
        minimum = None
    if super_scale is not None:
        if (bits, group) not in INTEGER_SCALE_LAYOUTS or k % SUPER:
            raise ValueError(f"no integer-scale layout for {bits}/{group} with {k} columns")
        if tuple(super_scale.shape) != (n, 1 if minimum is None else 2, k // SUPER):
            raise ValueError(f"super_scale must be [{n}, 1 or 2, {k // SUPER}]")
    fmt = torch.float16 if super_scale is None else torch.int8
    if bits == E2M1:  # the values as their codes
        codes = _E2M1_CODES[u.long().clamp(0, 28)]
        if bool((codes < 0).any() | (u > 28).any()):
            raise ValueError("E2M1 values must be E2M1_VALUES entries (doubled E2M1 + 16)")
        u = codes
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
    stored = torch.empty(0, dtype=fmt) if minimum is None else minimum.to(fmt).contiguous()
    return QuantizedTensor(
        bits,
        group,
        packed.contiguous(),
        hbits.contiguous(),
        scale.to(fmt).contiguous(),
        stored,
        _EMPTY_F16 if super_scale is None else super_scale.to(torch.float16).contiguous(),
        source,
    )


def quantize_8bit(w: torch.Tensor, group: int = 32) -> QuantizedTensor:
    """A float weight [N, K] as 8-bit values with one float16 scale per `group` along K
    (llama.cpp's Q8_0): for weights that come as floats but run on the block kernels."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    d = (g.abs().amax(-1) / 127).to(torch.float16)
    df = d.float()[..., None]
    q = torch.where(df > 0, torch.round(g / df.clamp_min(1e-30)), 0.0).clamp(-127, 127)
    return pack((q + 128).to(torch.uint8).reshape(n, k), d, None, 8, group, source="Q8_0")


def unpack_values(qt: QuantizedTensor) -> torch.Tensor:
    """The unsigned values u [N, K] (uint8) in natural order."""
    qt.row_major()
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
    elif qt.bits == E2M1:
        pos = E2M1_VALUES.to(torch.uint8)[pos.long()]
    return _from_positions(pos)


def dequantize(qt: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [N, K] in `dtype`, computed in fp32 (the reference the kernels are held to)."""
    n, k = qt.shape
    u = unpack_values(qt).float().reshape(n, k // qt.group, qt.group)
    w = u * qt.scales()[..., None] + qt.offsets()[..., None]
    return w.reshape(n, k).to(dtype)


# A checkpoint's tensor: dense, or a GGUF's blocks kept quantized.
Weight = torch.Tensor | QuantizedTensor


def weight_rows(w: Weight, index: torch.Tensor) -> Weight:
    """Rows `index` of a dense or quantized weight, as tensors of their own."""
    return w.rows(index) if isinstance(w, QuantizedTensor) else w[index]
