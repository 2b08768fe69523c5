"""Qwen2: the Llama decoder with a bias on the q, k and v projections."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sluice.architectures.spec import ArchitectureSpec, Fields, GGUFKeys


def _gguf_fields(keys: GGUFKeys, shared: Mapping[str, Any]) -> Fields:
    return {"attention_bias": True}


def _hf_fields(cfg: Mapping[str, Any], hf_class: str) -> Fields:
    return {"attention_bias": bool(cfg.get("attention_bias", True))}


SPEC = ArchitectureSpec(
    name="qwen2",
    title="Qwen2",
    model="llama",
    gguf_names=("qwen2",),
    hf_classes=("Qwen2ForCausalLM",),
    gguf_fields=_gguf_fields,
    hf_fields=_hf_fields,
)
