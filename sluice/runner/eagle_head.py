"""An EAGLE head's runner variant: the engine reaches models only through the runner
layer, so the head's module, its tensor names and its shape are handed over from here."""

from __future__ import annotations

import torch

from sluice.models.eagle import EAGLE_TENSORS, EagleHead, eagle_config
from sluice.runner.factory import ModelVariant


def eagle_variant(output_ids: torch.Tensor | None) -> ModelVariant:
    """The head (config: eagle_config's) on a runner of its own that returns its
    guessed features with its logits."""
    return ModelVariant(model_type=EagleHead, output_ids=output_ids, return_features=True)


__all__ = ["EAGLE_TENSORS", "eagle_config", "eagle_variant"]
