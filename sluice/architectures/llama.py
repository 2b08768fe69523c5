"""Llama (2, 3), SmolLM, Mistral and Mixtral: the plain Llama-style decoder.

Mistral's checkpoints load as Llama with a sliding window over every layer; Mixtral's
as Llama whose MLPs are routed experts (llama.cpp writes them as "llama" files with
an expert count; its checkpoints name the expert projections w1/w3/w2). llama.cpp's
converter permutes a Llama GGUF's q and k rows for its interleaved rope; we put them
back in HF's rotate-half order (a row permutation, so quantized rows move as they are).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from sluice.architectures.spec import (
    MOE_LAYER_NAMES,
    ArchitectureSpec,
    Fields,
    GGUFKeys,
    moe_from_gguf,
    moe_from_hf,
)
from sluice.config import ModelConfig
from sluice.core.quantized_tensor import QuantizedTensor, Weight


def _gguf_fields(keys: GGUFKeys, shared: Mapping[str, Any]) -> Fields:
    return moe_from_gguf(keys, norm_topk_prob=True)  # Mixtral renormalizes its top 2


def _hf_fields(cfg: Mapping[str, Any], hf_class: str) -> Fields:
    fields: Fields = {}
    if hf_class in ("MistralForCausalLM", "MixtralForCausalLM") and cfg.get("sliding_window"):
        fields["sliding_window"] = int(cfg["sliding_window"])  # every layer
    if hf_class == "MixtralForCausalLM":
        fields.update(moe_from_hf(cfg, norm_topk_prob=True))
    return fields


# Mixtral checkpoints' names -> the ones every MoE family shares.
_MIXTRAL_NAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".w1.", ".gate_proj."),
    (".w3.", ".up_proj."),
    (".w2.", ".down_proj."),
)


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
    hf_classes=("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"),
    gguf_fields=_gguf_fields,
    hf_fields=_hf_fields,
    gguf_layer_names=MOE_LAYER_NAMES,
    gguf_weight=_gguf_weight,
    hf_renames=_MIXTRAL_NAMES,
)
