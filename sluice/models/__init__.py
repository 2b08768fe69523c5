"""Model registry: architecture name → implementation."""

from __future__ import annotations

from sluice.config import ModelConfig
from sluice.core.choices import ARCHITECTURES, Architecture
from sluice.models.gemma3 import Gemma3ForCausalLM
from sluice.models.llama import LlamaForCausalLM

# Llama, Mistral (sliding window), Qwen2 (QKV bias) and Qwen3 (QK-norm) share one
# decoder; the differences are config flags, not separate code paths. Gemma 3 has a
# layer and an embedding of its own (a subclass of the Llama decoder).
_REGISTRY: dict[Architecture, type[LlamaForCausalLM]] = {
    **{arch: LlamaForCausalLM for arch in ARCHITECTURES},
    "gemma3": Gemma3ForCausalLM,
}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    try:
        return _REGISTRY[config.architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {config.architecture!r}; "
            f"supported: {', '.join(sorted(_REGISTRY))}"
        ) from None


__all__ = ["Gemma3ForCausalLM", "LlamaForCausalLM", "model_class"]
