"""The prefill instance's side of a prefill/decode split, as a KV connector.

A request that asks for it (`kv_transfer_params={"do_remote_decode": true}`; a proxy
sends it with max_tokens=1) runs as usual. When it finishes, the scheduler half plans
to save its prompt's whole blocks (all but the block of the last prompt token when the
prompt fills its blocks exactly: the decode side computes that token itself) under a
fresh transfer id, and the worker half copies them out of the pool into the block
server right after the step, before the pool can be written again. The engine then
frees the pool blocks as for any finished request; what waits for the decode instance
is the copy, until it confirms, breaks off, or the timeout passes (`pd_transport.py`).
The response carries the transfer's address (`take_transfer_params`).

Copying rather than pinning the pool blocks costs a memcpy per block (about 0.1 ms for
SmolLM2's 0.7 MB in fp32), but a decode instance that is slow or gone can never take
the prefill instance's KV pool, and so its throughput, with it.
"""

from __future__ import annotations

import socket
import uuid
from typing import Any

from sluice.core.kv_transfer import wants_remote_decode
from sluice.core.request import Request, RequestStatus
from sluice.engine.kv_cache import NO_BLOCK
from sluice.engine.kv_connector.base import (
    BlockIO,
    BlockTransfer,
    KVConnector,
    KVConnectorScheduler,
    KVConnectorWorker,
)
from sluice.engine.kv_connector.disk_store import BlockFormat
from sluice.engine.kv_connector.pd_transport import BlockServer
from sluice.engine.stats import PDPrefillStats


def _advertised_host(host: str) -> str:
    """The address a decode instance can reach us at: a wildcard bind is no address."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


class PrefillScheduler(KVConnectorScheduler):
    def __init__(self, server: BlockServer, block_size: int) -> None:
        self.server = server
        self.block_size = block_size
        self.host = _advertised_host(server.host)
        self._saves: list[BlockTransfer] = []
        self._params: dict[str, dict[str, Any]] = {}  # request id -> its transfer

    def num_loadable_tokens(self, request: Request, num_hit_tokens: int) -> int:
        return 0

    def request_admitted(self, request: Request, load_blocks: list[int]) -> None:
        pass

    def request_finished(self, request: Request) -> None:
        params = request.sampling_params.kv_transfer_params
        if request.status == RequestStatus.FINISHED_ABORTED or not wants_remote_decode(params):
            return
        if request.index != 0:  # an n > 1 request's forks share the first one's prompt
            return
        # The decode side loads whole prompt blocks short of the last prompt token,
        # and only blocks this instance has computed.
        last = request.num_prompt_tokens - 1
        n = min(last, request.num_computed_tokens) // self.block_size
        blocks = request.block_ids[:n]
        if NO_BLOCK in blocks:  # a sliding window released some: send nothing
            return
        tid = f"{request.request_id}-{uuid.uuid4().hex[:12]}"
        ids = request.prompt_token_ids[: n * self.block_size]
        if not self.server.reserve(tid, ids, n):
            return  # no room: the decode instance computes the prompt itself
        self._saves.extend(BlockTransfer(b, f"{tid}/{i}") for i, b in enumerate(blocks))
        self._params[request.request_id] = {
            "do_remote_prefill": True,
            "remote_host": self.host,
            "remote_port": self.server.port,
            "transfer_id": tid,
            "num_blocks": n,
        }

    def take_loads(self) -> list[BlockTransfer]:
        return []

    def take_saves(self) -> list[BlockTransfer]:
        saves, self._saves = self._saves, []
        return saves

    def take_transfer_params(self, request_id: str) -> dict[str, Any] | None:
        return self._params.pop(request_id, None)

    def stats(self) -> PDPrefillStats:
        return self.server.stats()


class PrefillWorker(KVConnectorWorker):
    def __init__(self, server: BlockServer, blocks: BlockIO) -> None:
        self.server = server
        self.blocks = blocks

    def load(self, loads: list[BlockTransfer]) -> None:
        assert not loads, "a prefill instance loads nothing"

    def save(self, saves: list[BlockTransfer]) -> None:
        for t in saves:
            tid, index = t.key.rsplit("/", 1)
            self.server.put(tid, int(index), self.blocks.read_block(t.block_id).cpu())

    def discard_loads(self) -> None:
        pass

    def wait_for_saves(self) -> None:
        pass  # save() copies synchronously

    def close(self) -> None:
        self.server.close()


def pd_prefill_connector(
    fmt: BlockFormat, blocks: BlockIO, host: str, port: int, timeout: float
) -> KVConnector:
    """A prefill instance's connector, its block server listening on host:port."""
    server = BlockServer(host, port, fmt, timeout)
    return KVConnector(PrefillScheduler(server, fmt.block_size), PrefillWorker(server, blocks))
