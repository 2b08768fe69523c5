"""OLMoE (OLMoE-1B-7B): the Llama decoder with an RMSNorm over the whole q and the whole
k projection (all heads together, before they are split) and 64 routed experts a
layer, top-8, the weights not renormalized."""

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

_QK_NORM: Fields = {"qk_norm": True, "qk_norm_per_head": False}


def _gguf_fields(keys: GGUFKeys, shared: Mapping[str, Any]) -> Fields:
    return {**_QK_NORM, **moe_from_gguf(keys, norm_topk_prob=False)}


def _hf_fields(cfg: Mapping[str, Any], hf_class: str) -> Fields:
    if cfg.get("clip_qkv") is not None:
        raise ValueError("OLMoE with clip_qkv is not supported")
    return {**_QK_NORM, **moe_from_hf(cfg)}


SPEC = ArchitectureSpec(
    name="olmoe",
    title="OLMoE",
    model="llama",
    gguf_names=("olmoe",),
    hf_classes=("OlmoeForCausalLM",),
    gguf_fields=_gguf_fields,
    hf_fields=_hf_fields,
    gguf_layer_names=MOE_LAYER_NAMES,
    tensor_parallel=False,
    eagle_head=False,
)
