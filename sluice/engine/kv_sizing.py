"""How many KV blocks kv_cache_memory buys: the KVLayout the builder hands every runner."""

from __future__ import annotations

import logging

import torch

from sluice.config import EngineConfig, ModelConfig
from sluice.runner.kv_layout import KVLayout, kv_bytes_per_block

logger = logging.getLogger("sluice")


def plan_kv_layout(
    config: EngineConfig, mc: ModelConfig, dtype: torch.dtype, draft_bytes: int
) -> KVLayout:
    """The target's KV layout out of kv_cache_memory, leaving room for a drafter's pool
    of as many blocks (`draft_bytes` a block: a draft model's or an EAGLE head's K/V)."""
    local_layers = split_kv_local_layers(config, mc)
    local_num_blocks: int | None = None
    window: int | None = None
    if local_layers:
        # The windowed layers' largest window: what the local pool keeps of a sequence.
        window = max((mc.layer_window(i) or 0) for i in local_layers)
        num_blocks, local_num_blocks = _split_kv_blocks(
            config, mc, dtype, draft_bytes, local_layers, window
        )
        logger.info(
            "split KV cache: %d blocks for the %d full-attention layers, %d for the %d "
            "windowed layers",
            num_blocks,
            mc.num_layers - len(local_layers),
            local_num_blocks,
            len(local_layers),
        )
    else:
        per_block = kv_bytes_per_block(
            mc, config.block_size, dtype, config.kv_cache_dtype, config.kv_cache_skip_layers
        )
        num_blocks = _num_kv_blocks(config, per_block + draft_bytes)
    return KVLayout(
        block_size=config.block_size,
        num_blocks=num_blocks,
        # Only the global pool caps a sequence's length: the local one needs a window.
        max_model_len=min(
            config.max_model_len or mc.max_position_embeddings, num_blocks * config.block_size
        ),
        kv_cache_dtype=config.kv_cache_dtype,
        skip_layers=config.kv_cache_skip_layers,
        local_num_blocks=local_num_blocks,
        local_window=window or None,
    )


def split_kv_local_layers(config: EngineConfig, mc: ModelConfig) -> list[int]:
    """The windowed layers a split KV cache keeps in a pool of their own, or [] for
    one pool: where every layer or none is windowed, where split_kv_pool=False asks
    for one, and under a KV connector (kv_offload_dir, kv_role), whose blocks are
    one pool's (a block id, a file of every layer's K/V)."""
    local = mc.split_kv_local_layers()
    if not local or not config.split_kv_pool:
        return []
    if config.kv_offload_dir is not None or config.kv_role is not None:
        logger.info(
            "one KV pool for every layer: kv_offload_dir and kv_role move whole blocks "
            "of one pool (the windowed layers' K/V are kept for the whole sequence)"
        )
        return []
    return local


def _num_kv_blocks(config: EngineConfig, per_block: int) -> int:
    """How many blocks of `per_block` bytes (the K and V of every layer; a draft
    model's too) kv_cache_memory holds."""
    num_blocks = int(config.kv_cache_memory * 2**30) // per_block
    if num_blocks < 2:
        raise ValueError(
            f"kv_cache_memory={config.kv_cache_memory} GiB holds fewer than 2 blocks "
            f"of {config.block_size} tokens ({per_block} bytes each)"
        )
    return num_blocks


def _split_kv_blocks(
    config: EngineConfig,
    mc: ModelConfig,
    dtype: torch.dtype,
    extra_global_bytes: int,
    local: list[int],
    window: int,
) -> tuple[int, int]:
    """(global blocks, local blocks) of a split KV cache out of kv_cache_memory.

    The bytes are shared in proportion to what one sequence at max_model_len holds in
    each group: every position in the full-attention layers (plus `extra_global_bytes`
    a block, a draft model's pool, which mirrors the global table), at most a window
    plus a prefill chunk in the windowed ones. The local pool never holds fewer blocks
    than one sequence needs at once: a window plus a chunk, one block more for the
    window's unaligned start and one for a copy-on-write."""
    bs = config.block_size
    full = [i for i in range(mc.num_layers) if i not in set(local)]
    kv_dtype, skip = config.kv_cache_dtype, config.kv_cache_skip_layers
    per_global = kv_bytes_per_block(mc, bs, dtype, kv_dtype, skip, full) + extra_global_bytes
    per_local = kv_bytes_per_block(mc, bs, dtype, kv_dtype, skip, local)
    reach = window + config.max_num_batched_tokens
    length = config.max_model_len or mc.max_position_embeddings
    global_share = per_global * -(-length // bs)
    local_share = per_local * -(-min(length, reach) // bs)
    total = int(config.kv_cache_memory * 2**30)
    by_share = total * local_share // (global_share + local_share) // per_local
    num_local = max(by_share, -(-reach // bs) + 2)
    num_global = (total - num_local * per_local) // per_global
    if num_global < 2:
        raise ValueError(
            f"kv_cache_memory={config.kv_cache_memory} GiB holds fewer than 2 blocks of "
            f"{bs} tokens for the full-attention layers beside the {num_local} blocks the "
            f"windowed layers need ({per_global} and {per_local} bytes each)"
        )
    return num_global, num_local
