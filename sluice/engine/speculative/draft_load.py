"""Loading the draft model of speculative_method="draft", in two halves around the
target's KV sizing.

The draft is loaded with the same loader as the target, in the same dtype, and its
weights take the same path (`quantization="auto"` keeps a quantized GGUF's blocks as
stored), so it costs its file's size in memory. It is checked against the target's
tokenizer before anything else is built (vocabulary.py). Its KV pool then comes out of
the same `kv_cache_memory`: the engine sizes both pools to the same number of blocks,
so every request the target can hold can have its draft sequence too (each draft
block costs the draft's bytes per block, usually far fewer than the target's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from sluice.config import ModelConfig, resolve_quantization
from sluice.core.choices import WeightQuantization
from sluice.core.errors import ConfigError, ModelNotFoundError
from sluice.engine.kv_cache import KVCacheManager
from sluice.engine.speculative.draft_model import DraftModelProposer
from sluice.engine.speculative.source import DraftBuild, DraftLoad
from sluice.engine.speculative.vocabulary import check_draft_vocabulary
from sluice.loader import LoadedModel, Tokenizer, load_model
from sluice.runner.factory import ModelVariant, build_runner
from sluice.runner.kv_layout import kv_bytes_per_block


@dataclass
class DraftModel:
    """A loaded, checked draft model whose runner is not built yet."""

    loaded: LoadedModel
    quantization: WeightQuantization
    name: str  # as speculative_model gave it (keys the step-cost table)

    @property
    def config(self) -> ModelConfig:
        return self.loaded.config

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return kv_bytes_per_block(self.loaded.config, block_size, dtype)

    def cost_key(self) -> str | None:
        return self.name

    def build(self, ctx: DraftBuild) -> DraftModelProposer:
        """The draft's runner (consuming its loaded weights) and KV pool, as a proposer."""
        mc = self.loaded.config
        max_len = min(ctx.layout.max_model_len, mc.max_position_embeddings)
        vocab_size = min(mc.vocab_size, ctx.target_config.vocab_size)
        output_ids = draft_output_ids(
            self.loaded.tokenizer, vocab_size, ctx.config.speculative_draft_vocab_size
        )
        runner = build_runner(
            config=mc,
            tensors=self.loaded.tensors,
            # Its own file's weight format (a Q8_0 draft beside a Q4_K_M target).
            options=dataclasses.replace(ctx.options, quantization=self.quantization),
            layout=ctx.layout.for_draft(max_len),
            variant=ModelVariant(output_ids=output_ids),
        )
        self.loaded.tensors = {}
        return DraftModelProposer(
            runner,
            KVCacheManager(
                ctx.layout.num_blocks, ctx.layout.block_size, enable_prefix_caching=False
            ),
            vocab_size=vocab_size,
            max_model_len=max_len,
            max_chunk_tokens=ctx.config.max_num_batched_tokens,
            output_ids=output_ids,
        )


def load_draft_model(ctx: DraftLoad) -> DraftModel:
    """Load config.speculative_model and check that it can draft for the target."""
    config, target = ctx.config, ctx.target
    name = config.speculative_model
    assert name is not None, "EngineConfig checks that method 'draft' has a model"
    try:
        loaded = load_model(name)
    except ModelNotFoundError as e:
        raise ConfigError("speculative_model", f"speculative_model {name!r}: {e}") from e
    check_draft_vocabulary(target.tokenizer, target.config, loaded.tokenizer, loaded.config, name)
    quantization = resolve_quantization(
        config.quantization, ctx.options.device, ctx.options.dtype, loaded.quantized, config.dtype
    )
    return DraftModel(loaded, quantization, name)


def draft_output_ids(tokenizer: Tokenizer, vocab_size: int, size: int) -> torch.Tensor | None:
    """The ids a restricted draft head keeps: the first `size` ids (BPE assigns ids in
    merge order, roughly from frequent to rare) and the tokenizer's added tokens (the
    end-of-turn and end-of-text marks sit at the end of the vocabulary); None where
    that is the whole vocabulary (or size is 0)."""
    if size == 0 or size >= vocab_size:
        return None
    added = tokenizer.backend.get_added_tokens_decoder()
    ids = sorted(set(range(size)) | {i for i in added if i < vocab_size})
    return torch.tensor(ids, dtype=torch.long)
