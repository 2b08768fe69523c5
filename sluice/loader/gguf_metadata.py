"""The key/value metadata and tensor table of a GGUF file, read lazily.

Its own module so that the model loader (`gguf_loader`) and the tokenizer builder
(`gguf_tokenizer`) both read it without importing each other. The header is walked by
`gguf_check` (bounded reads, every count and offset checked); values are decoded when
asked for.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from sluice.loader.gguf_check import (
    GGUFHeader,
    GGUFTensor,
    decode_value,
    map_gguf,
    read_gguf_header,
)

# Tensor types whose data are plain numbers; the rest are blocks, read as bytes.
_PLAIN_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFMetadata:
    """Key/value metadata of a GGUF file as plain Python values (decoded lazily: the token
    list alone is 100k+ strings) and its tensors' entries. Holds the file mapped."""

    def __init__(self, path: str, data: mmap.mmap, header: GGUFHeader) -> None:
        self.path = path
        self._data = data
        self._header = header
        self._values: dict[str, Any] = {}
        self.tensor_named = {t.name: t for t in header.tensors}

    @classmethod
    def of(cls, source: GGUFMetadata | str | os.PathLike[str]) -> GGUFMetadata:
        if isinstance(source, GGUFMetadata):
            return source
        path = os.fspath(source)
        data = map_gguf(path)
        return cls(path, data, read_gguf_header(data, path))

    @property
    def tensors(self) -> list[GGUFTensor]:
        return self._header.tensors

    def get(self, key: str, default: Any = None) -> Any:
        if key in self._values:
            return self._values[key]
        field = self._header.fields.get(key)
        if field is None:
            return default
        value = decode_value(self._data, self.path, field, key)
        self._values[key] = value
        return value

    def __contains__(self, key: str) -> bool:
        return key in self._header.fields

    def keys(self) -> list[str]:
        return list(self._header.fields)

    def tensor_data(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's data, mapped (read-only): numbers shaped in torch's order for the
        plain types, else each row's block bytes [..., bytes per row]."""
        raw = np.frombuffer(self._data, np.uint8, count=tensor.n_bytes, offset=tensor.data_offset)
        dims = tuple(reversed(tensor.shape))
        dtype = _PLAIN_DTYPES.get(tensor.tensor_type)
        if dtype is not None:
            return raw.view(dtype).reshape(dims)
        block, size = GGML_QUANT_SIZES[tensor.tensor_type]
        return raw.reshape(*dims[:-1], dims[-1] // block * size)
