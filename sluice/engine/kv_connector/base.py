"""The KV connector interface: how KV blocks enter the pool from elsewhere and leave it.

A connector has two halves, so that the engine core never learns what is behind one:

- the *scheduler half* works on plain Python state inside `Scheduler.schedule()`: how
  many more prefix tokens of a waiting request can be loaded past its RAM prefix-cache
  hit, which pool blocks they go to once the scheduler allocated them, and what to save
  when a request finishes;
- the *worker half* touches tensors, through the runner's `read_block`/`write_block`
  only: it writes the step's loads into the pool before the forward pass, and copies the
  saved blocks out after the step (the copy may then go on in the background).

The disk tier under the prefix cache is one connector (`disk_tier.py`); prefill/decode
disaggregation is two more (`pd_prefill.py` saves a finished prompt's blocks for a
decode instance, `pd_decode.py` pulls them there). The one promise every scheduler half
keeps: it counts a token as loadable only when the worker half can put it into the pool
without failing (the disk tier reads and checks the files first), because a block the
scheduler counted is named in the prefix cache at once and may be shared in the same
step. A transfer that can arrive late or fail (a network) parks its request instead:
`is_ready` answers False while the bytes are on their way (the scheduler leaves the
request waiting, in its place, and admits others past it), and once they are here (or
the transfer failed) the request is counted with what arrived, which may be nothing.
When a step finds nothing to run while requests wait, the engine calls
`wait_for_arrivals` rather than spin. `take_transfer_params` is what a connector tells
the client about a finished request (the prefill side's transfer address).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from sluice.core.request import Request
from sluice.engine.stats import ConnectorStats


@dataclass(frozen=True)
class BlockTransfer:
    """One block moving between the RAM pool and a connector's store."""

    block_id: int  # in the RAM pool
    key: str  # the block's name in the connector's store


class BlockIO(Protocol):
    """The runner's two calls for one block's bytes (every layer's K and V), whatever the
    pool's layout or dtype."""

    def read_block(self, block: int) -> torch.Tensor: ...

    def write_block(self, block: int, data: torch.Tensor) -> None: ...


class KVConnectorScheduler(ABC):
    """The scheduler half: decisions on plain Python state, no tensors."""

    @abstractmethod
    def num_loadable_tokens(self, request: Request, num_hit_tokens: int) -> int:
        """How many prompt tokens past the first `num_hit_tokens` (the RAM hit, whole
        blocks) the connector can load: whole blocks, and never the request's last
        token, whose logits are needed. Called for a waiting request with nothing
        computed, possibly again in later steps while it cannot be admitted."""

    @abstractmethod
    def request_admitted(self, request: Request, load_blocks: list[int]) -> None:
        """The request was admitted with `load_blocks` (pool ids, in order) allocated
        for the tokens `num_loadable_tokens` promised; they count as computed and are
        loaded before this step's forward pass (`take_loads`)."""

    @abstractmethod
    def request_finished(self, request: Request) -> None:
        """The request finished or was aborted; its blocks are about to be freed. Plan
        what to save (`take_saves`); the engine saves before the pool is written again."""

    @abstractmethod
    def take_loads(self) -> list[BlockTransfer]:
        """The loads planned since the last call (for this step's worker half)."""

    @abstractmethod
    def take_saves(self) -> list[BlockTransfer]:
        """The saves planned since the last call."""

    def is_ready(self, request: Request) -> bool:
        """False parks a waiting request with nothing computed (its KV is on its way);
        asked again at every step until True. May start the transfer."""
        return True

    def wait_for_arrivals(self, timeout: float) -> None:
        """A step found nothing to run while requests wait (parked ones, perhaps):
        return when a transfer may have arrived, or after `timeout` seconds."""
        return None

    def take_transfer_params(self, request_id: str) -> dict[str, Any] | None:
        """What to hand back to the client with the finished request `request_id` (a
        prefill instance's transfer address); asked once, after `request_finished`."""
        return None

    def stats(self) -> ConnectorStats | None:
        """The connector's typed stats (sluice/engine/stats.py), None if it keeps none."""
        return None


class KVConnectorWorker(ABC):
    """The worker half: moves bytes between the pool and the connector's store."""

    @abstractmethod
    def load(self, loads: list[BlockTransfer]) -> None:
        """Write the blocks into the pool; runs before the step's forward pass."""

    @abstractmethod
    def save(self, saves: list[BlockTransfer]) -> None:
        """Take the blocks' bytes out of the pool; when this returns the pool may be
        overwritten (what happens to the bytes next may run in the background)."""

    @abstractmethod
    def discard_loads(self) -> None:
        """A step failed: forget loads staged for it."""

    @abstractmethod
    def wait_for_saves(self) -> None:
        """Block until every save handed over so far has reached its store."""

    @abstractmethod
    def close(self) -> None:
        """Finish the saves in flight and release what the worker holds."""


@dataclass
class KVConnector:
    """A connector: its two halves (one process holds both here)."""

    scheduler: KVConnectorScheduler
    worker: KVConnectorWorker

    def stats(self) -> ConnectorStats | None:
        # A connector's counts live in its scheduler half; no worker half keeps any.
        return self.scheduler.stats()

    def step_failed(self) -> None:
        """The step that was to load and save may have written anything: its staged
        loads and the saves planned during it are dropped."""
        self.scheduler.take_loads()
        self.scheduler.take_saves()
        self.worker.discard_loads()

    def close(self) -> None:
        self.worker.close()
