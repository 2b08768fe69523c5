"""Replicas as processes on this machine: a `spawn` child per replica and one duplex
pipe. Spawn, not fork: the front end has threads (uvicorn, readers) that fork would
copy mid-state, and a fresh interpreter starts its own OpenMP pool.

The child exits when its pipe closes, so a front end that dies leaves no replicas.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import threading
from multiprocessing.connection import Connection

from sluice.config import EngineConfig
from sluice.distributed.backend import ReplicaDied, ReplicaHandle
from sluice.distributed.messages import Command, Event, Stop
from sluice.distributed.replica import run_replica

logger = logging.getLogger("sluice.distributed")


class _PipeChannel:
    """The replica's end of the pipe."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def receive(self, timeout: float | None) -> list[Command]:
        commands: list[Command] = []
        try:
            if not self._conn.poll(timeout):
                return commands
            commands.append(self._conn.recv())
            while self._conn.poll(0):
                commands.append(self._conn.recv())
        except (EOFError, OSError):
            commands.append(Stop())  # the front end is gone
        return commands

    def send(self, event: Event) -> None:
        try:
            self._conn.send(event)
        except OSError:
            pass  # the front end is gone; receive() says Stop next


def _replica_main(config: EngineConfig, conn: Connection, log_level: int) -> None:
    # Ctrl-C in a terminal (or a SIGTERM to the whole process group) reaches the
    # replicas too: the front end drains and stops them itself, and a replica whose
    # front end is gone exits when its pipe closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_replica(config, _PipeChannel(conn))


class MpReplica:
    def __init__(self, index: int, config: EngineConfig) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_replica_main,
            args=(config, child, logging.getLogger("sluice").getEffectiveLevel()),
            name=f"sluice-replica-{index}",
        )
        self.process.start()
        child.close()  # only the child holds its end: its death is our EOF
        self._send_lock = threading.Lock()

    def send(self, command: Command) -> None:
        try:
            with self._send_lock:
                self._conn.send(command)
        except OSError:
            pass  # dead: the reader's receive() reports it

    def receive(self) -> Event:
        try:
            event: Event = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise ReplicaDied(f"replica process {self.process.pid} exited") from exc
        return event

    def kill(self) -> None:
        self.process.kill()

    def join(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.is_alive():
            pid = self.process.pid
            logger.warning("replica %s did not exit in %.0fs: killing it", pid, timeout)
            self.process.kill()
            self.process.join(5)
        self._conn.close()


def start_mp_replica(index: int, config: EngineConfig) -> ReplicaHandle:
    return MpReplica(index, config)
