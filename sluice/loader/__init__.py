"""Model loading: find a model, read its config, weights (HF names) and tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from sluice.config import ModelConfig, PoolerConfig
from sluice.core.errors import ModelNotFoundError
from sluice.core.quantized_tensor import QuantizedTensor
from sluice.settings import cache_dir

from .chat_template import bundled_templates, resolve_chat_template
from .gguf_loader import load_gguf, load_gguf_header
from .gguf_tokenizer import tokenizer_from_gguf
from .hf_loader import config_from_hf, load_hf_dir, model_dir_name, read_json
from .memory import MemoryBudget
from .resolve import KNOWN_MODELS, resolve_model_path
from .sentence_transformers import is_sentence_transformers, read_pooler
from .tokenizer import Tokenizer

__all__ = [
    "KNOWN_MODELS",
    "LoadedModel",
    "MemoryBudget",
    "ModelNotFoundError",
    "Tokenizer",
    "bundled_templates",
    "cache_dir",
    "load_model",
    "load_tokenizer",
    "resolve_chat_template",
    "resolve_model_path",
    "tokenizer_from_gguf",
]


@dataclass
class LoadedModel:
    config: ModelConfig
    # Hugging Face parameter names; a GGUF's quantized weights stay quantized
    tensors: dict[str, torch.Tensor | QuantizedTensor]
    tokenizer: Tokenizer
    path: Path
    # An embedding model's pipeline after the transformer (pooling, dense layers,
    # normalization); None for a model that generates. Its dense layers' weights are
    # among `tensors` (sentence_dense.N.*).
    pooler: PoolerConfig | None = None

    @property
    def quantized(self) -> bool:
        """Whether some weights are kept in a GGUF block quantization."""
        return any(isinstance(t, QuantizedTensor) for t in self.tensors.values())


def load_model(
    model: str | None, revision: str | None = None, budget: MemoryBudget | None = None
) -> LoadedModel:
    """Resolve `model` (alias, .gguf path, HF directory or Hub repo; None = default) and
    load it."""
    path = resolve_model_path(model, revision, budget)
    if path.is_dir():
        config, dense, tokenizer = load_hf_dir(path)
        tensors: dict[str, torch.Tensor | QuantizedTensor] = dict(dense)
        if not (config.bidirectional or is_sentence_transformers(path)):
            return LoadedModel(config, tensors, tokenizer, path)
        pooler, pooler_weights = read_pooler(path, config)
        return LoadedModel(config, {**tensors, **pooler_weights}, tokenizer, path, pooler)
    config, tensors, tokenizer = load_gguf(path)
    return LoadedModel(config, tensors, tokenizer, path)


def load_tokenizer(
    model: str | None, revision: str | None = None, budget: MemoryBudget | None = None
) -> tuple[ModelConfig, Tokenizer]:
    """The config and tokenizer of `model`, without its weights: what a front end needs
    that tokenizes and routes for engines running in other processes."""
    path = resolve_model_path(model, revision, budget)
    if path.is_dir():
        config = config_from_hf(read_json(path / "config.json"), name=model_dir_name(path))
        return config, Tokenizer.from_hf_dir(path, post_process=config.bidirectional)
    return load_gguf_header(path)
