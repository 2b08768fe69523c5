"""The front end's side of one replica: starts it, reads its events on a thread of its
own, and starts it again when it dies (a few times, with a pause between tries).

Events go to the owner (DataParallelLLM), which keeps all request bookkeeping; this
class only knows the replica's life: starting, alive, dead, restarting, stopped.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from sluice.config import EngineConfig
from sluice.core.errors import EngineStepError
from sluice.distributed.backend import ReplicaDied, ReplicaHandle, StartReplica
from sluice.distributed.messages import Command, Event, Ready, StartFailed, Stop, Stopped

logger = logging.getLogger("sluice.distributed")

# Restarts in a row that may fail before the replica is given up.
MAX_FAILED_RESTARTS = 3
RESTART_PAUSE_S = 1.0


class ReplicaOwner(Protocol):
    def on_ready(self, replica: ReplicaClient) -> None: ...

    def on_event(self, replica: ReplicaClient, event: Event) -> None: ...

    def on_death(self, replica: ReplicaClient) -> None: ...

    def on_gave_up(self, replica: ReplicaClient) -> None: ...


class ReplicaClient:
    def __init__(
        self, index: int, config: EngineConfig, start: StartReplica, owner: ReplicaOwner
    ) -> None:
        self.index = index
        self.config = config
        self.alive = False  # set and cleared by the owner, under its lock
        self.gave_up = False
        self.pid: int | None = None
        self.max_model_len = 0
        self.restarts = 0
        self.stats: dict[str, Any] = {}
        self.start_error: BaseException | None = None
        self.first_start = threading.Event()  # ready, or failed, the first time
        self._start = start
        self._owner = owner
        self._handle: ReplicaHandle | None = None
        self._stopping = False
        self._thread = threading.Thread(
            target=self._run, name=f"sluice-replica-{index}-reader", daemon=True
        )
        self._thread.start()

    def send(self, command: Command) -> None:
        handle = self._handle
        if handle is not None:
            handle.send(command)

    def kill(self) -> None:
        """Kill the replica outright (tests, and a replica that will not stop)."""
        if self._handle is not None:
            self._handle.kill()

    def stop(self) -> None:
        """Ask the replica to abort its requests and exit; no restart after that."""
        self._stopping = True
        self.send(Stop())

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        if self._handle is not None:
            self._handle.join(timeout)

    def _run(self) -> None:
        failures = 0
        while not self._stopping:
            try:
                self._serve(self._start(self.index, self.config))
                return  # stopped on request
            except ReplicaDied as exc:
                failures = 0 if self.alive else failures + 1
                error: BaseException = exc
            except Exception as exc:  # it failed to start
                failures += 1
                error = exc
            self._owner.on_death(self)
            if self._handle is not None:
                self._handle.join(1.0)
            if not self.first_start.is_set():
                self.start_error = error
                self.first_start.set()
                return
            if self._stopping or failures > MAX_FAILED_RESTARTS:
                break
            logger.warning("replica %d is gone (%s); restarting it", self.index, error)
            self.restarts += 1
            time.sleep(RESTART_PAUSE_S * failures)
        if not self._stopping:
            logger.error("replica %d failed to restart %d times; giving up", self.index, failures)
        self.gave_up = True
        self._owner.on_gave_up(self)

    def _serve(self, handle: ReplicaHandle) -> None:
        """Read one incarnation's events until it stops (return) or dies (ReplicaDied)."""
        self._handle = handle
        first = handle.receive()
        if isinstance(first, StartFailed):
            raise first.error
        if not isinstance(first, Ready):
            raise EngineStepError(f"replica {self.index} said {first!r} before Ready")
        self.pid, self.max_model_len, self.stats = first.pid, first.max_model_len, first.stats
        logger.info("replica %d is ready (pid %d)", self.index, first.pid)
        self._owner.on_ready(self)
        self.first_start.set()
        if self._stopping:
            handle.send(Stop())
        while True:
            event = handle.receive()
            if isinstance(event, Stopped):
                return
            self._owner.on_event(self, event)
