"""What a runner's KV pools look like (KVLayout), what they cost, and their allocation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sluice.attention import kv_int8
from sluice.config import GLOBAL_KV_GROUP, LOCAL_KV_GROUP, ModelConfig
from sluice.core import host_memory
from sluice.core.choices import KVCacheDType
from sluice.core.errors import ConfigError


@dataclass(frozen=True)
class KVLayout:
    """The shape of one runner's KV cache, decided once by the engine's builder from
    kv_cache_memory and the model, and handed whole to every runner that holds KV."""

    block_size: int
    """Tokens per KV block."""
    num_blocks: int
    """Blocks of the global pool (every layer, or a split cache's full-attention ones)."""
    max_model_len: int
    """The longest sequence (prompt and output) a block table may describe."""
    kv_cache_dtype: KVCacheDType = "auto"
    """"auto": K/V in the compute dtype; "int8": int8 rows with fp16 scales."""
    skip_layers: tuple[int, ...] = ()
    """Layers kept at full precision in an int8 cache."""
    local_num_blocks: int | None = None
    """Blocks of a split cache's windowed-layer pool; None: one pool for every layer."""
    local_window: int | None = None
    """What that pool keeps of a sequence: its layers' largest window (None: no pool)."""

    def for_draft(self, max_model_len: int) -> KVLayout:
        """A drafter's pool (a draft model, an EAGLE head): as many blocks as the
        target's global pool, in the compute dtype (a draft's KV is small, and its
        precision is what its guesses are measured at), one pool."""
        return KVLayout(self.block_size, self.num_blocks, max_model_len)


def kv_bytes_per_block(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: KVCacheDType = "auto",
    skip_layers: tuple[int, ...] = (),
    layers: Sequence[int] | None = None,
) -> int:
    """Bytes one block takes over the K and V pools of `layers` (None: all layers; a
    split cache's group sizes its own blocks)."""
    rows = 2 * block_size * config.num_kv_heads  # K and V rows of one layer's block
    full = config.head_dim * torch.empty((), dtype=dtype).element_size()
    chosen = set(range(config.num_layers) if layers is None else layers)
    if kv_cache_dtype == "auto":
        return len(chosen) * rows * full
    num_full = len(chosen.intersection(_full_precision_layers(config, kv_cache_dtype, skip_layers)))
    int8_row = kv_int8.row_bytes(config.head_dim)
    return rows * (num_full * full + (len(chosen) - num_full) * int8_row)


def check_kv_cache_dtype(
    kv_cache_dtype: KVCacheDType, skip_layers: tuple[int, ...], config: ModelConfig
) -> None:
    """Refuse an int8 KV cache the model's shapes cannot hold, naming the setting."""
    if kv_cache_dtype != "int8":
        return
    if config.head_dim % kv_int8.GROUP:
        raise ConfigError(
            "kv_cache_dtype",
            f"kv_cache_dtype='int8' needs a head size divisible by {kv_int8.GROUP}; this "
            f"model's is {config.head_dim}",
        )
    bad = [i for i in skip_layers if i >= config.num_layers]
    if bad:
        raise ConfigError(
            "kv_cache_skip_layers",
            f"kv_cache_skip_layers names layer {bad[0]}, but the model has "
            f"{config.num_layers} layers (0..{config.num_layers - 1})",
        )


def _full_precision_layers(
    config: ModelConfig, kv_cache_dtype: KVCacheDType, skip_layers: tuple[int, ...]
) -> list[int]:
    if kv_cache_dtype == "auto":
        return list(range(config.num_layers))
    return [i for i in skip_layers if i < config.num_layers]


@dataclass
class KVPools:
    """The KV tensors: the pools (one per cache group and storage format, each
    [layers, 2, blocks, kv_heads, block_size, row]), the group of each pool, and each
    layer's (K, V) view into its pool."""

    pools: list[torch.Tensor]
    pool_groups: list[int]
    caches: list[tuple[torch.Tensor, torch.Tensor]]


def allocate_kv_pools(
    config: ModelConfig, layout: KVLayout, dtype: torch.dtype, device: torch.device
) -> KVPools:
    """Within a block each head's tokens are contiguous (what the decode kernel
    streams); a row is head_dim values of `dtype`, or an int8 row's bytes
    (attention/kv_int8.py) for quantized layers. With `layout.local_num_blocks`, the
    windowed layers of a model that has full-attention ones too get pools of that many
    blocks (the local group of a split cache)."""
    local_blocks = layout.local_num_blocks
    local = set(config.split_kv_local_layers()) if local_blocks is not None else set()
    full = set(_full_precision_layers(config, layout.kv_cache_dtype, layout.skip_layers))
    out = KVPools([], [], [])
    caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    kv_heads, d = config.num_kv_heads, config.head_dim
    for group, blocks in ((GLOBAL_KV_GROUP, layout.num_blocks), (LOCAL_KV_GROUP, local_blocks)):
        members = [i for i in range(config.num_layers) if (i in local) == (group == LOCAL_KV_GROUP)]
        for layers, elem, row in (
            ([i for i in members if i in full], dtype, d),
            ([i for i in members if i not in full], torch.uint8, kv_int8.row_bytes(d)),
        ):
            if not layers or blocks is None:
                continue
            shape = (len(layers), 2, blocks, kv_heads, layout.block_size, row)
            # Zeros, not garbage: a padded SDPA fallback multiplies unused slots by a
            # zero weight, and 0 * NaN would poison it. Huge pages: decode reads and
            # writes K/V in blocks scattered over the pool, and with 4 KiB pages nearly
            # every block access missed the TLB.
            pool = host_memory.zeroed(shape, elem, device)
            out.pools.append(pool)
            out.pool_groups.append(group)
            caches.update({layer: (pool[j, 0], pool[j, 1]) for j, layer in enumerate(layers)})
    out.caches = [caches[i] for i in range(config.num_layers)]
    return out
