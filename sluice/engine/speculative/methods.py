"""The speculative methods, registered by name: what the engine's builder needs to know
of each (nothing else in the engine names a method).

A method is loaded in two halves around the target's KV sizing, since a drafter that
runs a model (a draft model, an EAGLE head) takes its KV pool out of the same
kv_cache_memory: `load` reads and checks what it needs and says what one of its KV
blocks costs; `build` makes the proposer once the target's layout is known. A new
method is a proposer class, a DraftSource for it, and one line in METHODS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from sluice import kernels
from sluice.config import EngineConfig
from sluice.core.choices import SPECULATIVE_METHODS, SpeculativeMethod
from sluice.engine.kv_cache import KVCacheManager
from sluice.engine.speculative.draft_load import load_draft_model
from sluice.engine.speculative.eagle_load import load_eagle_head
from sluice.engine.speculative.ngram import NgramProposer
from sluice.engine.speculative.proposer import Proposer
from sluice.engine.speculative.shadow import ShadowProposer
from sluice.engine.speculative.source import DraftBuild, DraftLoad, DraftSource
from sluice.engine.speculative.speculator import Speculator
from sluice.engine.speculative.step_costs import StepCostMeasurement, StepCosts, load_or_measure
from sluice.engine.speculative.suffix import SuffixProposer
from sluice.runner.factory import RunnerOptions
from sluice.runner.model_runner import ModelRunner
from sluice.runner.sampler import Sampler


@dataclass(frozen=True)
class _Stateless:
    """A method that drafts from the tokens alone: nothing to load, no KV."""

    make: Callable[[], Proposer]

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return 0

    def cost_key(self) -> str | None:
        return None

    def build(self, ctx: DraftBuild) -> Proposer:
        return self.make()


@dataclass(frozen=True)
class SpeculativeMethodInfo:
    load: Callable[[DraftLoad], DraftSource]
    """Read and check the drafter (before the target's KV is sized)."""
    needs_features: bool = False
    """The target's runner returns every token's hidden state for the proposer."""


METHODS: dict[SpeculativeMethod, SpeculativeMethodInfo] = {
    "ngram": SpeculativeMethodInfo(lambda ctx: _Stateless(NgramProposer)),
    "suffix": SpeculativeMethodInfo(lambda ctx: _Stateless(SuffixProposer)),
    "draft": SpeculativeMethodInfo(load_draft_model),
    "eagle": SpeculativeMethodInfo(load_eagle_head, needs_features=True),
}
assert tuple(METHODS) == SPECULATIVE_METHODS, "core/choices.py lists every method"


def build_speculator(
    config: EngineConfig,
    proposer: Proposer,
    cost_key: dict[str, object],
    target: tuple[ModelRunner, KVCacheManager, Sampler],
    max_model_len: int,
) -> Speculator:
    """The speculator, with the step-cost table of this model and drafter on this
    machine (measured once, then read from the cache), or the flat one the config
    gives (speculative_draft_cost)."""
    k = config.num_speculative_tokens
    if config.speculative_draft_cost is not None:
        costs = StepCosts.uniform(config.speculative_draft_cost, config.max_num_seqs, k)
        return Speculator(proposer, k, max_model_len, costs)
    runner, kv, sampler = target
    drafter = (proposer.runner, proposer.kv) if isinstance(proposer, ShadowProposer) else None
    measurement = StepCostMeasurement(runner, kv, sampler, k, drafter)
    return Speculator(proposer, k, max_model_len, load_or_measure(cost_key, measurement))


def step_cost_key(
    config: EngineConfig,
    source: DraftSource,
    model_path: Path,
    options: RunnerOptions,
) -> dict[str, object]:
    """What the step-cost table depends on: the model, the drafter, the weight format,
    the kernels and threads, the device and the block size."""
    cpu = options.device.type == "cpu"
    return {
        "model": str(model_path.resolve()),
        "size": model_path.stat().st_size if model_path.is_file() else 0,
        "draft_model": source.cost_key(),
        "draft_vocab": config.speculative_draft_vocab_size,
        "dtype": str(options.dtype),
        "quantization": options.quantization,
        "kernels": kernels.build_id() if cpu else "off",
        "threads": torch.get_num_threads() if cpu else 0,
        "device": str(options.device),
        "block_size": config.block_size,
        "max_drafts": config.num_speculative_tokens,
    }
