"""Model classes, and which one runs each registered architecture."""

from __future__ import annotations

from sluice.architectures import spec_of
from sluice.config import ModelConfig
from sluice.models.gemma3 import Gemma3ForCausalLM
from sluice.models.llama import LlamaForCausalLM

# The decoder classes, by the key an ArchitectureSpec names as its `model`
# (sluice/architectures/). Llama, Mistral (sliding window), Qwen2 (QKV bias) and Qwen3
# (QK-norm) share one decoder; the differences are config flags, not separate code
# paths. Gemma 3 has a layer and an embedding of its own (a subclass of the Llama
# decoder).
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The decoder class of `config`'s architecture (an unknown one is refused by name)."""
    return MODEL_CLASSES[spec_of(config.architecture).model]


__all__ = ["MODEL_CLASSES", "Gemma3ForCausalLM", "LlamaForCausalLM", "model_class"]
