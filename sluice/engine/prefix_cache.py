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
_ROOT_HASH = hash("sluice-prefix-root")


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    return hash((_ROOT_HASH if parent_hash is None else parent_hash, tuple(token_ids)))


def extend_block_hashes(
    block_hashes: list[int], token_ids: Sequence[int], num_tokens: int, block_size: int
) -> list[int]:
    """Append the hashes of every full block among the first `num_tokens` tokens."""
    num_full = num_tokens // block_size
    for i in range(len(block_hashes), num_full):
        parent = block_hashes[-1] if block_hashes else None
        block_hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size]))
    return block_hashes
