"""Replicas as Ray actors, placed by Ray on any node of its cluster (`ray start --head`
on one machine, `ray start --address=...` on the others; `sluice serve` then joins the
cluster, or starts a local one when there is none).

The actor runs the same replica loop as a process would, on a thread of its own; its
channel is two in-actor queues. The front end pushes commands with `submit` and pulls
events with a long-polling `poll`. A threaded actor may run calls out of order, so
commands carry a sequence number and the actor puts them back in order.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
from typing import Any

import ray
from ray.exceptions import RayError

from sluice.config import EngineConfig
from sluice.distributed.backend import ReplicaDied, ReplicaHandle
from sluice.distributed.messages import Command, Event
from sluice.distributed.replica import run_replica

POLL_S = 1.0


class ReplicaActor:
    """The actor's body (wrapped by ray.remote below)."""

    def __init__(self, config: EngineConfig) -> None:
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._order = threading.Lock()
        self._next = 0
        self._early: dict[int, Command] = {}
        self._loop = threading.Thread(target=run_replica, args=(config, self), daemon=True)
        self._loop.start()

    def pid(self) -> int:
        return os.getpid()

    def submit(self, seq: int, command: Command) -> None:
        with self._order:
            self._early[seq] = command
            while self._next in self._early:
                self._commands.put(self._early.pop(self._next))
                self._next += 1

    def poll(self, timeout: float) -> list[Event]:
        try:
            events = [self._events.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                return events

    # The replica loop's channel.
    def receive(self, timeout: float | None) -> list[Command]:
        try:
            commands = [self._commands.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def send(self, event: Event) -> None:
        self._events.put(event)


_RemoteActor: Any = ray.remote(ReplicaActor)


_init_lock = threading.Lock()


def connect() -> None:
    """Join the cluster RAY_ADDRESS or `ray start` names, else start a local one; once,
    whichever thread asks first."""
    with _init_lock:
        if not ray.is_initialized():
            ray.init(log_to_driver=False)


class RayReplica:
    def __init__(self, index: int, config: EngineConfig) -> None:
        connect()
        self.actor = _RemoteActor.options(
            name=None, num_cpus=config.threads(), max_concurrency=4
        ).remote(config)
        self._seq = itertools.count()
        self._send_lock = threading.Lock()
        self._pending: list[Event] = []

    def send(self, command: Command) -> None:
        with self._send_lock:  # sequence numbers in the order the calls leave
            self.actor.submit.remote(next(self._seq), command)

    def receive(self) -> Event:
        while not self._pending:
            try:
                self._pending = list(ray.get(self.actor.poll.remote(POLL_S)))
            except RayError as exc:
                raise ReplicaDied(f"replica actor died: {exc}") from exc
        return self._pending.pop(0)

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)

    def join(self, timeout: float) -> None:
        # The loop has sent Stopped; the actor process itself is Ray's to end.
        ray.kill(self.actor, no_restart=True)


def start_ray_replica(index: int, config: EngineConfig) -> ReplicaHandle:
    return RayReplica(index, config)
