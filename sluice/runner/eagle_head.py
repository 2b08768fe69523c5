"""An EAGLE head's runner: the engine reaches models only through the runner layer,
so the head's module, its tensor names and its shape are handed over from here."""

from __future__ import annotations

import torch

from sluice.config import ModelConfig
from sluice.core.choices import WeightQuantization
from sluice.core.quantized_tensor import Weight
from sluice.models.eagle import EAGLE_TENSORS, EagleHead, eagle_config
from sluice.runner.model_runner import ModelRunner


def eagle_runner(
    config: ModelConfig,
    tensors: dict[str, Weight],
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    num_blocks: int,
    max_model_len: int,
    quantization: WeightQuantization,
    compile: bool,
    output_ids: torch.Tensor | None,
) -> ModelRunner:
    """The head (config: eagle_config's) on a runner of its own that returns its
    guessed features with its logits; consumes `tensors`."""
    return ModelRunner(
        config,
        tensors,
        dtype,
        device,
        block_size,
        num_blocks,
        max_model_len,
        quantization,
        compile,
        output_ids=output_ids,
        model_type=EagleHead,
        return_features=True,
    )


__all__ = ["EAGLE_TENSORS", "eagle_config", "eagle_runner"]
