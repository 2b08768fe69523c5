"""The disk tier under the prefix cache, as a KV connector.

Saving: when a request finishes (or is aborted), every full block of its known tokens
that is not on disk yet is copied out of the pool (the worker half, on the engine
thread, before the pool can be written again) and written by the store's thread. We
save at finish rather than at eviction from RAM: a block that is never evicted, like a
long system prompt that stays hot, is then on disk too and a restart finds it warm, and
a block is written once (the index dedupes), not once per eviction.

Loading: for a waiting request, the blocks past its RAM prefix-cache hit are looked up
by key; the scheduler half reads and checks each file at once (stopping at the first
miss or bad file) and counts only blocks it holds, so a load can never fail after the
scheduler counted it; the worker half copies them into their pool blocks before the
forward pass.

Keys are our own hash chain, not the prefix cache's: Python's `hash` of a string
changes between processes, and 64 bits are too few for a store that lives for months.
A block's key is blake2b-128 of (its parent's key, its token ids), the chain rooted in
the block format, so another model, weight format, dtype, KV dtype or block size never
shares a key.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from dataclasses import asdict
from pathlib import Path

import torch

from sluice.core.request import Request
from sluice.engine.kv_cache import NO_BLOCK
from sluice.engine.kv_connector.base import (
    BlockIO,
    BlockTransfer,
    KVConnector,
    KVConnectorScheduler,
    KVConnectorWorker,
)
from sluice.engine.kv_connector.disk_store import BlockFormat, DiskStore
from sluice.engine.stats import DiskTierStats, ratio


def model_fingerprint(path: Path) -> str:
    """A cheap identity of the weights: each file's name, size, first and last MiB."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    h = hashlib.blake2b(digest_size=16)
    for file in files:
        size = file.stat().st_size
        h.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            h.update(f.read(2**20))
            f.seek(max(0, size - 2**20))
            h.update(f.read(2**20))
    return h.hexdigest()


def block_keys(
    root: bytes, token_ids: list[int], num_blocks: int, block_size: int, keys: list[str]
) -> list[str]:
    """Extend `keys` (the chain of a request's first len(keys) blocks) to `num_blocks`."""
    for i in range(len(keys), num_blocks):
        parent = bytes.fromhex(keys[-1]) if keys else root
        tokens = array("q", token_ids[i * block_size : (i + 1) * block_size]).tobytes()
        keys.append(hashlib.blake2b(parent + tokens, digest_size=16).hexdigest())
    return keys


class DiskTierScheduler(KVConnectorScheduler):
    def __init__(self, store: DiskStore, block_size: int, staged: dict[int, bytearray]) -> None:
        self.store = store
        self.block_size = block_size
        self._root = hashlib.blake2b(
            json.dumps(asdict(store.format), sort_keys=True).encode(), digest_size=16
        ).digest()
        self._keys: dict[str, list[str]] = {}  # request id -> its key chain
        # Payloads read for a waiting request, by block index, until it is admitted.
        self._read: dict[str, dict[int, bytearray]] = {}
        self._staged = staged  # pool block id -> payload, for the worker half
        self._loads: list[BlockTransfer] = []
        self._saves: list[BlockTransfer] = []
        self.num_queried_blocks = 0
        self.num_loaded_blocks = 0

    def _chain(self, request: Request, num_blocks: int) -> list[str]:
        keys = self._keys.setdefault(request.request_id, [])
        return block_keys(self._root, request.all_token_ids, num_blocks, self.block_size, keys)

    def num_loadable_tokens(self, request: Request, num_hit_tokens: int) -> int:
        first = num_hit_tokens // self.block_size
        last = (request.num_tokens - 1) // self.block_size  # the last token is computed
        keys = self._chain(request, last)
        read = self._read.setdefault(request.request_id, {})
        n = 0
        for i in range(first, last):
            if i not in read:
                payload = self.store.read(keys[i])
                if payload is None:
                    break
                read[i] = payload
            n += 1
        return n * self.block_size

    def request_admitted(self, request: Request, load_blocks: list[int]) -> None:
        read = self._read.pop(request.request_id, {})
        keys = self._keys[request.request_id]
        first = request.num_computed_tokens // self.block_size - len(load_blocks)
        for j, block in enumerate(load_blocks):
            self._staged[block] = read[first + j]
            self._loads.append(BlockTransfer(block, keys[first + j]))
        last = (request.num_tokens - 1) // self.block_size
        self.num_queried_blocks += max(0, last - first)
        self.num_loaded_blocks += len(load_blocks)

    def request_finished(self, request: Request) -> None:
        self._read.pop(request.request_id, None)
        # Named blocks hold KV that a finished step wrote for known tokens (never for
        # draft tokens), which is what may be reused.
        num = min(request.num_named_blocks, len(request.block_ids))
        keys = self._chain(request, num)
        del self._keys[request.request_id]
        for i in range(num):
            block = request.block_ids[i]
            if block != NO_BLOCK and not self.store.contains(keys[i]):
                self._saves.append(BlockTransfer(block, keys[i]))

    def take_loads(self) -> list[BlockTransfer]:
        loads, self._loads = self._loads, []
        return loads

    def take_saves(self) -> list[BlockTransfer]:
        saves, self._saves = self._saves, []
        return saves

    def stats(self) -> DiskTierStats:
        c = self.store.counters
        return DiskTierStats(
            kv_offload_queried_blocks=self.num_queried_blocks,
            kv_offload_hit_blocks=self.num_loaded_blocks,
            kv_offload_miss_blocks=self.num_queried_blocks - self.num_loaded_blocks,
            kv_offload_hit_rate=ratio(self.num_loaded_blocks, self.num_queried_blocks),
            kv_offload_loaded_tokens=self.num_loaded_blocks * self.block_size,
            kv_offload_files=self.store.num_files,
            kv_offload_disk_bytes=self.store.num_bytes,
            kv_offload_bytes_read=c.bytes_read,
            kv_offload_bytes_written=c.bytes_written,
            kv_offload_files_written=c.files_written,
            kv_offload_files_evicted=c.files_evicted,
            kv_offload_corrupt_files=c.corrupt_files,
            kv_offload_write_errors=c.write_errors,
            kv_offload_saves_dropped=c.saves_dropped,
        )


class DiskTierWorker(KVConnectorWorker):
    def __init__(self, store: DiskStore, blocks: BlockIO, staged: dict[int, bytearray]) -> None:
        self.store = store
        self.blocks = blocks
        self._staged = staged

    def load(self, loads: list[BlockTransfer]) -> None:
        for t in loads:
            payload = self._staged.pop(t.block_id)
            self.blocks.write_block(t.block_id, torch.frombuffer(payload, dtype=torch.uint8))

    def save(self, saves: list[BlockTransfer]) -> None:
        for t in saves:
            self.store.put(t.key, self.blocks.read_block(t.block_id))

    def discard_loads(self) -> None:
        self._staged.clear()

    def wait_for_saves(self) -> None:
        self.store.flush()

    def close(self) -> None:
        self.store.close()


def disk_tier(directory: Path, max_bytes: int, fmt: BlockFormat, blocks: BlockIO) -> KVConnector:
    """The disk tier's two halves over one store."""
    store = DiskStore(directory, max_bytes, fmt)
    staged: dict[int, bytearray] = {}
    return KVConnector(
        DiskTierScheduler(store, fmt.block_size, staged), DiskTierWorker(store, blocks, staged)
    )
