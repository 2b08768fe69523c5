"""Every model architecture sluice runs, registered once.

A family is one module here that declares an `ArchitectureSpec` (spec.py): its names
in GGUF files and in HF config.json, how its ModelConfig differs from the shared
Llama-style reading, its GGUF tensor names and weight fix-ups, the decoder class that
runs it and what it can do. `REGISTRY` lists them; the GGUF loader, the HF loader and
the model registry (sluice/models) all look families up here, and the runner and the
engine ask it for capabilities instead of testing names. This package sits just above
config and below both loader and models: the loader may not import the models (front
ends read a config and a tokenizer without weights or kernels), so the specs cannot
live with the models, and the models need them as much as the loader does.
"""

from __future__ import annotations

from sluice.architectures import (
    bert,
    gemma3,
    gptoss,
    granite,
    granitemoe,
    llama,
    olmoe,
    phi3,
    qwen2,
    qwen2moe,
    qwen3,
    qwen3moe,
)
from sluice.architectures.spec import ArchitectureSpec, GGUFKeys, rope_from_hf
from sluice.config import check_architecture
from sluice.core.choices import Architecture

# One line per family, in the order of core.choices.ARCHITECTURES.
REGISTRY: dict[Architecture, ArchitectureSpec] = {
    spec.name: spec
    for spec in (
        llama.SPEC,  # Llama, SmolLM, Mistral, Mixtral
        qwen2.SPEC,
        qwen3.SPEC,
        gemma3.SPEC,
        granite.SPEC,
        phi3.SPEC,
        qwen2moe.SPEC,
        qwen3moe.SPEC,
        olmoe.SPEC,
        granitemoe.SPEC,
        gptoss.SPEC,
        bert.BERT,  # and the encoders of embedding models
        bert.MPNET,
    )
}

_BY_GGUF = {name: spec for spec in REGISTRY.values() for name in spec.gguf_names}
_BY_HF = {name: spec for spec in REGISTRY.values() for name in spec.hf_classes}


def _unsupported(name: object, known: list[str]) -> ValueError:
    return ValueError(
        f"unsupported model architecture {name!r}; sluice supports: {', '.join(known)}"
    )


def spec_of(architecture: object) -> ArchitectureSpec:
    """The family of a ModelConfig.architecture; the error of ModelConfig for another."""
    return REGISTRY[check_architecture(architecture)]


def spec_for_gguf(name: object) -> ArchitectureSpec:
    """The family of a GGUF's general.architecture."""
    if not isinstance(name, str) or name not in _BY_GGUF:
        raise _unsupported(name, list(_BY_GGUF))
    return _BY_GGUF[name]


def spec_for_hf(class_name: object) -> ArchitectureSpec:
    """The family of a config.json's class name (its `architectures[0]`)."""
    if not isinstance(class_name, str) or class_name not in _BY_HF:
        raise _unsupported(class_name, list(_BY_HF))
    return _BY_HF[class_name]


__all__ = [
    "REGISTRY",
    "ArchitectureSpec",
    "GGUFKeys",
    "rope_from_hf",
    "spec_for_gguf",
    "spec_for_hf",
    "spec_of",
]
