"""GGUF block formats -> sluice's quantized layouts (sluice/core/quantized_tensor.py).

Each decoder reads a tensor's raw blocks and returns its unsigned values, in natural
order, with one scale and offset per group, so that W = scale * u + offset exactly as
ggml defines the format (checked against `gguf.quants.dequantize` in
tests/test_gguf_blocks.py). The values are never widened to floats: a 4-bit file
stays 4 bits in memory.

Layouts chosen (bits / group): Q4_0, Q4_1, Q4_K -> 4/32; Q5_0, Q5_1, Q5_K -> 5/32;
Q8_0 -> 8/32; Q6_K -> 6/16; MXFP4 -> E2M1/32 (its 4-bit codes as stored, looked up
by the kernels), at 4.5 bits a weight for the file's 4.25 (a float16 scale a block
where the file has an 8-bit exponent). The symmetric formats (Q4_0, Q5_0, Q8_0, Q6_K,
MXFP4: an offset of -2**(bits - 1) scales, -16 for E2M1) store no offsets; they are
implied. Q6_K then costs 7 bits a
weight against the file's 6.56 (as bytes with fp16 offsets it was 10, and Q6_K holds
a Q4_K_M file's output head and half its down projections: ~20% of a decode step's
weight reads on Qwen2.5-Coder-1.5B); Q5_0 5.5 for the file's 5.5, Q8_0 8.5 for 8.5.
K-quant scales and offsets are products of a float16 super-block scale (d, dmin) and
a 6- or 8-bit integer; they stay so (integer scales: int8 a group, float16 per 256
values), exact, at 4.625 bits a weight for Q4_K's 4.5 and 6.56 for Q6_K's (fp16 scales
a group, as the other formats have, cost 5.0 and 7.0: 7% more bytes a decode step on
Qwen2.5-Coder-1.5B, whose decode is bound by them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sluice import kernels
from sluice.core import host_memory
from sluice.core.quantized_tensor import E2M1, E2M1_VALUES, QuantizedTensor, pack
from sluice.kernels import repack as repack_kernel

# (values, scale, offset, multipliers): u [blocks, block values] uint8, scale/offset
# [blocks, groups]; offset None for a symmetric format (-2**(bits - 1) * scale, not
# stored); multipliers None, or for the K-quants [blocks, 1 or 2] (d, and -dmin unless
# symmetric) by which the integer scale and offset are multiplied.
Decoded = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def _f16(raw: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of every block, as fp32 [blocks, 1]."""
    return raw[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """GGUF's 32-value nibble block: byte j holds value j (low) and j + 16 (high)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits_of(words: torch.Tensor, count: int) -> torch.Tensor:
    """Bits 0..count-1 of little-endian bytes [blocks, count / 8] -> [blocks, count]."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((words[..., None] >> shifts) & 1).reshape(words.shape[0], count)


def _q4_0(raw: torch.Tensor) -> Decoded:
    return _nibbles(raw[:, 2:18]), _f16(raw, 0), None, None  # offset -8 * d


def _q4_1(raw: torch.Tensor) -> Decoded:
    return _nibbles(raw[:, 4:20]), _f16(raw, 0), _f16(raw, 2), None


def _q5_0(raw: torch.Tensor) -> Decoded:
    u = _nibbles(raw[:, 6:22]) | (_bits_of(raw[:, 2:6], 32) << 4)
    return u, _f16(raw, 0), None, None  # offset -16 * d


def _q5_1(raw: torch.Tensor) -> Decoded:
    u = _nibbles(raw[:, 8:24]) | (_bits_of(raw[:, 4:8], 32) << 4)
    return u, _f16(raw, 0), _f16(raw, 2), None


def _q8_0(raw: torch.Tensor) -> Decoded:
    u = (raw[:, 2:34].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    return u, _f16(raw, 0), None, None  # offset -128 * d


# The largest power of two a float16 scale holds; smaller than 2**-24 flushes to zero.
_F16_MAX_EXPONENT = 15


def _mxfp4(raw: torch.Tensor) -> Decoded:
    """MXFP4 (gpt-oss's experts): an E8M0 exponent byte e, then 32 E2M1 codes as Q4_0
    orders nibbles; W = kvalues[code] * 2**(e - 128), kvalues the E2M1 numbers doubled
    (ggml's kvalues_mxfp4, integers -12..12). As the E2M1 layout holds them: u =
    kvalues + 16 (E2M1_VALUES[code]), offset -16 * scale, the scale a power of two that
    float16 holds from 2**-24 to 2**15 (a block scaled below 2**-24, |W| < 4e-7, is
    flushed to zero; one above 2**15 is refused)."""
    exponent = raw[:, 0:1].to(torch.int32) - 128
    if int(exponent.max()) > _F16_MAX_EXPONENT:
        top = int(exponent.max())
        raise ValueError(f"MXFP4 block scale 2**{top} is beyond float16's range (above 2**15)")
    u = E2M1_VALUES.to(torch.uint8)[_nibbles(raw[:, 1:17]).long()]
    return u, torch.ldexp(torch.ones(1), exponent.float()), None, None


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and minimums packed in 12 bytes (ggml's get_scale_min_k4)."""
    lo_sc, lo_mn = s[:, 0:4] & 63, s[:, 4:8] & 63
    hi_sc = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    hi_mn = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], 1).float(), torch.cat([lo_mn, hi_mn], 1).float()


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K values: each 32 bytes hold sub-block 2i (low nibbles) and 2i + 1."""
    q = qs.reshape(-1, 4, 1, 32)
    return torch.cat([q & 0x0F, q >> 4], dim=2).reshape(-1, 256)


def _q4_k(raw: torch.Tensor) -> Decoded:
    sc, mn = _k_scales(raw[:, 4:16])
    return _k_nibbles(raw[:, 16:144]), sc, mn, torch.cat([_f16(raw, 0), -_f16(raw, 2)], 1)


def _q5_k(raw: torch.Tensor) -> Decoded:
    sc, mn = _k_scales(raw[:, 4:16])
    # Bit i of qh[l] is the fifth bit of value l of sub-block i.
    high = _bits_of(raw[:, 16:48], 256).reshape(-1, 32, 8).transpose(1, 2).reshape(-1, 256)
    mult = torch.cat([_f16(raw, 0), -_f16(raw, 2)], 1)
    return _k_nibbles(raw[:, 48:176]) | (high << 4), sc, mn, mult


def _q6_k(raw: torch.Tensor) -> Decoded:
    ql = raw[:, 0:128].reshape(-1, 2, 2, 32)  # [half, l + 0 / l + 32, 32]
    qh = raw[:, 128:192].reshape(-1, 2, 1, 32)
    sc = raw[:, 192:208].view(torch.int8).float()
    # Per 128-value half: values 0-31 / 32-63 are ql's low nibbles, 64-127 the high
    # ones; qh's bit pairs 0-1, 2-3, 4-5, 6-7 top them up in that order.
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2)  # [half, 4 quarters, 32]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    u = (low | (((qh >> shifts) & 3) << 4)).reshape(-1, 256)
    return u, sc, None, _f16(raw, 208)  # offset -32 * scale


# type name -> (values a block, bytes a block, decoder, layout bits, layout group)
FORMATS: dict[str, tuple[int, int, Callable[[torch.Tensor], Decoded], int, int]] = {
    "Q4_0": (32, 18, _q4_0, 4, 32),
    "Q4_1": (32, 20, _q4_1, 4, 32),
    "Q5_0": (32, 22, _q5_0, 5, 32),
    "Q5_1": (32, 24, _q5_1, 5, 32),
    "Q8_0": (32, 34, _q8_0, 8, 32),
    "Q4_K": (256, 144, _q4_k, 4, 32),
    "Q5_K": (256, 176, _q5_k, 5, 32),
    "Q6_K": (256, 210, _q6_k, 6, 16),
    "MXFP4": (32, 17, _mxfp4, E2M1, 32),
}


def can_keep(type_name: str, cols: int) -> bool:
    """Whether a tensor of this type and row length stays quantized in memory."""
    return type_name in FORMATS and cols % 64 == 0 and cols % FORMATS[type_name][0] == 0


def repack(
    raw: torch.Tensor | Callable[[int, int], torch.Tensor], type_name: str, rows: int, cols: int
) -> QuantizedTensor:
    """A GGUF tensor's raw bytes (rows of blocks) in our layout. `raw` is the bytes, or
    a function reading rows r0..r1 of them (from the file). Row chunks are decoded into
    the preallocated result, so a load holds the result plus a few MB of raw and
    decoded values at a time, never two copies of a large tensor."""
    per_block, nbytes, decode, bits, group = FORMATS[type_name]
    row_bytes = (cols // per_block) * nbytes
    if isinstance(raw, torch.Tensor):
        whole = raw.reshape(rows, row_bytes)
        raw = lambda r0, r1: whole[r0:r1]  # noqa: E731
    lib = kernels.load()
    if lib is not None and type_name in repack_kernel.FORMAT_CODES:
        return _repack_in_c(lib, raw, type_name, rows, cols)
    chunk = max(1, (1 << 22) // cols)
    fields = ("packed", "hbits", "scale", "minimum", "super_scale")
    result: dict[str, torch.Tensor] = {}
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        u, part_scale, offset, mult = decode(raw(r0, r1).reshape(-1, nbytes))
        # Every decoder yields one scale and offset per layout group (and the K-quants
        # one or two multipliers per 256-value block).
        n, ng = r1 - r0, cols // group
        part = pack(
            u.reshape(n, cols),
            part_scale.reshape(n, ng),
            None if offset is None else offset.reshape(n, ng),
            bits,
            group,
            type_name,
            None if mult is None else mult.reshape(n, -1, mult.shape[1]).transpose(1, 2),
        )
        for name in fields:
            t = getattr(part, name)
            if not t.numel():  # the layout's convention: empty, not [rows, 0]
                result.setdefault(name, t)
                continue
            if name not in result:
                result[name] = host_memory.zeroed((rows, *t.shape[1:]), t.dtype)
            result[name][r0:r1] = t
    packed, hbits, scale, minimum, super_scale = (result[name] for name in fields)
    return QuantizedTensor(bits, group, packed, hbits, scale, minimum, super_scale, type_name)


# Values the C repack takes per call (a chunk of rows: a few MB of file read at a time).
C_CHUNK_VALUES = 1 << 24


def _repack_in_c(
    lib: kernels.Library,
    raw: Callable[[int, int], torch.Tensor],
    type_name: str,
    rows: int,
    cols: int,
) -> QuantizedTensor:
    """`repack` by the kernels' C code (csrc/gguf_repack.cpp: the same bytes), a chunk
    of rows at a time straight into the result."""
    per_block, nbytes, decode, bits, group = FORMATS[type_name]
    row_bytes = cols // per_block * nbytes
    # Which parts the format has, as its decoder says: offsets, integer scales.
    _, _, offset, mult = decode(torch.zeros(1, nbytes, dtype=torch.uint8))
    offsets, integer = offset is not None, mult is not None
    fmt = torch.int8 if integer else torch.float16
    hbits_cols = {5: cols // 8, 6: cols // 4}.get(bits, 0)

    def rows_of(shape: tuple[int, ...], dtype: torch.dtype, present: bool = True) -> torch.Tensor:
        if not present:
            return torch.empty(0, dtype=dtype)  # the layout's convention for a missing part
        return host_memory.zeroed((rows, *shape), dtype)

    parts = (
        rows_of((cols if bits == 8 else cols // 2,), torch.uint8),
        rows_of((hbits_cols,), torch.uint8, hbits_cols > 0),
        rows_of((cols // group,), fmt),
        rows_of((cols // group,), fmt, offsets),
        rows_of((2 if offsets else 1, cols // 256), torch.float16, integer),
    )
    chunk = max(1, C_CHUNK_VALUES // cols)
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        block_rows = raw(r0, r1).contiguous()
        if block_rows.numel() != (r1 - r0) * row_bytes:  # the C code reads exactly this
            raise ValueError(f"{type_name} rows of {cols} values must be {row_bytes} bytes each")
        outs = [t[r0:r1] if t.numel() else t for t in parts]
        repack_kernel.gguf_repack(lib, block_rows, type_name, cols, outs)
    return QuantizedTensor(bits, group, *parts, type_name)
