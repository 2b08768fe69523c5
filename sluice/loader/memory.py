"""What a model will need in memory besides its weights, to tell before a download
whether it can run on this machine (its own module: the engine's builder reads it
without importing huggingface_hub)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from sluice.config import EngineConfig

GIB = 1 << 30
# Besides weights and the KV pool: activations, the sampler, Python and torch themselves.
RUNTIME_OVERHEAD = GIB // 2


@dataclass(frozen=True)
class MemoryBudget:
    """What the engine will hold besides a model's weights (its KV pool), to tell before a
    download whether the model can run on this machine."""

    kv_cache_bytes: int = 2 * GIB

    @classmethod
    def of(cls, config: EngineConfig) -> MemoryBudget:
        return cls(kv_cache_bytes=int(config.kv_cache_memory * GIB))

    def need(self, weight_bytes: int) -> int:
        return weight_bytes + self.kv_cache_bytes + RUNTIME_OVERHEAD


def machine_memory() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
