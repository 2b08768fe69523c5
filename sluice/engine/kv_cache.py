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

A model with both windowed and full-attention layers (Gemma 3) gets two groups, each a
pool of its own with its own table per request (llama.cpp's separate SWA cache; vLLM
keeps one group per attention type): the global group holds the full-attention layers'
K/V of the whole sequence, the local group the windowed layers' K/V, released behind
the window as above. A block of either group holds only its own layers' K/V, so it is
smaller; each group names its blocks by the same hashes; an allocation takes from both
or from neither.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from sluice.config import GLOBAL_KV_GROUP, LOCAL_KV_GROUP
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
    # The local group's entries for the same tokens (a split pool only): NO_BLOCK
    # before the window of the first token computed after the hit.
    local_blocks: list[int] = field(default_factory=list)

    def group_blocks(self, group: int) -> list[int]:
        return self.blocks if group == GLOBAL_KV_GROUP else self.local_blocks


class _BlockGroup:
    """One pool and the block table of each request that indexes it (an attribute of
    the request, named by `table`), with the copies and provisional names it owes."""

    def __init__(self, pool: BlockPool, table: str, window: int | None, block_size: int) -> None:
        self.pool = pool
        self.table_name = table
        self.window = window  # blocks wholly before it are released; None: never
        self.block_size = block_size
        # Copies the runner must do before the next forward pass: (src, dst) block ids.
        self.pending_copies: list[tuple[int, int]] = []
        # Blocks named since the last commit_names(): the step in flight writes their KV.
        self.uncommitted: list[int] = []

    def table(self, request: Request) -> list[int]:
        table: list[int] = getattr(request, self.table_name)
        return table

    def first_live_block(self, num_computed: int) -> int:
        """Index of the first block the token at position num_computed can see."""
        if self.window is None:
            return 0
        return max(0, num_computed - self.window + 1) // self.block_size

    def release_outside_window(self, request: Request) -> None:
        """Drop the blocks no later token can see: the next token computed sits at
        position num_computed_tokens and sees num_computed_tokens - window + 1 on; the
        computed count only grows while the request holds blocks (a rollback takes back
        drafts computed after it, preemption frees everything)."""
        if self.window is None:
            return
        ids = self.table(request)
        released: list[int] = []
        i = min(self.first_live_block(request.num_computed_tokens), len(ids)) - 1
        while i >= 0 and ids[i] != NO_BLOCK:  # released ones form a prefix of the table
            released.append(ids[i])
            ids[i] = NO_BLOCK
            i -= 1
        self.pool.free(released)  # the later blocks first, as in free()

    def blocks_to_take(self, request: Request, hit_blocks: list[int], total: int, cow: bool) -> int:
        """Free blocks taking the hit, copying on write (`cow`) and growing the table to
        `total` tokens would use up (a hit block in the free queue counts: it stops
        being free)."""
        revived = sum(1 for b in hit_blocks if b != NO_BLOCK and self.pool.ref_counts[b] == 0)
        held = len(self.table(request)) + len(hit_blocks)
        new_blocks = max(0, -(-total // self.block_size) - held)
        return new_blocks + int(cow) + revived

    def take(
        self, request: Request, hit_blocks: list[int], num_computed: int, total: int, cow: bool
    ) -> None:
        """Do what blocks_to_take counted (the caller checked there is room)."""
        ids = self.table(request)
        if hit_blocks:
            self.pool.touch(hit_blocks)
            ids.extend(hit_blocks)
        if cow:
            idx = num_computed // self.block_size
            src = ids[idx]
            (dst,) = self.pool.allocate(1)
            self.pool.free([src])
            ids[idx] = dst
            self.pending_copies.append((src, dst))
        new_blocks = -(-total // self.block_size) - len(ids)
        if new_blocks > 0:
            ids.extend(self.pool.allocate(new_blocks))

    def needs_copy_on_write(self, request: Request, num_computed: int) -> bool:
        # Only a partially filled block is ever written to again; it must be private.
        if num_computed % self.block_size == 0:
            return False
        block = self.table(request)[num_computed // self.block_size]
        return self.pool.ref_counts[block] > 1

    def name_blocks(self, request: Request, hashes: list[int], first: int, num_full: int) -> None:
        """Enter the request's blocks first .. num_full - 1 in the prefix cache
        (provisionally: see commit_names)."""
        ids = self.table(request)
        for i in range(first, num_full):
            block = ids[i]
            if block != NO_BLOCK and self.pool.cache_block(block, hashes[i]):
                self.uncommitted.append(block)

    def truncate(self, request: Request, keep: int) -> None:
        """Give back the blocks past the first `keep` of the table."""
        ids = self.table(request)
        extra = ids[keep:]
        if extra:
            del ids[keep:]
            self.pool.free(list(reversed(extra)))

    def free(self, request: Request) -> None:
        self.pool.free(list(reversed(self.table(request))))
        setattr(request, self.table_name, [])

    def fork(self, parent: Request, child: Request) -> None:
        parent_ids = self.table(parent)
        assert not self.table(child)
        self.pool.touch(parent_ids)
        setattr(child, self.table_name, list(parent_ids))

    def num_held(self, request: Request) -> int:
        return sum(1 for b in self.table(request) if b != NO_BLOCK)


class KVCacheManager:
    """Allocates, shares (prefix cache, forks with copy-on-write) and frees blocks.

    One group (a pool and the request's `block_ids`) for most models; with
    `local_num_blocks`, a second group for the windowed layers of a model that also
    has full-attention ones (Gemma 3): its pool and its table (`local_block_ids`) are
    released behind `local_window`. Both tables always have the same length (a
    released entry is NO_BLOCK), so counts of blocks a request needs are the same in
    both; what differs is what they hold."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        window: int | None = None,
        hash_root: int = ROOT_HASH,
        local_num_blocks: int | None = None,
        local_window: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.hash_root = hash_root  # the prefix chain's seed (prefix_cache.root_hash)
        self.enable_prefix_caching = enable_prefix_caching
        # Every layer's sliding window (ModelConfig.kv_window): blocks before it are
        # released. None where some layer attends to the whole context.
        self.window = window
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.groups = [_BlockGroup(self.pool, "block_ids", window, block_size)]
        if local_num_blocks is not None:
            if local_window is None or window is not None:
                raise ValueError("a local pool needs local_window, and a global pool without one")
            local = BlockPool(local_num_blocks, enable_prefix_caching)
            self.groups.append(_BlockGroup(local, "local_block_ids", local_window, block_size))
        # Prefix-cache statistics, in tokens.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def local_pool(self) -> BlockPool | None:
        """The windowed layers' pool of a split cache; None with one pool."""
        return self.groups[LOCAL_KV_GROUP].pool if len(self.groups) > 1 else None

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of the group with the fewest (each group's table grows alike)."""
        return min(g.pool.num_free for g in self.groups)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request, in the fuller group."""
        return max(1.0 - g.pool.num_free / g.pool.num_blocks for g in self.groups)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def may_reuse_prefix(self, request: Request) -> bool:
        """Whether a prefix computed elsewhere (the cache, a KV connector) may stand in
        for computing it: not where the prompt's own logits are asked for, nor for an
        embedding request, which pools the prompt's hidden states (the cache keeps K/V)."""
        return (
            self.enable_prefix_caching
            and request.sampling_params.prompt_logprobs is None
            and request.pooling is None
        )

    def root(self, request: Request) -> int:
        """The seed of a request's hash chain: a LoRA adapter's requests chain from one
        of their own (its content key), so KV computed through one adapter never
        answers for the base model or another adapter."""
        if request.lora is None:
            return self.hash_root
        return hash((self.hash_root, "lora", request.lora.key))

    def find_cached_prefix(self, request: Request) -> CacheHit:
        """Longest run of the prompt's full blocks already in the cache.

        At least one prompt token is always left to compute: its logits are needed to
        sample the first output token.
        """
        if not self.may_reuse_prefix(request):
            return CacheHit([], 0)
        bs = self.block_size
        hashes = extend_block_hashes(
            request.block_hashes, request.all_token_ids, request.num_tokens, bs, self.root(request)
        )
        max_blocks = (request.num_tokens - 1) // bs
        blocks: list[int] = []
        for h in hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            blocks.append(block)
        if len(self.groups) == 1:
            return CacheHit(blocks, len(blocks) * bs)
        return self._split_hit(hashes, blocks)

    def _split_hit(self, hashes: list[int], global_blocks: list[int]) -> CacheHit:
        """The longest hit of k blocks (k <= len(global_blocks)) whose last window the
        local pool still holds: blocks first_live_block(k * block_size) .. k - 1."""
        local = self.groups[LOCAL_KV_GROUP]
        found: list[int] = []
        run = best = 0  # run: cached local blocks ending at block k - 1
        for k in range(1, len(global_blocks) + 1):
            block = local.pool.lookup(hashes[k - 1])
            found.append(NO_BLOCK if block is None else block)
            run = run + 1 if block is not None else 0
            if run >= k - local.first_live_block(k * self.block_size):
                best = k
        first = local.first_live_block(best * self.block_size)
        local_blocks = [NO_BLOCK] * first + found[first:best]
        return CacheHit(global_blocks[:best], best * self.block_size, local_blocks)

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
        left), when some group has not enough free blocks: both groups take, or none.
        """
        for group in self.groups:
            group.release_outside_window(request)
        hit_tokens = hit.num_tokens if hit else 0
        num_computed = request.num_computed_tokens + hit_tokens + num_loaded_tokens
        total = num_computed + num_new_tokens
        plans = []
        for i, group in enumerate(self.groups):
            hit_blocks = hit.group_blocks(i) if hit else []
            cow = num_new_tokens > 0 and group.needs_copy_on_write(request, num_computed)
            if group.blocks_to_take(request, hit_blocks, total, cow) > (group.pool.num_free):
                return False
            plans.append((group, hit_blocks, cow))
        for group, hit_blocks, cow in plans:
            group.take(request, hit_blocks, num_computed, total, cow)
        request.num_computed_tokens += hit_tokens + num_loaded_tokens
        if self.enable_prefix_caching:
            # Draft tokens past the known ones are never named: only blocks full of
            # tokens the request keeps enter the cache.
            self._cache_full_blocks(request, min(total, request.num_tokens))
        return True

    def num_held_blocks(self, request: Request, group: int = GLOBAL_KV_GROUP) -> int:
        """Blocks of `group` the request holds a reference on (released ones not counted)."""
        return self.groups[group].num_held(request)

    def slot_usage(self, request: Request) -> tuple[int, int]:
        """(slots the request holds, slots of them holding K/V a later token may read),
        over every group: a group's released blocks are neither."""
        held = used = 0
        for group in self.groups:
            num_held = group.num_held(request)
            released = len(group.table(request)) - num_held
            held += num_held * self.block_size
            used += request.num_computed_tokens - released * self.block_size
        return held, used

    def rollback(self, request: Request, num_rejected: int) -> None:
        """Forget the KV of the last `num_rejected` computed tokens (rejected drafts):
        the count of computed tokens drops and the blocks past the new end go back to
        the pool. None of them was named: names cover known tokens only."""
        if num_rejected <= 0:
            return
        request.num_computed_tokens -= num_rejected
        keep = self.blocks_needed(request.num_computed_tokens)
        assert request.num_named_blocks <= keep, "a rolled-back block was named"
        for group in self.groups:
            group.truncate(request, keep)

    def num_new_blocks(self, request: Request, num_tokens: int) -> int:
        """Free blocks that computing the request up to `num_tokens` tokens would take
        (its copy-on-write included), in the group that needs the most."""
        more = max(0, self.blocks_needed(num_tokens) - len(request.block_ids))
        grows = num_tokens > request.num_computed_tokens
        cow = grows and any(
            g.needs_copy_on_write(request, request.num_computed_tokens) for g in self.groups
        )
        return more + int(cow)

    def record_prefix_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_prompt_tokens
        self.num_hit_tokens += num_hit_tokens

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        # Every token up to `num_tokens` is known (prompt or already sampled), so the
        # blocks it fills can be named now, for requests admitted later in this step to
        # share: their KV is written in this very step, and each layer writes all slots
        # before any request of the batch reads them. The names stay provisional until
        # the step has finished (commit_names). Each group names its own blocks.
        hashes = extend_block_hashes(
            request.block_hashes,
            request.all_token_ids,
            num_tokens,
            self.block_size,
            self.root(request),
        )
        num_full = num_tokens // self.block_size
        for group in self.groups:
            group.name_blocks(request, hashes, request.num_named_blocks, num_full)
        request.num_named_blocks = max(request.num_named_blocks, num_full)

    def commit_names(self) -> None:
        """The step that was to write the newly named blocks' KV has finished."""
        for group in self.groups:
            group.uncommitted.clear()

    def forget_uncommitted_names(self) -> None:
        """The step that was to write the newly named blocks' KV failed: what they hold
        is undefined, so they leave the prefix cache. Their requests must be recomputed
        (the engine requeues them), or freed."""
        for group in self.groups:
            group.pool.uncache(group.uncommitted)
            group.uncommitted.clear()

    def fork(self, parent: Request, child: Request) -> None:
        """Let `child` share all of `parent`'s blocks; writes will copy on demand."""
        for group in self.groups:
            group.fork(parent, child)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_named_blocks = parent.num_named_blocks

    def free(self, request: Request) -> None:
        for group in self.groups:
            group.free(request)
        request.num_computed_tokens = 0
        request.num_named_blocks = 0

    def reset_prefix_cache(self) -> int:
        return sum(g.pool.reset_cache() for g in self.groups)

    def take_pending_copies(self, group: int = GLOBAL_KV_GROUP) -> list[tuple[int, int]]:
        """The (src, dst) copies `group`'s pool needs before the next forward pass."""
        g = self.groups[group]
        copies, g.pending_copies = g.pending_copies, []
        return copies
