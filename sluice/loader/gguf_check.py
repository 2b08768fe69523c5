"""A GGUF file's structure checked before anything trusts it.

Model files are untrusted input: people download them. The `gguf` library's reader
maps the file and believes its counts, lengths and offsets, so a truncated download or
a hostile file fails deep inside numpy (``cannot reshape array of size 0``) or, in
other engines' readers, reads out of bounds (llama.cpp CVE-2025-53630, Ollama
CVE-2026-7482). ``check_gguf`` walks the header first with bounded reads and checks
what the reader would take on faith: the magic and version, every count and length
against the bytes left in the file (before anything is sized by it), value types,
array nesting, unique keys and tensor names, tensor dimensions (1-4, positive, a whole
number of blocks, element count within bounds), known tensor types, the alignment (a
power of two), and each tensor's data inside the file, aligned and not overlapping
another's. A defect is one `ModelFileError` naming the file, the key or tensor, and
what is wrong ("tensor blk.3.ffn_up.weight ends at byte 4,312,000,512, past the end of
the 98,362,432-byte file: truncated download?").

It costs one pass over the header (the vocabulary's strings are skipped by length,
not decoded): about 60 ms for Qwen2.5's 150k-token vocabulary and merges.

The same walk is the loader's GGUF reader (`read_gguf_header`): it records where each
value lies and each tensor's type, dimensions and data, and `decode_value` decodes a
value later with the same bounded reads. The `gguf` library's reader builds a numpy view
per element of every array: 8-16 s of one CPU for a 150k-262k-token vocabulary, paid by
every new file (the tests write hundreds), against ~0.1 s here.
"""

from __future__ import annotations

import itertools
import mmap
import os
import struct
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from sluice.core.errors import ModelFileError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 4  # no real file nests arrays at all; bounded so a hostile one ends
MAX_KEY_BYTES = 65_535
MAX_ELEMENTS = 1 << 50  # far above any real tensor, far below an overflow
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"

# GGUF value types: their fixed sizes (STRING and ARRAY have none).
_STRING, _ARRAY = 8, 9
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# The smallest encoding of one entry, to bound a count by the bytes left.
_MIN_KV = 8 + 1 + 4 + 1  # key length, one key byte, value type, the smallest value
_MIN_TENSOR = 8 + 1 + 4 + 8 + 4 + 8  # name length and a byte, n_dims, one dim, type, offset


@dataclass(frozen=True)
class TensorSpan:
    """Where a tensor's data lies in the file."""

    name: str
    start: int
    end: int


@dataclass(frozen=True)
class GGUFTensor:
    """A tensor's entry in the header, checked."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the row length (ne0) first
    data_offset: int  # from the start of the file
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """What the walk found: where each key's value lies (its type and byte position, for
    `decode_value`) and the tensors, in the file's order."""

    fields: dict[str, tuple[int, int]]
    tensors: list[GGUFTensor]


class _Cursor:
    """Bounded little-endian reads over the file; running past its end is a defect."""

    def __init__(self, data: mmap.mmap | bytes, path: str) -> None:
        self.data = data
        self.size = len(data)
        self.pos = 0
        self.path = path

    def fail(self, what: str) -> ModelFileError:
        return ModelFileError(self.path, what)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(
                f"{what} needs {n:,} bytes at byte {self.pos:,}, past the end of the "
                f"{self.size:,}-byte file: truncated download?"
            )

    def unpack(self, fmt: str, what: str) -> int:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += n
        return int(value)

    def u32(self, what: str) -> int:
        return self.unpack("<I", what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", what)

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.u64(f"the length of {what}")
        if limit is not None and n > limit:
            raise self.fail(f"{what} is {n:,} bytes long (at most {limit:,})")
        self.need(n, what)
        raw = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8 text") from None

    def skip_string(self, what: str) -> None:
        n = self.u64(f"the length of {what}")
        self.need(n, what)
        self.pos += n

    def count(self, what: str, min_bytes: int) -> int:
        """A count read from the file, no larger than the bytes left could hold."""
        n = self.u64(what)
        left = self.size - self.pos
        if n > left // min_bytes:
            raise self.fail(
                f"{what} is {n:,}, more than the {left:,} bytes left in the file can "
                f"hold: truncated download?"
            )
        return n


def _array_header(cur: _Cursor, vtype: int, what: str, depth: int) -> tuple[int, int]:
    """The element type and count of an array value (anything else but the fixed-size
    types and STRING is a defect), the count bounded by the bytes left."""
    if vtype != _ARRAY:
        raise cur.fail(f"{what} has value type {vtype}, which GGUF does not define (0-12)")
    if depth >= MAX_ARRAY_DEPTH:
        raise cur.fail(f"{what} nests arrays more than {MAX_ARRAY_DEPTH} deep")
    etype = cur.u32(f"the element type of {what}")
    return etype, cur.count(f"the element count of {what}", _SIZES.get(etype, 8))


def _skip_value(cur: _Cursor, vtype: int, what: str, depth: int = 0) -> int | None:
    """Step over one value of type `vtype`; its integer value when it is an integer."""
    if vtype in _SIZES:
        size = _SIZES[vtype]
        cur.need(size, what)
        value = int.from_bytes(cur.data[cur.pos : cur.pos + size], "little")
        cur.pos += size
        return value
    if vtype == _STRING:
        cur.skip_string(what)
        return None
    etype, n = _array_header(cur, vtype, what, depth)
    if etype in _SIZES:  # fixed-size elements: one bounds check for all of them
        cur.need(n * _SIZES[etype], what)
        cur.pos += n * _SIZES[etype]
        return None
    if etype == _STRING:
        _skip_strings(cur, n, what)
        return None
    for i in range(n):
        _skip_value(cur, etype, f"{what}[{i}]", depth + 1)
    return None


_U64 = struct.Struct("<Q")
# numpy's reading of each fixed-size value type (BOOL: a byte, nonzero is true).
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
          10: "<u8", 11: "<i8", 12: "<f8"}  # fmt: skip
_BOOL = 7


def _decode(cur: _Cursor, vtype: int, what: str, depth: int = 0) -> Any:
    """The next value of type `vtype` as Python values (arrays as lists), read with
    the same bounds as `_skip_value`."""
    if vtype in _SIZES:
        (value,) = _decode_run(cur, vtype, 1, what)
        return value
    if vtype == _STRING:
        return cur.string(what)
    etype, n = _array_header(cur, vtype, what, depth)
    if etype in _SIZES:
        return _decode_run(cur, etype, n, what)
    if etype == _STRING:
        return _strings(cur, n, what)
    return [_decode(cur, etype, f"{what}[{i}]", depth + 1) for i in range(n)]


def _decode_run(cur: _Cursor, vtype: int, n: int, what: str) -> list[Any]:
    """`n` fixed-size values of type `vtype`, in one bounds check."""
    size = n * _SIZES[vtype]
    cur.need(size, what)
    values = np.frombuffer(cur.data, dtype=_NUMPY[vtype], count=n, offset=cur.pos)
    cur.pos += size
    out: list[Any] = (values != 0).tolist() if vtype == _BOOL else values.tolist()
    return out


def _strings(cur: _Cursor, n: int, what: str) -> list[str]:
    """`n` strings (a vocabulary), each bounds checked and decoded as UTF-8."""
    unpack, data, size, pos = _U64.unpack_from, cur.data, cur.size, cur.pos
    out = []
    for i in range(n):
        if pos + 8 > size:
            cur.pos = pos
            cur.need(8, f"the length of {what}[{i}]")
        end = pos + 8 + unpack(data, pos)[0]
        if end > size:
            raise cur.fail(
                f"{what}[{i}] runs past the end of the {size:,}-byte file: truncated download?"
            )
        try:
            out.append(str(data[pos + 8 : end], "utf-8"))
        except UnicodeDecodeError:
            raise cur.fail(f"{what}[{i}] is not UTF-8 text") from None
        pos = end
    cur.pos = pos
    return out


def decode_value(data: mmap.mmap | bytes, path: str, field: tuple[int, int], key: str) -> Any:
    """The value of `key` at `field` (GGUFHeader.fields) as Python values; a value that
    cannot be read (text that is not UTF-8) raises ModelFileError naming the key."""
    cur = _Cursor(data, path)
    vtype, cur.pos = field
    return _decode(cur, vtype, f"the value of {key!r}")


def _skip_strings(cur: _Cursor, n: int, what: str) -> None:
    """Step over `n` strings (a vocabulary: 150k of them), bounds checked, not decoded."""
    unpack, data, size, pos = _U64.unpack_from, cur.data, cur.size, cur.pos
    for i in range(n):
        if pos + 8 > size:
            cur.pos = pos
            cur.need(8, f"the length of {what}[{i}]")
        pos += 8 + unpack(data, pos)[0]
        if pos > size:
            raise cur.fail(
                f"{what}[{i}] runs past the end of the {size:,}-byte file: truncated download?"
            )
    cur.pos = pos


def _metadata(cur: _Cursor, n_kv: int) -> tuple[int, dict[str, tuple[int, int]]]:
    """Step over the key/value pairs: the alignment they set, and each key's value
    type and position (nothing is decoded)."""
    fields: dict[str, tuple[int, int]] = {}
    alignment = DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = cur.string(f"key #{i}", MAX_KEY_BYTES)
        if key in fields:
            raise cur.fail(f"the key {key!r} appears twice")
        vtype = cur.u32(f"the value type of {key!r}")
        fields[key] = (vtype, cur.pos)
        value = _skip_value(cur, vtype, f"the value of {key!r}")
        if key == ALIGNMENT_KEY:
            if value is None or value <= 0 or value & (value - 1) or value > 1 << 20:
                raise cur.fail(f"{ALIGNMENT_KEY} is {value}, not a power of two up to 2^20")
            alignment = value
    return alignment, fields


def _tensor_info(cur: _Cursor, i: int) -> tuple[str, GGMLQuantizationType, list[int], int, int]:
    """(name, type, dimensions, byte size of its data, offset) of the next tensor info."""
    name = cur.string(f"tensor #{i}'s name", MAX_KEY_BYTES)
    n_dims = cur.u32(f"the dimension count of tensor {name}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.fail(f"tensor {name} has {n_dims:,} dimensions (GGUF allows 1 to {MAX_DIMS})")
    dims = [cur.u64(f"dimension {d} of tensor {name}") for d in range(n_dims)]
    elements = 1
    for d in dims:
        if d == 0 or d > MAX_ELEMENTS:
            raise cur.fail(f"tensor {name} has a dimension of {d:,}")
        elements *= d
        if elements > MAX_ELEMENTS:
            raise cur.fail(f"tensor {name}'s dimensions {dims} hold more than 2^50 elements")
    raw_type = cur.u32(f"the type of tensor {name}")
    try:
        qtype = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise cur.fail(
            f"tensor {name} has type {raw_type}, which is not a known GGML type"
        ) from None
    if dims[0] % block:
        raise cur.fail(
            f"tensor {name} ({qtype.name}) has rows of {dims[0]:,} values, not a whole "
            f"number of {block}-value blocks"
        )
    offset = cur.u64(f"the data offset of tensor {name}")
    return name, qtype, dims, elements // block * type_size, offset


def _check_spans(cur: _Cursor, spans: list[TensorSpan], alignment: int, data_start: int) -> None:
    for span in spans:
        if (span.start - data_start) % alignment:
            raise cur.fail(
                f"tensor {span.name}'s data offset {span.start - data_start:,} is not a "
                f"multiple of the file's alignment ({alignment})"
            )
        if span.end > cur.size:
            raise cur.fail(
                f"tensor {span.name} ends at byte {span.end:,}, past the end of the "
                f"{cur.size:,}-byte file: truncated download?"
            )
    ordered = sorted(spans, key=lambda s: s.start)
    for a, b in itertools.pairwise(ordered):
        if b.start < a.end:
            raise cur.fail(f"the data of tensors {a.name} and {b.name} overlap")


def _header_counts(cur: _Cursor) -> tuple[int, int]:
    """The magic and version checked; the tensor and key counts, each bounded by the
    bytes left."""
    data = cur.data
    cur.need(4, "the GGUF magic")
    if bytes(data[:4]) != MAGIC:
        raise cur.fail(f"not a GGUF file (it starts with {bytes(data[:4])!r}, not b'GGUF')")
    cur.pos = 4
    version = cur.u32("the GGUF version")
    if version not in VERSIONS:
        raise cur.fail(f"GGUF version {version} is not supported (only 2 and 3)")
    n_tensors = cur.count("the tensor count", _MIN_TENSOR)
    return n_tensors, cur.count("the metadata key count", _MIN_KV)


def read_gguf_header(data: mmap.mmap | bytes, path: str) -> GGUFHeader:
    """Check a GGUF file's bytes (see the module's docstring) and return where its
    values and tensors lie."""
    cur = _Cursor(data, path)
    n_tensors, n_kv = _header_counts(cur)
    alignment, fields = _metadata(cur, n_kv)
    infos = [_tensor_info(cur, i) for i in range(n_tensors)]
    names = [info[0] for info in infos]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise cur.fail(f"the tensor name {dup!r} appears twice")
    data_start = -(-cur.pos // alignment) * alignment
    tensors = [
        GGUFTensor(name, qtype, tuple(dims), data_start + off, size)
        for name, qtype, dims, size, off in infos
    ]
    _check_spans(cur, _spans(tensors), alignment, data_start)
    return GGUFHeader(fields, tensors)


def _spans(tensors: list[GGUFTensor]) -> list[TensorSpan]:
    return [TensorSpan(t.name, t.data_offset, t.data_offset + t.n_bytes) for t in tensors]


def check_gguf_data(data: mmap.mmap | bytes, path: str) -> list[TensorSpan]:
    """Check a GGUF file's bytes (see the module's docstring); its tensors' spans."""
    return _spans(read_gguf_header(data, path).tensors)


def read_gguf_values(path: str | os.PathLike[str], keys: Collection[str]) -> dict[str, Any]:
    """The values of `keys` in a GGUF's metadata, read with the check's bounded steps
    and nothing else decoded (a listing of models reads two keys of each, not their
    vocabularies). Missing keys are absent; a defect raises."""
    path = os.fspath(path)
    with map_gguf(path) as data:
        cur = _Cursor(data, path)
        _, n_kv = _header_counts(cur)
        _, fields = _metadata(cur, n_kv)
        return {k: decode_value(data, path, fields[k], k) for k in keys if k in fields}


def map_gguf(path: str) -> mmap.mmap:
    """The file at `path` mapped read-only; ModelFileError where it is empty or cannot
    be read."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise ModelFileError(path, "the file is empty")
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise ModelFileError(path, f"cannot be read: {exc.strerror or exc}") from None


def check_gguf(path: str | os.PathLike[str]) -> list[TensorSpan]:
    """Check the GGUF file at `path` before any reader trusts it; ModelFileError if not."""
    path = os.fspath(path)
    with map_gguf(path) as data:
        return check_gguf_data(data, path)
