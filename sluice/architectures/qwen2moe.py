"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v bias) and a
Mixture-of-Experts MLP of routed experts plus one shared expert that every token
passes through, scaled by sigmoid(a learned gate)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sluice.architectures.spec import (
    MOE_LAYER_NAMES,
    ArchitectureSpec,
    Fields,
    GGUFKeys,
    moe_from_gguf,
    moe_from_hf,
)


def _gguf_fields(keys: GGUFKeys, shared: Mapping[str, Any]) -> Fields:
    return {"attention_bias": True, **moe_from_gguf(keys, norm_topk_prob=False)}


def _hf_fields(cfg: Mapping[str, Any], hf_class: str) -> Fields:
    bias = cfg.get("qkv_bias")
    return {"attention_bias": True if bias is None else bool(bias), **moe_from_hf(cfg)}


SPEC = ArchitectureSpec(
    name="qwen2moe",
    title="Qwen2-MoE",
    model="llama",
    gguf_names=("qwen2moe",),
    hf_classes=("Qwen2MoeForCausalLM",),
    gguf_fields=_gguf_fields,
    hf_fields=_hf_fields,
    gguf_layer_names=MOE_LAYER_NAMES,
    eagle_head=False,
)
