"""A speculative method's drafter between loading and building (see methods.py): what
it may read while the target loads, and what it is built from once the target's KV
layout is known."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from sluice.config import EngineConfig, ModelConfig
from sluice.engine.speculative.proposer import Proposer
from sluice.loader import LoadedModel
from sluice.runner.factory import RunnerOptions
from sluice.runner.kv_layout import KVLayout


@dataclass(frozen=True)
class DraftLoad:
    """What a method reads while the target is loaded (before the target's runner
    consumes its tensors: an EAGLE head shares its embedding and output head)."""

    config: EngineConfig
    target: LoadedModel
    options: RunnerOptions
    """The target's runner options (dtype, device, weight quantization, compile)."""


@dataclass(frozen=True)
class DraftBuild:
    """What a method builds its proposer from once the target's KV layout is decided."""

    config: EngineConfig
    target_config: ModelConfig
    options: RunnerOptions
    layout: KVLayout
    """The target's: a drafter's pool has as many blocks (KVLayout.for_draft)."""


class DraftSource(Protocol):
    """A method's proposer-to-be, between load and build."""

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of the drafter's own KV per block of the target's (0: it keeps none)."""
        ...

    def cost_key(self) -> str | None:
        """What of the drafter the step-cost table depends on (a model, a head file)."""
        ...

    def build(self, ctx: DraftBuild) -> Proposer:
        """The proposer (consumes what load read)."""
        ...
