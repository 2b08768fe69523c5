"""The decode instance's side of a prefill/decode split, as a KV connector.

A request whose `kv_transfer_params` name a prefill instance's transfer is parked when
the scheduler first looks at it (`is_ready` is False) while a thread pulls the blocks
(`pd_transport.fetch_blocks`), checks that they hold this prompt's tokens, and confirms
to the prefill side, which then frees its copy. Once the pull is over the request is
scheduled like any other: the blocks past its RAM prefix-cache hit count as loaded
(whole blocks, never the last prompt token), and the worker half writes them into
their pool blocks before the step's forward pass. So the decode instance computes at
most one block of the prompt: the tokens after the last whole block, at least the last.

A pull that fails (the prefill instance is gone, the transfer expired, another model
or dtype, other tokens) is logged and counted, and the request computes its prompt
here: slower, but the client gets its answer, and the same answer.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from sluice.core.kv_transfer import RemotePrefill, remote_prefill
from sluice.core.request import Request
from sluice.engine.kv_connector.base import (
    BlockIO,
    BlockTransfer,
    KVConnector,
    KVConnectorScheduler,
    KVConnectorWorker,
)
from sluice.engine.kv_connector.disk_store import BlockFormat
from sluice.engine.kv_connector.pd_transport import TransferError, fetch_blocks
from sluice.engine.stats import PDDecodeStats

logger = logging.getLogger("sluice")


@dataclass
class _Pull:
    """One request's transfer; `done` is set last, by the pulling thread."""

    done: bool = False
    data: bytearray | None = None  # the blocks back to back; None once staged or failed
    num_blocks: int = 0


@dataclass
class DecodeCounters:
    pulled_transfers: int = 0
    failed_transfers: int = 0
    loaded_blocks: int = 0
    bytes_pulled: int = 0
    pull_seconds: float = 0.0


class DecodeScheduler(KVConnectorScheduler):
    def __init__(
        self, fmt: BlockFormat, timeout: float, staged: dict[int, torch.Tensor], threads: int = 8
    ) -> None:
        self.format = fmt
        self.block_size = fmt.block_size
        self.timeout = timeout
        self.counters = DecodeCounters()
        self._staged = staged  # pool block id -> bytes, for the worker half
        self._pulls: dict[str, _Pull] = {}  # request id -> its transfer
        self._loads: list[BlockTransfer] = []
        self._arrived = threading.Event()
        self._lock = threading.Lock()  # the counters, written by the pulling threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="sluice-kv-pull")

    def is_ready(self, request: Request) -> bool:
        pull = self._pulls.get(request.request_id)
        if pull is not None:
            return pull.done
        remote = remote_prefill(request.sampling_params.kv_transfer_params)
        if remote is None:
            return True
        pull = self._pulls[request.request_id] = _Pull()
        self._pool.submit(self._pull, pull, remote, request.prompt_token_ids)
        return False

    def _pull(self, pull: _Pull, remote: RemotePrefill, prompt: list[int]) -> None:
        t0 = time.perf_counter()
        try:
            ids, data, n = fetch_blocks(
                remote.host, remote.port, remote.transfer_id, self.format, self.timeout
            )
            if ids != prompt[: n * self.block_size]:
                raise TransferError("the blocks hold other tokens than this prompt")
            pull.data, pull.num_blocks = data, n
            with self._lock:
                self.counters.pulled_transfers += 1
                self.counters.bytes_pulled += len(data)
                self.counters.pull_seconds += time.perf_counter() - t0
        except Exception as exc:  # any failure means: compute the prompt here
            logger.warning(
                "KV transfer %s failed (%s); computing the prompt here", remote.transfer_id, exc
            )
            with self._lock:
                self.counters.failed_transfers += 1
        finally:
            pull.done = True
            self._arrived.set()

    def wait_for_arrivals(self, timeout: float) -> None:
        self._arrived.wait(timeout)
        self._arrived.clear()

    def num_loadable_tokens(self, request: Request, num_hit_tokens: int) -> int:
        pull = self._pulls.get(request.request_id)
        if pull is None or pull.data is None:
            return 0
        first = num_hit_tokens // self.block_size
        last = min((request.num_tokens - 1) // self.block_size, pull.num_blocks)
        return max(0, last - first) * self.block_size

    def request_admitted(self, request: Request, load_blocks: list[int]) -> None:
        pull = self._pulls.get(request.request_id)
        if pull is None or pull.data is None:
            return
        data, pull.data = pull.data, None  # a preempted request finds them in RAM's cache
        first = request.num_computed_tokens // self.block_size - len(load_blocks)
        nbytes = self.format.nbytes
        for j, block in enumerate(load_blocks):
            off = (first + j) * nbytes
            self._staged[block] = torch.frombuffer(
                data, dtype=torch.uint8, count=nbytes, offset=off
            )
            self._loads.append(BlockTransfer(block, f"{request.request_id}/{first + j}"))
        self.counters.loaded_blocks += len(load_blocks)

    def request_finished(self, request: Request) -> None:
        # A pull still running for an aborted request ends on its own; its prefill side
        # is confirmed (and frees) all the same.
        self._pulls.pop(request.request_id, None)

    def take_loads(self) -> list[BlockTransfer]:
        loads, self._loads = self._loads, []
        return loads

    def take_saves(self) -> list[BlockTransfer]:
        return []

    def stats(self) -> PDDecodeStats:
        c = self.counters
        return PDDecodeStats(
            pd_pending_pulls=sum(1 for p in self._pulls.values() if not p.done),
            pd_pulled_transfers=c.pulled_transfers,
            pd_failed_transfers=c.failed_transfers,
            pd_loaded_blocks=c.loaded_blocks,
            pd_loaded_tokens=c.loaded_blocks * self.block_size,
            pd_bytes_pulled=c.bytes_pulled,
            pd_pull_seconds=c.pull_seconds,
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class DecodeWorker(KVConnectorWorker):
    def __init__(
        self, scheduler: DecodeScheduler, blocks: BlockIO, staged: dict[int, torch.Tensor]
    ) -> None:
        self.scheduler = scheduler
        self.blocks = blocks
        self._staged = staged

    def load(self, loads: list[BlockTransfer]) -> None:
        for t in loads:
            self.blocks.write_block(t.block_id, self._staged.pop(t.block_id))

    def save(self, saves: list[BlockTransfer]) -> None:
        assert not saves, "a decode instance saves nothing"

    def discard_loads(self) -> None:
        self._staged.clear()

    def wait_for_saves(self) -> None:
        pass

    def close(self) -> None:
        self.scheduler.close()


def pd_decode_connector(fmt: BlockFormat, timeout: float, blocks: BlockIO) -> KVConnector:
    """A decode instance's connector: pulls, then loads, what prefill instances hold."""
    staged: dict[int, torch.Tensor] = {}
    scheduler = DecodeScheduler(fmt, timeout, staged)
    return KVConnector(scheduler, DecodeWorker(scheduler, blocks, staged))
