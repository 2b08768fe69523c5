"""Content addresses for full KV blocks: a hash chain.

A full block is named by hash(parent block's hash, its own token ids), so equal names
mean equal token prefixes up to and including that block, and a lookup walks a
request's chain until the first miss. We chose a hash chain over a radix tree: lookup
and insertion are O(blocks) dict operations, eviction works on single blocks (no tree
surgery), and it needs no per-token structure. The price, only full blocks are shared,
is what a paged cache gives anyway (a partial block is private or copy-on-write).
"""

from __future__ import annotations

from collections.abc import Sequence

# Seeds the chain so that the first block's hash is not just hash(tokens).
ROOT_HASH = hash("sluice-prefix-root")


def root_hash(kv_cache_dtype: str) -> int:
    """The chain's seed for blocks stored as `kv_cache_dtype`: a block's name says how
    its K/V are stored, so int8 blocks never answer for full-precision ones (or the
    other way round) wherever names are compared across pools."""
    return ROOT_HASH if kv_cache_dtype == "auto" else hash((ROOT_HASH, kv_cache_dtype))


def hash_block(parent_hash: int | None, token_ids: Sequence[int], root: int = ROOT_HASH) -> int:
    return hash((root if parent_hash is None else parent_hash, tuple(token_ids)))


def extend_block_hashes(
    block_hashes: list[int],
    token_ids: Sequence[int],
    num_tokens: int,
    block_size: int,
    root: int = ROOT_HASH,
) -> list[int]:
    """Append the hashes of every full block among the first `num_tokens` tokens."""
    num_full = num_tokens // block_size
    for i in range(len(block_hashes), num_full):
        parent = block_hashes[-1] if block_hashes else None
        tokens = token_ids[i * block_size : (i + 1) * block_size]
        block_hashes.append(hash_block(parent, tokens, root))
    return block_hashes
