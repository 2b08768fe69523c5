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

from dataclasses import dataclass

import torch

from sluice.config import EngineConfig, ModelConfig, resolve_quantization
from sluice.core.choices import WeightQuantization
from sluice.core.errors import ConfigError, ModelNotFoundError
from sluice.engine.kv_cache import KVCacheManager
from sluice.engine.speculative.draft_model import DraftModelProposer
from sluice.engine.speculative.vocabulary import check_draft_vocabulary
from sluice.loader import LoadedModel, Tokenizer, load_model
from sluice.runner.model_runner import ModelRunner, kv_bytes_per_block


@dataclass
class DraftModel:
    """A loaded, checked draft model whose runner is not built yet."""

    loaded: LoadedModel
    quantization: WeightQuantization

    @property
    def config(self) -> ModelConfig:
        return self.loaded.config

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return kv_bytes_per_block(self.loaded.config, block_size, dtype)


def load_draft_model(
    config: EngineConfig, target: LoadedModel, dtype: torch.dtype, device: torch.device
) -> DraftModel:
    """Load config.speculative_model and check that it can draft for `target`."""
    name = config.speculative_model
    assert name is not None, "EngineConfig checks that method 'draft' has a model"
    try:
        loaded = load_model(name)
    except ModelNotFoundError as e:
        raise ConfigError("speculative_model", f"speculative_model {name!r}: {e}") from e
    check_draft_vocabulary(target.tokenizer, target.config, loaded.tokenizer, loaded.config, name)
    quantization = resolve_quantization(
        config.quantization, device, dtype, loaded.quantized, config.dtype
    )
    return DraftModel(loaded, quantization)


def build_draft_proposer(
    draft: DraftModel,
    config: EngineConfig,
    target_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    num_blocks: int,
    max_model_len: int,
) -> DraftModelProposer:
    """The draft's runner (consuming its loaded weights) and KV pool, as a proposer."""
    mc = draft.loaded.config
    max_len = min(max_model_len, mc.max_position_embeddings)
    vocab_size = min(mc.vocab_size, target_config.vocab_size)
    output_ids = draft_output_ids(
        draft.loaded.tokenizer, vocab_size, config.speculative_draft_vocab_size
    )
    runner = ModelRunner(
        mc,
        draft.loaded.tensors,
        dtype,
        device,
        config.block_size,
        num_blocks,
        max_len,
        draft.quantization,
        config.compile,
        output_ids=output_ids,
    )
    draft.loaded.tensors = {}
    return DraftModelProposer(
        runner,
        KVCacheManager(num_blocks, config.block_size, enable_prefix_caching=False),
        vocab_size=vocab_size,
        max_model_len=max_len,
        max_chunk_tokens=config.max_num_batched_tokens,
        output_ids=output_ids,
    )


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
