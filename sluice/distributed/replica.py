"""One replica's loop: a whole LLMEngine stepped by one thread, fed commands and
emitting events through a channel. The mp and ray backends run this same function;
they only decide how the process starts and how messages move.

Like AsyncLLM's loop it blocks on its channel when idle and drains it between steps,
so the engine's state is touched by one thread and needs no locks.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from sluice.config import EngineConfig
from sluice.core.errors import EngineStepError, RequestError
from sluice.distributed.messages import (
    AbortRequest,
    Accepted,
    AdapterDone,
    AddRequest,
    Command,
    Event,
    LoadAdapter,
    Outputs,
    Ready,
    Rejected,
    StartFailed,
    StepFailed,
    Stop,
    Stopped,
    UnloadAdapter,
)
from sluice.engine.async_engine import EngineLike
from sluice.engine.engine import LLMEngine

logger = logging.getLogger("sluice.distributed")


class ReplicaEngine(EngineLike, Protocol):
    """What the loop needs of its engine (LLMEngine; tests pass fakes)."""

    @property
    def groups(self) -> Mapping[str, object]:
        """The requests it holds, by id."""
        ...


class ReplicaChannel(Protocol):
    """The replica's side of its transport."""

    def receive(self, timeout: float | None) -> list[Command]:
        """The commands that arrived, waiting up to `timeout` seconds for the first
        (None: until one comes). A transport whose front end is gone returns [Stop()]."""
        ...

    def send(self, event: Event) -> None: ...


def portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling, else an EngineStepError with its message."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return EngineStepError(f"{type(exc).__name__}: {exc}")
    return exc


def run_replica(
    config: EngineConfig,
    channel: ReplicaChannel,
    make_engine: Callable[[EngineConfig], ReplicaEngine] = LLMEngine.from_config,
) -> None:
    """Build the engine on this thread, then serve commands until Stop."""
    try:
        engine = make_engine(config)
    except Exception as exc:
        logger.exception("replica failed to start")
        channel.send(StartFailed(portable(exc)))
        return
    channel.send(Ready(os.getpid(), engine.max_model_len, engine.stats()))
    while True:
        idle = not engine.has_unfinished_requests()
        if not _handle(engine, channel, channel.receive(None if idle else 0.0)):
            for request_id in list(engine.groups):
                engine.abort_request(request_id)
            channel.send(Stopped())
            return
        if engine.has_unfinished_requests():
            _step(engine, channel)


def _handle(engine: ReplicaEngine, channel: ReplicaChannel, commands: list[Command]) -> bool:
    """Apply `commands`; False on Stop."""
    accepted: list[str] = []
    aborted = False
    for cmd in commands:
        if isinstance(cmd, Stop):
            return False
        if isinstance(cmd, AbortRequest):
            aborted |= engine.abort_request(cmd.request_id)
            continue
        if isinstance(cmd, LoadAdapter | UnloadAdapter):
            channel.send(_adapter_command(engine, cmd))
            continue
        try:
            engine.add_request(
                cmd.request_id,
                cmd.prompt,
                cmd.params,
                priority=cmd.priority,
                arrival_time=time.monotonic() - cmd.age,
                lora_request=cmd.lora_request,
            )
        except Exception as exc:
            channel.send(Rejected(cmd.request_id, portable(exc)))
        else:
            accepted.append(cmd.request_id)
    if accepted or aborted:  # the front end's view of load and KV must follow
        channel.send(Accepted(accepted, engine.stats()))
    return True


def _adapter_command(engine: ReplicaEngine, cmd: LoadAdapter | UnloadAdapter) -> AdapterDone:
    """Load or unload an adapter in the engine's registry (reading an adapter's files
    takes tens of ms, between two steps)."""
    registry = getattr(engine, "lora", None)
    try:
        if registry is None:
            raise RequestError("lora_name", "LoRA adapters need --enable-lora")
        if isinstance(cmd, LoadAdapter):
            registry.register(cmd.request)
            return AdapterDone(cmd.token, None, True)
        return AdapterDone(cmd.token, None, bool(registry.unregister(cmd.name)))
    except Exception as exc:
        return AdapterDone(cmd.token, portable(exc), False)


def _step(engine: ReplicaEngine, channel: ReplicaChannel) -> None:
    try:
        outputs = engine.step()
    except Exception as exc:
        # Which request broke the step is unknown: fail those in flight, keep serving.
        logger.exception("replica step failed; failing %d requests", len(engine.groups))
        failed = list(engine.groups)
        for request_id in failed:
            engine.abort_request(request_id)
        channel.send(StepFailed(failed, str(exc), engine.stats()))
        return
    if outputs:
        channel.send(Outputs(outputs, engine.stats()))


__all__ = ["AddRequest", "ReplicaChannel", "portable", "run_replica"]
