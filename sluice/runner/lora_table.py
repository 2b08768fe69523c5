"""Which adapter each of the model's LoRA slots holds.

The model has `max_loras` slots beside every adaptable Linear (sluice/layers/lora.py).
Before a step, the adapters of its requests get slots: one already holding the
adapter keeps it; a new one takes a free slot, else the least recently used slot
that no request of this step needs, and its weights are copied in. The scheduler
admits at most `max_loras` distinct adapters among the running requests, so a step
always finds room.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.core.lora import LoRAAdapter
from sluice.layers.lora import EmbeddingLoRASlots, LoRAShard, LoRASlots
from sluice.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class LoRACapacity:
    """How many adapters a model holds at once, their largest rank, and how they are
    stored."""

    max_loras: int
    """Slots beside every adaptable Linear: adapters that can run in one step."""
    max_rank: int
    """The slots' rank per projection; a smaller adapter uses its first rows."""
    int8: bool = False
    """Slots hold int8 matrices with scales (config.resolve_lora_dtype), else the
    model's dtype."""


class LoRASlotTable:
    """The slots of every adapted layer of one model, filled least recently used out."""

    def __init__(self, layers: list[LoRASlots | EmbeddingLoRASlots], max_loras: int) -> None:
        self.layers = layers
        self.keys: list[int | None] = [None] * max_loras
        self.last_used = [0] * max_loras
        self.clock = 0
        self.loads = 0  # adapters copied into a slot since start

    @classmethod
    def attach(
        cls, model: LlamaForCausalLM, capacity: LoRACapacity, tp_rank: int = 0
    ) -> LoRASlotTable:
        """Give every adaptable Linear of `model` and its token embedding their slots
        (for the model's dtype, on its device; on a tensor-parallel rank, for its part
        of each adapter: a layer whose output the group all-reduces is row-parallel, the
        embedding's vocabulary slice too) and return their table."""
        dtype, device = model.embed_tokens.weight.dtype, model.embed_tokens.weight.device
        layers: list[LoRASlots | EmbeddingLoRASlots] = []
        for layer, linear, targets, widths in model.lora_linears():
            shard = LoRAShard(tp_rank, row_parallel=linear.reduce is not None)
            with torch.device(device):
                slots = LoRASlots(
                    layer=layer,
                    targets=targets,
                    widths=widths,
                    in_features=linear.in_features,
                    max_loras=capacity.max_loras,
                    max_rank=capacity.max_rank,
                    dtype=dtype,
                    int8=capacity.int8,
                    shard=shard,
                )
            linear.lora = slots
            layers.append(slots)
        config = model.config
        with torch.device(device):
            embedding = EmbeddingLoRASlots(
                vocab=config.vocab_size,
                hidden=config.hidden_size,
                max_loras=capacity.max_loras,
                max_rank=capacity.max_rank,
                dtype=dtype,
                shard=LoRAShard(tp_rank, row_parallel=True),
            )
        model.embed_tokens.lora = embedding
        layers.append(embedding)
        return cls(layers, capacity.max_loras)

    @property
    def num_loaded(self) -> int:
        return sum(k is not None for k in self.keys)

    def slots_for(
        self, adapters: list[LoRAAdapter]
    ) -> tuple[dict[int, int], list[tuple[int, LoRAAdapter]]]:
        """adapter key -> slot for every adapter of a step, loading those not held;
        and the (slot, adapter) loads made (other tensor-parallel ranks repeat them)."""
        self.clock += 1
        wanted = {a.key: a for a in adapters}
        placed: dict[int, int] = {}
        for slot, key in enumerate(self.keys):
            if key is not None and key in wanted:
                placed[key] = slot
                self.last_used[slot] = self.clock
        loaded = []
        for key, adapter in wanted.items():
            if key in placed:
                continue
            slot = self._victim(set(placed.values()))
            self.load(slot, adapter)
            self.last_used[slot] = self.clock
            placed[key] = slot
            loaded.append((slot, adapter))
        return placed, loaded

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy `adapter` into `slot` of every layer (rank 0's choice, on any rank)."""
        for layer in self.layers:
            layer.load(slot, adapter)
        self.keys[slot] = adapter.key
        self.loads += 1

    def _victim(self, taken: set[int]) -> int:
        """A free slot, else the least recently used one this step does not need."""
        free = [s for s, k in enumerate(self.keys) if k is None]
        if free:
            return free[0]
        candidates = [s for s in range(len(self.keys)) if s not in taken]
        if not candidates:
            raise RuntimeError(
                f"a step needs more than max_loras={len(self.keys)} adapters (the "
                "scheduler admits at most that many)"
            )
        return min(candidates, key=lambda s: self.last_used[s])
