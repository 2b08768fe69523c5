"""Granite 3 (dense): the Llama decoder with four scalings (ModelConfig's
embedding_multiplier, residual_multiplier, attention_multiplier, logits_scaling).
llama.cpp's converter writes them as granite.embedding_scale, residual_scale,
attention.scale and logit_scale, and permutes q/k as it does Llama's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sluice.architectures import llama
from sluice.architectures.spec import ArchitectureSpec, Fields, GGUFKeys

# ModelConfig field -> (config.json key, GGUF key).
_SCALINGS = {
    "embedding_multiplier": ("embedding_multiplier", "embedding_scale"),
    "residual_multiplier": ("residual_multiplier", "residual_scale"),
    "attention_multiplier": ("attention_multiplier", "attention.scale"),
    "logits_scaling": ("logits_scaling", "logit_scale"),
}


def _positive(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e30:
        raise ValueError(f"{where} must be a positive number, got {value!r}")
    return float(value)


def _gguf_fields(keys: GGUFKeys, shared: Mapping[str, Any]) -> Fields:
    found = {f: keys.get(key) for f, (_, key) in _SCALINGS.items()}
    return {
        f: _positive(f"{keys.prefix}.{_SCALINGS[f][1]}", v)
        for f, v in found.items()
        if v is not None
    }


def _hf_fields(cfg: Mapping[str, Any], hf_class: str) -> Fields:
    found = {f: cfg.get(key) for f, (key, _) in _SCALINGS.items()}
    return {f: _positive(_SCALINGS[f][0], v) for f, v in found.items() if v is not None}


SPEC = ArchitectureSpec(
    name="granite",
    title="Granite",
    model="llama",
    gguf_names=("granite",),
    hf_classes=("GraniteForCausalLM",),
    gguf_fields=_gguf_fields,
    hf_fields=_hf_fields,
    gguf_weight=llama.SPEC.gguf_weight,
    eagle_head=False,  # an EAGLE head would have to learn the scalings too: not tried
)
