"""The front end's handle on one replica, whatever runs it (a process, a Ray actor)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from sluice.config import EngineConfig
from sluice.distributed.messages import Command, Event


class ReplicaDied(Exception):
    """The replica's process or actor is gone (its transport broke)."""


class ReplicaHandle(Protocol):
    def send(self, command: Command) -> None:
        """Queue a command; never raises (a dead replica is noticed by `receive`)."""
        ...

    def receive(self) -> Event:
        """The next event, waiting for it; raises ReplicaDied when the replica is gone."""
        ...

    def kill(self) -> None: ...

    def join(self, timeout: float) -> None:
        """Wait for the replica to exit after Stop (then kill it)."""
        ...


StartReplica = Callable[[int, EngineConfig], ReplicaHandle]
