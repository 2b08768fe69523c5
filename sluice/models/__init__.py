"""Model registry: architecture name → implementation."""

from __future__ import annotations

from sluice.config import ModelConfig
from sluice.core.choices import ARCHITECTURES, Architecture
from sluice.models.llama import LlamaForCausalLM

# Llama, Mistral (no sliding window), Qwen2 (QKV bias) and Qwen3 (QK-norm) share one
# decoder; the differences are config flags, not separate code paths. A family with a
# decoder of its own would get its own entry here.
_REGISTRY: dict[Architecture, type[LlamaForCausalLM]] = {
    arch: LlamaForCausalLM for arch in ARCHITECTURES
}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    try:
        return _REGISTRY[config.architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {config.architecture!r}; "
            f"supported: {', '.join(sorted(_REGISTRY))}"
        ) from None


__all__ = ["LlamaForCausalLM", "model_class"]
