"""Which replica takes a request: the one that already holds the longest prefix of its
prompt, unless that one is much busier than the least loaded (then the least loaded).

The router cannot see the replicas' caches, so it remembers what it sent where: for
each replica, the hash chain of the full prompt blocks it was sent (the same chain as
sluice/engine/prefix_cache.py, over the token ids the front end already has), in LRU
order and capped at the replica's KV capacity in blocks, roughly what its prefix cache
can hold. That is SGLang's cache-aware routing with a hash chain in place of a radix
tree; a replica that dies forgets everything.

A request for a LoRA adapter chains its blocks from a root of the adapter's own (as the
engine's prefix cache does: adapters never share KV), and the router remembers the last
`max_loras` adapters it sent each replica (roughly what its slots hold): among replicas
holding as much of the prompt, one holding the adapter wins, so an adapter's requests
gather where its weights are loaded and its prefixes cached, within the same balance.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from sluice.engine.prefix_cache import ROOT_HASH, extend_block_hashes

# A replica holding the prefix is chosen while its load (requests in flight) is at most
# this many above the least loaded one: beyond, queueing costs more than recomputing.
DEFAULT_BALANCE_THRESHOLD = 8


@dataclass
class RouteCounts:
    """What the router did for one replica (since start)."""

    routed: int = 0
    # Of those, sent here because this replica held part of the prompt or its adapter.
    routed_by_prefix: int = 0


class Router:
    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        *,
        capacity_blocks: int = 1 << 16,
        balance_threshold: int = DEFAULT_BALANCE_THRESHOLD,
        cache_aware: bool = True,
        max_loras: int = 4,
    ) -> None:
        self.block_size = block_size
        self.max_loras = max_loras
        self.capacity_blocks = [capacity_blocks] * num_replicas
        self.balance_threshold = balance_threshold
        self.cache_aware = cache_aware
        self._blocks: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._adapters: list[OrderedDict[str, None]] = [OrderedDict() for _ in range(num_replicas)]
        self.counts = [RouteCounts() for _ in range(num_replicas)]
        self._turn = itertools.count()  # breaks ties between equally loaded replicas

    def choose(
        self,
        prompt: Sequence[int],
        loads: Sequence[int],
        alive: Sequence[bool],
        adapter: str | None = None,
    ) -> int:
        """The replica for `prompt` (for the LoRA adapter named `adapter`, or the base),
        given each replica's requests in flight; records the prompt's blocks and the
        adapter as held there. Needs one alive replica."""
        candidates = [i for i, up in enumerate(alive) if up]
        if not candidates:
            raise ValueError("no replica is alive")
        root = ROOT_HASH if adapter is None else hash((ROOT_HASH, "lora", adapter))
        hashes = extend_block_hashes([], prompt, len(prompt), self.block_size, root)
        least = min(loads[i] for i in candidates)
        matched = {i: self._matched(i, hashes) for i in candidates} if self.cache_aware else {}
        holds = {i: adapter in self._adapters[i] for i in candidates} if adapter else {}
        best = max(candidates, key=lambda i: (matched.get(i, 0), holds.get(i, False), -loads[i]))
        held = matched.get(best, 0) > 0 or holds.get(best, False)
        by_prefix = held and loads[best] <= least + self.balance_threshold
        if not by_prefix:
            idle = [i for i in candidates if loads[i] == least]
            best = idle[next(self._turn) % len(idle)]
        self._remember(best, hashes, adapter)
        self.counts[best].routed += 1
        self.counts[best].routed_by_prefix += int(by_prefix)
        return best

    def forget(self, replica: int) -> None:
        """The replica lost its cache and slots (it died and restarts empty)."""
        self._blocks[replica].clear()
        self._adapters[replica].clear()

    def _matched(self, replica: int, hashes: list[int]) -> int:
        held = self._blocks[replica]
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def _remember(self, replica: int, hashes: list[int], adapter: str | None) -> None:
        held = self._blocks[replica]
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity_blocks[replica]:
            held.popitem(last=False)
        if adapter is not None:
            adapters = self._adapters[replica]
            adapters[adapter] = None
            adapters.move_to_end(adapter)
            while len(adapters) > self.max_loras:
                adapters.popitem(last=False)
