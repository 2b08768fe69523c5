"""Gemma 3 (text): four norms a layer, GeGLU, QK-norm, local and global layers.

The model is sluice/models/gemma3.py; docs/architecture.md ("Sliding windows and
Gemma 3") says what differs from Llama. Here: what its files leave to the reader and
how they spell the rest, llama.cpp's names for its extra norms and the norm scales
its converter stores with 1 added.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from sluice.architectures.spec import (
    LAYER_NAMES,
    ArchitectureSpec,
    Fields,
    GGUFKeys,
    rope_from_hf,
)
from sluice.config import ModelConfig
from sluice.core.quantized_tensor import Weight

# Four norms a layer; llama.cpp calls the pre-MLP one ffn_norm, which is the
# post-attention norm of the other families.
LAYER_NAMES_GEMMA3: Mapping[str, str] = MappingProxyType(
    {
        **LAYER_NAMES,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
)


def _gguf_fields(keys: GGUFKeys, shared: Mapping[str, Any]) -> Fields:
    """What a Gemma 3 GGUF leaves to the reader, as llama.cpp and transformers fill it
    in: every 6th layer global (the others local), local rope base 10k, scores scaled
    by head_dim ** -0.5 (hidden / heads for the 62-layer 27B), GeGLU, no softcapping."""
    num_layers, head_dim = int(shared["num_layers"]), int(shared["head_dim"])
    hidden_per_head = int(shared["hidden_size"]) // int(shared["num_heads"])
    window = keys.get("attention.sliding_window")
    return dict(
        sliding_window=int(window) if window is not None else None,
        sliding_window_layers=tuple(i for i in range(num_layers) if (i + 1) % 6),
        rope_local_theta=10_000.0,
        query_pre_attn_scalar=float(hidden_per_head if num_layers == 62 else head_dim),
        hidden_act="gelu_pytorch_tanh",
        qk_norm=True,
    )


def _hf_fields(cfg: Mapping[str, Any], hf_class: str) -> Fields:
    """What a Gemma 3 config adds: which layers are local, their rope, the scalings.
    Defaults are transformers' Gemma3TextConfig's."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError(
            "attn_logit_softcapping is not supported "
            f"(attn_logit_softcapping={cfg['attn_logit_softcapping']})"
        )
    layers = int(cfg["num_hidden_layers"])
    pattern = int(cfg.get("sliding_window_pattern", 6))
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    params = cfg.get("rope_parameters") or {}
    global_theta, scaling = rope_from_hf(params.get("full_attention") or {})
    if cfg.get("rope_scaling") is not None:
        scaling = rope_from_hf(dict(cfg["rope_scaling"]))[1]
    local_theta = rope_from_hf(params.get("sliding_attention") or {})[0]
    softcap = cfg.get("final_logit_softcapping")
    bidirectional = bool(cfg.get("use_bidirectional_attention", False))
    window = int(cfg.get("sliding_window") or 4096)
    if bidirectional:
        # Both ways, transformers reads the window as half on each side: a key is seen
        # less than window // 2 + 1 positions away (its Gemma3TextConfig).
        window = window // 2 + 1
    return dict(
        sliding_window=window,
        sliding_window_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        rope_theta=global_theta or float(cfg.get("rope_theta", 1_000_000.0)),
        rope_scaling=scaling,
        rope_local_theta=local_theta or float(cfg.get("rope_local_base_freq", 10_000.0)),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=None if softcap is None else float(softcap),
        hidden_act=str(cfg.get("hidden_activation", "gelu_pytorch_tanh")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qk_norm=True,
        # EmbeddingGemma: the layers attend both ways, for embeddings only.
        bidirectional=bidirectional,
    )


def _gguf_weight(name: str, weight: Weight, config: ModelConfig) -> Weight:
    """llama.cpp's converter stores Gemma's norm scales with the 1 added; the HF
    convention (and our loader's) is the offset from 1."""
    if not name.endswith("norm.weight"):
        return weight
    assert isinstance(weight, torch.Tensor)
    return weight.float() - 1.0


SPEC = ArchitectureSpec(
    name="gemma3",
    title="Gemma 3",
    model="gemma3",
    gguf_names=("gemma3",),
    # Gemma3TextModel: the bare backbone, as EmbeddingGemma's folder holds it.
    hf_classes=("Gemma3ForCausalLM", "Gemma3TextModel"),
    gguf_fields=_gguf_fields,
    hf_fields=_hf_fields,
    gguf_layer_names=LAYER_NAMES_GEMMA3,
    gguf_weight=_gguf_weight,
    # Its layer is not the one tp_shard cuts, nor the one an EAGLE head is trained on.
    tensor_parallel=False,
    eagle_head=False,
)
