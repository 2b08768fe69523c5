"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (QK-norm per head) and
a routed Mixture-of-Experts MLP in every layer, no shared expert."""

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
    # llama.cpp renormalizes Qwen3-MoE's top-k weights unless the file says otherwise
    # (the released models all set norm_topk_prob).
    return {"qk_norm": True, **moe_from_gguf(keys, norm_topk_prob=True)}


def _hf_fields(cfg: Mapping[str, Any], hf_class: str) -> Fields:
    return {"qk_norm": True, **moe_from_hf(cfg)}


SPEC = ArchitectureSpec(
    name="qwen3moe",
    title="Qwen3-MoE",
    model="llama",
    gguf_names=("qwen3moe",),
    hf_classes=("Qwen3MoeForCausalLM",),
    gguf_fields=_gguf_fields,
    hf_fields=_hf_fields,
    gguf_layer_names=MOE_LAYER_NAMES,
    eagle_head=False,
)
