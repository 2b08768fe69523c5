"""Model registry: architecture name → implementation."""

from __future__ import annotations

from torch import nn

from sluice.config import ModelConfig
from sluice.models.llama import LlamaForCausalLM

# Llama, Mistral (no sliding window), Qwen2 (QKV bias) and Qwen3 (QK-norm) share one
# decoder; the differences are config flags, not separate code paths.
_REGISTRY: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        return _REGISTRY[config.architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {config.architecture!r}; "
            f"supported: {', '.join(sorted(_REGISTRY))}"
        ) from None


__all__ = ["LlamaForCausalLM", "model_class"]
