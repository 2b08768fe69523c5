"""Block pool and KV cache manager: ref counts, LRU eviction, prefix hits, copy-on-write."""

from __future__ import annotations

from sluice.config import LOCAL_KV_GROUP
from sluice.core.request import Request
from sluice.engine.kv_cache import NO_BLOCK, BlockPool, KVCacheManager
from sluice.sampling_params import SamplingParams


def make_request(ids: list[int], rid: str = "r") -> Request:
    return Request(rid, list(ids), SamplingParams(max_tokens=8))


def test_pool_allocates_and_frees_everything() -> None:
    pool = BlockPool(8, enable_caching=True)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert pool.num_free == 0 and len(set(a + b)) == 8
    pool.free(a)
    pool.free(b)
    assert pool.num_free == 8


def test_eviction_is_least_recently_freed_first() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        pool.cache_block(b, 100 + i)
    # Free in the order 2, 0, 3, 1: reuse must follow that order.
    for b in (blocks[2], blocks[0], blocks[3], blocks[1]):
        pool.free([b])
    assert pool.allocate(1) == [blocks[2]]
    assert pool.lookup(102) is None  # evicted
    assert pool.lookup(100) == blocks[0]  # still cached
    # Touching a cached free block revives it: it is no longer evictable.
    pool.touch([blocks[0]])
    assert pool.allocate(2) == [blocks[3], blocks[1]]
    assert pool.num_free == 0
    assert pool.lookup(100) == blocks[0]


def test_blocks_in_use_are_never_evicted() -> None:
    pool = BlockPool(3, enable_caching=True)
    held = pool.allocate(1)
    pool.cache_block(held[0], 7)
    other = pool.allocate(2)
    pool.free(other)
    pool.allocate(2)
    assert pool.lookup(7) == held[0] and pool.ref_counts[held[0]] == 1


def test_prefix_hit_counts_full_blocks_and_leaves_last_token() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    first = make_request(list(range(10)), "a")
    assert kv.allocate_slots(first, 10)
    first.num_computed_tokens = 10
    # Same first 9 tokens: two full blocks (8 tokens) hit.
    second = make_request([*range(9), 99], "b")
    hit = kv.find_cached_prefix(second)
    assert hit.num_tokens == 8 and hit.blocks == first.block_ids[:2]
    # A prompt that is entirely cached still computes its last token.
    third = make_request(list(range(8)), "c")
    assert kv.find_cached_prefix(third).num_tokens == 4
    assert kv.allocate_slots(second, 2, hit)
    assert second.num_computed_tokens == 8
    assert kv.pool.ref_counts[first.block_ids[0]] == 2
    kv.free(first)
    kv.free(second)
    assert kv.num_free_blocks == 16


def test_failed_allocation_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    r = make_request(list(range(12)))
    assert not kv.allocate_slots(r, 12)
    assert r.block_ids == [] and kv.num_free_blocks == 2


def test_fork_shares_blocks_and_copies_partial_block_on_write() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    parent = make_request(list(range(6)), "p")
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = make_request(list(range(6)), "c")
    kv.fork(parent, child)
    assert child.block_ids == parent.block_ids
    parent.append_token(1)
    child.append_token(2)
    # The child writes position 6, inside the shared partial block: it gets a copy.
    assert kv.allocate_slots(child, 1)
    assert child.block_ids[0] == parent.block_ids[0]  # full block still shared
    assert child.block_ids[1] != parent.block_ids[1]
    assert kv.take_pending_copies() == [(parent.block_ids[1], child.block_ids[1])]
    # The parent is now the only owner of its partial block: no copy needed.
    assert kv.allocate_slots(parent, 1)
    assert kv.take_pending_copies() == []
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 8


def test_names_are_provisional_until_the_step_commits() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    first = make_request(list(range(10)), "a")
    assert kv.allocate_slots(first, 10)
    # Within the step, a request admitted after `first` shares its blocks already.
    assert kv.find_cached_prefix(make_request(list(range(9)), "b")).num_tokens == 8
    # The step failed: its blocks leave the cache, though `first` still holds them.
    kv.forget_uncommitted_names()
    assert kv.find_cached_prefix(make_request(list(range(9)), "c")).num_tokens == 0
    assert kv.pool.ref_counts[first.block_ids[0]] == 1 and not kv.pool.cached
    kv.free(first)

    second = make_request(list(range(10)), "d")
    assert kv.allocate_slots(second, 10)
    kv.commit_names()
    kv.forget_uncommitted_names()  # a later failed step cannot touch committed names
    kv.free(second)
    assert kv.find_cached_prefix(make_request(list(range(9)), "e")).num_tokens == 8
    assert kv.num_free_blocks == 8


def test_window_releases_blocks_no_later_token_can_see() -> None:
    # Window 6, blocks of 4: computing from position p sees p - 5 on, so block b is
    # dead once 4 * (b + 1) <= p - 5.
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True, window=6)
    r = make_request(list(range(30)))
    assert kv.allocate_slots(r, 13)  # a 13-token chunk: blocks 0-3
    r.num_computed_tokens = 13
    full = list(r.block_ids)
    assert kv.allocate_slots(r, 1)  # position 13 sees 8 on: blocks 0 and 1 go
    assert r.block_ids[:2] == [NO_BLOCK, NO_BLOCK] and r.block_ids[2:] == full[2:]
    assert kv.num_free_blocks == 8 - 2 and kv.num_held_blocks(r) == 2
    # Released blocks keep their names: evictable, still found by a prefix lookup.
    other = make_request([*range(8), 99])
    hit = kv.find_cached_prefix(other)
    assert hit.blocks == full[:2]
    r.num_computed_tokens = 14
    assert kv.allocate_slots(r, 15)  # positions 14-28: blocks 4-7 (14 sees 9 on: none go)
    assert kv.num_held_blocks(r) == 6
    r.num_computed_tokens = 29
    assert kv.allocate_slots(r, 1)  # position 29 sees 24 on: blocks 0-5 dead
    assert r.block_ids[:6] == [NO_BLOCK] * 6 and kv.num_held_blocks(r) == 2
    kv.free(r)
    assert kv.num_free_blocks == 8


def test_no_window_keeps_every_block() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    r = make_request(list(range(30)))
    assert kv.allocate_slots(r, 20)
    r.num_computed_tokens = 20
    assert kv.allocate_slots(r, 1)
    assert NO_BLOCK not in r.block_ids and kv.num_held_blocks(r) == 6


# ---- a split cache: a global pool and a local pool for the windowed layers ----------


def split_manager(local_num_blocks: int = 8) -> KVCacheManager:
    # Window 6, blocks of 4 (as above), for the local group only.
    return KVCacheManager(
        num_blocks=16,
        block_size=4,
        enable_prefix_caching=True,
        local_num_blocks=local_num_blocks,
        local_window=6,
    )


def assert_all_free(kv: KVCacheManager) -> None:
    for group in kv.groups:
        assert group.pool.num_free == group.pool.num_blocks
        assert all(c == 0 for c in group.pool.ref_counts)


def test_split_cache_releases_only_the_local_blocks() -> None:
    kv = split_manager()
    r = make_request(list(range(30)))
    assert kv.allocate_slots(r, 13)
    r.num_computed_tokens = 13
    assert kv.allocate_slots(r, 1)  # position 13 sees 8 on: local blocks 0 and 1 go
    assert NO_BLOCK not in r.block_ids and len(r.block_ids) == len(r.local_block_ids) == 4
    assert r.local_block_ids[:2] == [NO_BLOCK, NO_BLOCK] and NO_BLOCK not in r.local_block_ids[2:]
    assert kv.num_held_blocks(r) == 4 and kv.num_held_blocks(r, LOCAL_KV_GROUP) == 2
    assert kv.local_pool is not None and kv.local_pool.num_free == 8 - 2
    assert kv.slot_usage(r) == (6 * 4, 13 + 13 - 2 * 4)
    kv.free(r)
    assert_all_free(kv)


def test_split_cache_allocates_from_both_pools_or_neither() -> None:
    kv = split_manager(local_num_blocks=3)
    r = make_request(list(range(30)))
    assert not kv.allocate_slots(r, 13)  # 4 blocks: the global pool has them, the local not
    assert r.block_ids == [] and r.local_block_ids == [] and r.num_computed_tokens == 0
    assert_all_free(kv)
    assert kv.allocate_slots(r, 12)
    assert kv.num_free_blocks == 0  # the fuller group's count
    kv.free(r)
    assert_all_free(kv)


def test_split_prefix_hit_needs_only_the_last_window_locally() -> None:
    kv = split_manager()
    first = make_request(list(range(21)), "a")
    assert kv.allocate_slots(first, 21)  # 5 full blocks named in both pools
    first.num_computed_tokens = 21
    global_ids, local_ids = list(first.block_ids), list(first.local_block_ids)
    kv.free(first)
    second = make_request([*range(20), 99, 98], "b")
    hit = kv.find_cached_prefix(second)
    # Position 20 sees 15 on: the local group serves blocks 3 and 4 only.
    assert hit.num_tokens == 20 and hit.blocks == global_ids[:5]
    assert hit.local_blocks == [NO_BLOCK] * 3 + local_ids[3:5]
    # Blocks before the window may be gone from the local pool; one inside it may not.
    assert kv.local_pool is not None
    kv.local_pool.uncache([local_ids[1], local_ids[4]])
    hit = kv.find_cached_prefix(second)  # 16 tokens: position 16 sees 11 on (blocks 2, 3)
    assert hit.num_tokens == 16 and hit.blocks == global_ids[:4]
    assert hit.local_blocks == [NO_BLOCK] * 2 + local_ids[2:4]
    assert kv.allocate_slots(second, 22 - 16, hit)
    assert second.num_computed_tokens == 16
    assert second.block_ids[:4] == global_ids[:4] and second.local_block_ids[:4] == hit.local_blocks
    assert len(second.block_ids) == len(second.local_block_ids) == 6
    # Now blocks 1, 2 and 4 of that prefix are missing locally: only a one-block hit
    # (position 4 sees 0 on) has its whole window.
    kv.local_pool.uncache([local_ids[2], second.local_block_ids[4]])
    assert kv.find_cached_prefix(make_request([*range(20), 5], "c")).num_tokens == 4
    kv.free(second)
    assert_all_free(kv)


def test_split_cache_forks_copy_on_write_and_rolls_back_in_both_pools() -> None:
    kv = split_manager()
    parent = make_request(list(range(6)), "p")
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = make_request(list(range(6)), "c")
    kv.fork(parent, child)
    assert child.local_block_ids == parent.local_block_ids
    assert kv.allocate_slots(child, 1)  # the shared partial block is copied in each pool
    assert kv.take_pending_copies() == [(parent.block_ids[1], child.block_ids[1])]
    assert kv.take_pending_copies(LOCAL_KV_GROUP) == [
        (parent.local_block_ids[1], child.local_block_ids[1])
    ]
    # Drafts: 6 more tokens computed, 5 of them rejected.
    assert kv.allocate_slots(parent, 7)
    parent.num_computed_tokens = 13
    assert len(parent.block_ids) == len(parent.local_block_ids) == 4
    kv.rollback(parent, 5)
    assert len(parent.block_ids) == len(parent.local_block_ids) == 2
    kv.free(parent)
    kv.free(child)
    assert_all_free(kv)
