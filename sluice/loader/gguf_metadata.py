"""The key/value metadata of a GGUF file, read lazily.

Its own module so that the model loader (`gguf_loader`) and the tokenizer builder
(`gguf_tokenizer`) both read it without importing each other.
"""

from __future__ import annotations

import os
from typing import Any

from gguf import GGUFReader

from sluice.core.errors import ModelFileError
from sluice.loader.gguf_check import check_gguf


class GGUFMetadata:
    """Key/value metadata of a GGUF file as plain Python values (decoded lazily: the token
    list alone is 100k+ strings)."""

    def __init__(self, reader: GGUFReader) -> None:
        self.reader = reader
        self._values: dict[str, Any] = {}
        self.path = str(reader.data.filename) if hasattr(reader.data, "filename") else "GGUF"

    @classmethod
    def of(cls, source: GGUFMetadata | GGUFReader | str | os.PathLike[str]) -> GGUFMetadata:
        if isinstance(source, GGUFMetadata):
            return source
        if isinstance(source, GGUFReader):
            return cls(source)
        path = os.fspath(source)
        check_gguf(path)  # before the reader believes a single count or offset
        try:
            return cls(GGUFReader(path))
        except (ValueError, IndexError, KeyError, OverflowError) as exc:
            # What the check does not cover yet still names the file, not numpy's internals.
            raise ModelFileError(path, f"the GGUF reader failed: {exc}") from exc

    def get(self, key: str, default: Any = None) -> Any:
        if key in self._values:
            return self._values[key]
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            value = field.contents()
        except (ValueError, IndexError) as exc:  # UnicodeDecodeError is a ValueError
            raise ModelFileError(self.path, f"the value of {key!r} cannot be read: {exc}") from None
        self._values[key] = value
        return value

    def __contains__(self, key: str) -> bool:
        return key in self.reader.fields
