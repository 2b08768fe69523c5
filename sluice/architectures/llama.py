"""Llama (2, 3), SmolLM and Mistral: the plain Llama-style decoder.

Mistral's checkpoints load as Llama with a sliding window over every layer. llama.cpp's
converter permutes a Llama GGUF's q and k rows for its interleaved rope; we put them
back in HF's rotate-half order (a row permutation, so quantized rows move as they are).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from sluice.architectures.spec import ArchitectureSpec, Fields
from sluice.config import ModelConfig
from sluice.core.quantized_tensor import QuantizedTensor, Weight


def _hf_fields(cfg: Mapping[str, Any], hf_class: str) -> Fields:
    if hf_class == "MistralForCausalLM" and cfg.get("sliding_window") is not None:
        return {"sliding_window": int(cfg["sliding_window"])}  # every layer
    return {}


def unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rope -> HF's rotate_half layout)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _unpermuted(weight: Weight, n_head: int) -> Weight:
    if isinstance(weight, QuantizedTensor):
        rows = weight.shape[0]
        return weight.rows(unpermute_rope(torch.arange(rows), n_head))
    return unpermute_rope(weight, n_head).contiguous()


def _gguf_weight(name: str, weight: Weight, config: ModelConfig) -> Weight:
    if name.endswith("q_proj.weight"):
        return _unpermuted(weight, config.num_heads)
    if name.endswith("k_proj.weight"):
        return _unpermuted(weight, config.num_kv_heads)
    return weight


SPEC = ArchitectureSpec(
    name="llama",
    title="Llama",
    model="llama",
    gguf_names=("llama",),
    hf_classes=("LlamaForCausalLM", "MistralForCausalLM"),
    hf_fields=_hf_fields,
    gguf_weight=_gguf_weight,
)
