"""Paged KV cache bookkeeping: which blocks each request owns, and which are cached.

The tensors live in the model runner; this module only hands out block ids. A block
is free when no request references it. A free block that holds a full, hashed block of
some earlier prompt stays in the prefix cache until it is reused for something else,
and free blocks are reused least-recently-freed first, which makes eviction LRU.

A block is named (entered in the prefix cache) when the tokens that fill it are
scheduled, so that requests admitted in the same step can share it, but the name is
provisional until the step that writes its KV has finished: the engine then calls
`commit_names`, or `forget_uncommitted_names` if the step failed, so a block whose KV
was never written is never served.

With a sliding window on every layer (`window`), a block wholly before the window of
the next token a request computes is never read again: it is released as the request
moves on (dropping its reference, so a named block stays in the prefix cache, evictable,
like the blocks of a finished request), and its entry in the request's block table
becomes NO_BLOCK, which the runner and the attention paths never read.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from sluice.core.request import Request
from sluice.engine.prefix_cache import ROOT_HASH, extend_block_hashes

# A released block's place in a request's block table (see the module docstring).
NO_BLOCK = -1


class BlockPool:
    """Reference-counted block ids, an LRU free queue and the hash → block map."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # Insertion order = eviction order: the front is the least recently freed block.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            out.append(block)
        return out

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]
            self.num_evictions += 1

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on blocks found in the cache (reviving free ones); NO_BLOCK
        entries are skipped."""
        for block in blocks:
            if block == NO_BLOCK:
                continue
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference each (NO_BLOCK entries are skipped). Pass a request's
        blocks tail first: the tail of a sequence is the least likely to be shared
        again, so it should be evicted first."""
        for block in blocks:
            if block == NO_BLOCK:
                continue
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash)

    def cache_block(self, block: int, block_hash: int) -> bool:
        """Name `block`; False if it already had a name or an identical block is cached
        (the first one is kept)."""
        if self.block_hash[block] is not None or block_hash in self.cached:
            return False
        self.block_hash[block] = block_hash
        self.cached[block_hash] = block
        return True

    def uncache(self, blocks: list[int]) -> None:
        """Take the names off `blocks` (referenced or free); they stay allocated as they are."""
        for block in blocks:
            h = self.block_hash[block]
            if h is not None:
                self.block_hash[block] = None
                if self.cached.get(h) == block:
                    del self.cached[h]

    def reset_cache(self) -> int:
        """Forget every cached block that no request uses. Returns how many."""
        dropped = 0
        for block in list(self.free_queue):
            if self.block_hash[block] is not None:
                self._evict(block)
                dropped += 1
        return dropped


@dataclass
class CacheHit:
    blocks: list[int]
    num_tokens: int


class KVCacheManager:
    """Allocates, shares (prefix cache, forks with copy-on-write) and frees blocks."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        window: int | None = None,
        hash_root: int = ROOT_HASH,
    ) -> None:
        self.block_size = block_size
        self.hash_root = hash_root  # the prefix chain's seed (prefix_cache.root_hash)
        self.enable_prefix_caching = enable_prefix_caching
        # Every layer's sliding window (ModelConfig.kv_window): blocks before it are
        # released. None where some layer attends to the whole context.
        self.window = window
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        # Copies the runner must do before the next forward pass: (src, dst) block ids.
        self.pending_copies: list[tuple[int, int]] = []
        # Blocks named since the last commit_names(): the step in flight writes their KV.
        self._uncommitted: list[int] = []
        # Prefix-cache statistics, in tokens.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def may_reuse_prefix(self, request: Request) -> bool:
        """Whether a prefix computed elsewhere (the cache, a KV connector) may stand in
        for computing it: not where the prompt's own logits are asked for."""
        return self.enable_prefix_caching and request.sampling_params.prompt_logprobs is None

    def find_cached_prefix(self, request: Request) -> CacheHit:
        """Longest run of the prompt's full blocks already in the cache.

        At least one prompt token is always left to compute: its logits are needed to
        sample the first output token.
        """
        if not self.may_reuse_prefix(request):
            return CacheHit([], 0)
        bs = self.block_size
        extend_block_hashes(
            request.block_hashes, request.all_token_ids, request.num_tokens, bs, self.hash_root
        )
        max_blocks = (request.num_tokens - 1) // bs
        blocks: list[int] = []
        for h in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            blocks.append(block)
        return CacheHit(blocks, len(blocks) * bs)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        hit: CacheHit | None = None,
        num_loaded_tokens: int = 0,
    ) -> bool:
        """Make room for `num_new_tokens` more tokens of `request` in the cache, after
        the RAM `hit` and `num_loaded_tokens` (whole blocks a KV connector loads into the
        blocks allocated right after the hit's; they count as computed, like the hit).

        Returns False, changing nothing (but the release of blocks its window has
        left), when there are not enough free blocks.
        """
        self._release_outside_window(request)
        hit_blocks = hit.blocks if hit else []
        # Hit blocks that sit in the free queue stop being free when we take them.
        revived = sum(1 for b in hit_blocks if self.pool.ref_counts[b] == 0)
        num_held = len(request.block_ids) + len(hit_blocks)
        num_computed = (
            request.num_computed_tokens + (hit.num_tokens if hit else 0) + num_loaded_tokens
        )
        total = num_computed + num_new_tokens
        new_blocks = max(0, self.blocks_needed(total) - num_held)
        cow = self._needs_copy_on_write(request, num_computed) and num_new_tokens > 0
        if new_blocks + int(cow) + revived > self.pool.num_free:
            return False

        if hit_blocks:
            self.pool.touch(hit_blocks)
            request.block_ids.extend(hit_blocks)
            request.num_computed_tokens += hit.num_tokens  # type: ignore[union-attr]
        if cow:
            self._copy_on_write(request, num_computed)
        if new_blocks:
            request.block_ids.extend(self.pool.allocate(new_blocks))
        request.num_computed_tokens += num_loaded_tokens
        if self.enable_prefix_caching:
            # Draft tokens past the known ones are never named: only blocks full of
            # tokens the request keeps enter the cache.
            self._cache_full_blocks(request, min(total, request.num_tokens))
        return True

    def _release_outside_window(self, request: Request) -> None:
        """Drop the blocks no later token can see: the next token computed sits at
        position num_computed_tokens and sees num_computed_tokens - window + 1 on; the
        computed count only grows while the request holds blocks (a rollback takes back
        drafts computed after it, preemption frees everything)."""
        if self.window is None:
            return
        first_visible = request.num_computed_tokens - self.window + 1
        dead = max(0, first_visible) // self.block_size  # blocks wholly before it
        ids = request.block_ids
        released: list[int] = []
        i = min(dead, len(ids)) - 1
        while i >= 0 and ids[i] != NO_BLOCK:  # released ones form a prefix of the table
            released.append(ids[i])
            ids[i] = NO_BLOCK
            i -= 1
        self.pool.free(released)  # the later blocks first, as in free()

    def num_held_blocks(self, request: Request) -> int:
        """Blocks the request holds a reference on (released ones not counted)."""
        return sum(1 for b in request.block_ids if b != NO_BLOCK)

    def rollback(self, request: Request, num_rejected: int) -> None:
        """Forget the KV of the last `num_rejected` computed tokens (rejected drafts):
        the count of computed tokens drops and the blocks past the new end go back to
        the pool. None of them was named: names cover known tokens only."""
        if num_rejected <= 0:
            return
        request.num_computed_tokens -= num_rejected
        keep = self.blocks_needed(request.num_computed_tokens)
        assert request.num_named_blocks <= keep, "a rolled-back block was named"
        extra = request.block_ids[keep:]
        if extra:
            del request.block_ids[keep:]
            self.pool.free(list(reversed(extra)))

    def num_new_blocks(self, request: Request, num_tokens: int) -> int:
        """Free blocks that computing the request up to `num_tokens` tokens would take
        (its copy-on-write included)."""
        more = max(0, self.blocks_needed(num_tokens) - len(request.block_ids))
        cow = num_tokens > request.num_computed_tokens and self._needs_copy_on_write(
            request, request.num_computed_tokens
        )
        return more + int(cow)

    def record_prefix_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_prompt_tokens
        self.num_hit_tokens += num_hit_tokens

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def _needs_copy_on_write(self, request: Request, num_computed: int) -> bool:
        # Only a partially filled block is ever written to again; it must be private.
        if num_computed % self.block_size == 0:
            return False
        block = request.block_ids[num_computed // self.block_size]
        return self.pool.ref_counts[block] > 1

    def _copy_on_write(self, request: Request, num_computed: int) -> None:
        idx = num_computed // self.block_size
        src = request.block_ids[idx]
        (dst,) = self.pool.allocate(1)
        self.pool.free([src])
        request.block_ids[idx] = dst
        self.pending_copies.append((src, dst))

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        # Every token up to `num_tokens` is known (prompt or already sampled), so the
        # blocks it fills can be named now, for requests admitted later in this step to
        # share: their KV is written in this very step, and each layer writes all slots
        # before any request of the batch reads them. The names stay provisional until
        # the step has finished (commit_names).
        hashes = extend_block_hashes(
            request.block_hashes, request.all_token_ids, num_tokens, self.block_size, self.hash_root
        )
        num_full = num_tokens // self.block_size
        for i in range(request.num_named_blocks, num_full):
            block = request.block_ids[i]
            if block != NO_BLOCK and self.pool.cache_block(block, hashes[i]):
                self._uncommitted.append(block)
        request.num_named_blocks = max(request.num_named_blocks, num_full)

    def commit_names(self) -> None:
        """The step that was to write the newly named blocks' KV has finished."""
        self._uncommitted.clear()

    def forget_uncommitted_names(self) -> None:
        """The step that was to write the newly named blocks' KV failed: what they hold
        is undefined, so they leave the prefix cache. Their requests must be recomputed
        (the engine requeues them), or freed."""
        self.pool.uncache(self._uncommitted)
        self._uncommitted.clear()

    def fork(self, parent: Request, child: Request) -> None:
        """Let `child` share all of `parent`'s blocks; writes will copy on demand."""
        assert not child.block_ids
        self.pool.touch(parent.block_ids)
        child.block_ids = list(parent.block_ids)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_named_blocks = parent.num_named_blocks

    def free(self, request: Request) -> None:
        self.pool.free(list(reversed(request.block_ids)))
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_named_blocks = 0

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_cache()

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies
