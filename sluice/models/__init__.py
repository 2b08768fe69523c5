"""Model classes, and which one runs each registered architecture."""

from __future__ import annotations

from sluice.architectures import spec_of
from sluice.config import ModelConfig
from sluice.models.encoder import BertEncoder
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


# The encoders of embedding models (bidirectional attention, no KV cache), by the same
# key. BERT and MPNet share one; EmbeddingGemma is Gemma 3 run both ways.
ENCODER_CLASSES: dict[str, type[BertEncoder]] = {
    "encoder": BertEncoder,
}


def encoder_class(config: ModelConfig) -> type[BertEncoder]:
    """The encoder class of a bidirectional `config`."""
    key = spec_of(config.architecture).model
    if key not in ENCODER_CLASSES:
        raise ValueError(f"{spec_of(config.architecture).title} has no bidirectional encoder")
    return ENCODER_CLASSES[key]


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The decoder class of `config`'s architecture (an unknown one is refused by name)."""
    return MODEL_CLASSES[spec_of(config.architecture).model]


__all__ = [
    "ENCODER_CLASSES",
    "MODEL_CLASSES",
    "BertEncoder",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "encoder_class",
    "model_class",
]
