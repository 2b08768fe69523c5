"""The key/value metadata of a GGUF file, read lazily.

Its own module so that the model loader (`gguf_loader`) and the tokenizer builder
(`gguf_tokenizer`) both read it without importing each other.
"""

from __future__ import annotations

import os
from typing import Any

from gguf import GGUFReader


class GGUFMetadata:
    """Key/value metadata of a GGUF file as plain Python values (decoded lazily: the token
    list alone is 100k+ strings)."""

    def __init__(self, reader: GGUFReader) -> None:
        self.reader = reader
        self._values: dict[str, Any] = {}

    @classmethod
    def of(cls, source: GGUFMetadata | GGUFReader | str | os.PathLike[str]) -> GGUFMetadata:
        if isinstance(source, GGUFMetadata):
            return source
        if isinstance(source, GGUFReader):
            return cls(source)
        return cls(GGUFReader(os.fspath(source)))

    def get(self, key: str, default: Any = None) -> Any:
        if key in self._values:
            return self._values[key]
        field = self.reader.fields.get(key)
        if field is None:
            return default
        value = field.contents()
        self._values[key] = value
        return value

    def __contains__(self, key: str) -> bool:
        return key in self.reader.fields
