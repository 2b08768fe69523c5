"""Model loading: find a model, read its config, float32 weights (HF names) and tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from sluice.config import ModelConfig
from sluice.core.errors import ModelNotFoundError
from sluice.settings import cache_dir

from .gguf_loader import load_gguf
from .gguf_tokenizer import tokenizer_from_gguf
from .hf_loader import load_hf_dir
from .resolve import KNOWN_MODELS, resolve_model_path
from .tokenizer import Tokenizer

__all__ = [
    "KNOWN_MODELS",
    "LoadedModel",
    "ModelNotFoundError",
    "Tokenizer",
    "cache_dir",
    "load_model",
    "resolve_model_path",
    "tokenizer_from_gguf",
]


@dataclass
class LoadedModel:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]  # float32, Hugging Face parameter names
    tokenizer: Tokenizer
    path: Path
    # 4 or 8 when the source file's linear weights were quantized to that many bits or
    # fewer (a GGUF), None for float weights: what quantization="auto" keeps.
    weight_bits: int | None = None


def load_model(model: str | None) -> LoadedModel:
    """Resolve `model` (alias, .gguf path or HF directory; None = default) and load it."""
    path = resolve_model_path(model)
    bits = None
    if path.is_dir():
        config, tensors, tokenizer = load_hf_dir(path)
    else:
        config, tensors, tokenizer, bits = load_gguf(path)
    return LoadedModel(config, tensors, tokenizer, path, weight_bits=bits)
