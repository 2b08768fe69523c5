"""Phi-3 and Phi-3.5 (mini, medium): the Llama decoder, with q/k/v and gate/up stored
fused (config.json's qkv_proj and gate_up_proj, llama.cpp's attn_qkv and ffn_up),
which are cut into the projections the model loads (and fuses again its own way),
and LongRoPE scaling for the 128k-context models (layers/rotary.py). Phi-4-mini is
the same architecture with rope on 3/4 of each head (ModelConfig.rotary_dim)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sluice.architectures.spec import LAYER_NAMES, ArchitectureSpec, Fields, GGUFKeys
from sluice.config import ModelConfig
from sluice.core.quantized_tensor import QuantizedTensor, Weight

# What a fused tensor holds, rows in order.
_FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj", "mlp.up_proj"),
}


def _rows(config: ModelConfig, fused: str) -> tuple[int, ...]:
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    return (q, kv, kv) if fused.startswith("self_attn") else (inter, inter)


def split_weight(name: str, weight: Weight, config: ModelConfig) -> dict[str, Weight]:
    """A fused projection's rows as its parts, under their own names."""
    fused = next((f for f in _FUSED if name.endswith(f)), None)
    if fused is None:
        return {name: weight}
    sizes, prefix = _rows(config, fused), name.removesuffix(fused)
    if weight.shape[0] != sum(sizes):
        raise ValueError(f"{name} has {weight.shape[0]} rows; the config makes {sum(sizes)}")
    parts: dict[str, Weight] = {}
    start = 0
    for part, size in zip(_FUSED[fused], sizes, strict=True):
        stop = start + size
        cut = (
            weight.row_slice(start, stop)
            if isinstance(weight, QuantizedTensor)
            else weight[start:stop].contiguous()
        )
        parts[f"{prefix}{part}.weight"] = cut
        start = stop
    return parts


def _gguf_fields(keys: GGUFKeys, shared: Mapping[str, Any]) -> Fields:
    """The sliding window (0: none, Phi-4's files)."""
    window = keys.get("attention.sliding_window")
    if window and int(window) < int(shared["max_position_embeddings"]):
        return {"sliding_window": int(window)}
    return {}


def _hf_fields(cfg: Mapping[str, Any], hf_class: str) -> Fields:
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    fields: Fields = {}
    if partial != 1.0:  # Phi-4-mini: 0.75 of each head turns
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        fields["rotary_dim"] = int(head_dim * partial)
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    window = cfg.get("sliding_window")
    if window and int(window) < max_pos:  # Phi-3.5's 262,144 never applies
        fields["sliding_window"] = int(window)
    kind = rope.get("rope_type", rope.get("type"))
    if kind in ("longrope", "su"):
        original = int(rope.get("original_max_position_embeddings")
                       or cfg["original_max_position_embeddings"])  # fmt: skip
        fields["rope_scaling"] = {
            "rope_type": "longrope",
            "short_factor": [float(f) for f in rope["short_factor"]],
            "long_factor": [float(f) for f in rope["long_factor"]],
            "original_max_position_embeddings": original,
            "factor": float(rope.get("factor") or max_pos / original),
            "attention_factor": rope.get("attention_factor"),
        }
    elif kind not in (None, "default"):
        raise ValueError(f"Phi-3 with rope_type {kind!r} is not supported (longrope is)")
    return fields


SPEC = ArchitectureSpec(
    name="phi3",
    title="Phi-3",
    model="llama",
    gguf_names=("phi3",),
    hf_classes=("Phi3ForCausalLM",),
    gguf_fields=_gguf_fields,
    hf_fields=_hf_fields,
    gguf_layer_names={
        **LAYER_NAMES,
        "attn_qkv": "self_attn.qkv_proj",
        "ffn_up": "mlp.gate_up_proj",
    },
    split_weight=split_weight,
    fused_projections={
        f.split(".")[1]: tuple(part.split(".")[1] for part in parts) for f, parts in _FUSED.items()
    },
    eagle_head=False,
)
