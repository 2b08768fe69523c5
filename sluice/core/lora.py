"""LoRA adapters as the engine sees them: what a request names (`LoRARequest`, as vLLM
spells it) and an adapter's validated weights (`LoRAAdapter`, made by
sluice/loader/lora.py), which every layer below the engine reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.core.choices import LoRATarget
from sluice.core.errors import RequestError


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with: its name (what the API's `model` says), a
    user-chosen integer id, and the folder (PEFT) or .gguf file (llama.cpp) it loads
    from. vLLM's constructor, positionally: LoRARequest("sql", 1, "/path")."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name.strip():
            raise RequestError(
                "lora_name", f"lora_name must be a non-empty string, got {self.lora_name!r}"
            )
        id_ok = isinstance(self.lora_int_id, int) and not isinstance(self.lora_int_id, bool)
        if not id_ok or self.lora_int_id < 1:
            raise RequestError(
                "lora_int_id", f"lora_int_id must be a positive integer, got {self.lora_int_id!r}"
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise RequestError("lora_path", f"lora_path must be a path, got {self.lora_path!r}")


# The layer index of the modules that belong to the model rather than a layer (the
# token embedding and the head) in LoRAAdapter.modules' keys.
MODEL_LAYER = -1


@dataclass(frozen=True, eq=False)
class LoRAModule:
    """One adapted projection of one layer: y += scale * (x A^T) B^T. The token
    embedding's is the same with x a token's one-hot row: in = the vocabulary."""

    a: torch.Tensor  # [rank, in] fp32
    b: torch.Tensor  # [out, rank] fp32, the scale folded in


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """A loaded, validated adapter: its low-rank pairs by (layer, projection)."""

    name: str
    path: str
    key: int
    """Content identity (from the files' digest): the prefix cache keys an adapter's
    blocks by it, so two adapters never share KV and reloading the same files does."""
    rank: int
    """The largest rank of its projections."""
    modules: dict[tuple[int, LoRATarget], LoRAModule]
    """By (layer, projection); the embedding's and the head's at layer MODEL_LAYER."""

    @property
    def nbytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())
