"""DataParallelLLM: N engine replicas behind AsyncLLM's surface, for the server.

A request's path: the front end tokenizes (it has the prompt's token ids anyway; the
server sends ids), the Router picks a replica by prefix and load, the request's
record (`_Inflight`) notes where it went, and the replica's reader thread delivers its
outputs to the request's RequestStream on the caller's event loop.

When a replica dies, each of its requests that has streamed nothing yet is sent to
another replica (or parked until one is back), and each that has is ended with an
EngineStepError; the replica is restarted. All bookkeeping is under one lock, taken
by callers and reader threads alike; commands are sent outside it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from sluice.config import EngineConfig
from sluice.core.errors import (
    EngineShutdownError,
    EngineStepError,
    QueueFullError,
    RequestError,
)
from sluice.core.lora import LoRARequest
from sluice.core.request import RequestParams
from sluice.distributed.backend import StartReplica
from sluice.distributed.messages import (
    AbortRequest,
    Accepted,
    AdapterDone,
    AddRequest,
    Event,
    LoadAdapter,
    Outputs,
    Rejected,
    StepFailed,
    UnloadAdapter,
)
from sluice.distributed.replica_client import ReplicaClient
from sluice.distributed.router import Router
from sluice.distributed.stats import merged_stats
from sluice.engine.async_engine import DEFAULT_MAX_WAITING_REQUESTS, RequestStream
from sluice.engine.stats import FrontEndStats
from sluice.loader import MemoryBudget, load_tokenizer, resolve_chat_template
from sluice.outputs import RequestOutput

logger = logging.getLogger("sluice.distributed")

STARTUP_TIMEOUT_S = 600.0


def starter(backend: str) -> StartReplica:
    """How replicas start under `backend` ("mp" or "ray"); Ray is imported only here."""
    if backend == "ray":
        from sluice.distributed.ray_backend import connect, start_ray_replica

        connect()  # here, before the replicas' threads start
        return start_ray_replica
    from sluice.distributed.mp_backend import start_mp_replica

    return start_mp_replica


def replica_config(config: EngineConfig) -> EngineConfig:
    """One replica's config: the threads shared out among the replicas."""
    n = config.data_parallel_size
    return dataclasses.replace(
        config, data_parallel_size=1, num_threads=max(1, config.threads() // n)
    )


@dataclass
class _Inflight:
    """One request as the front end follows it."""

    request_id: str
    prompt: list[int]
    params: RequestParams
    priority: int
    arrival: float  # this process's monotonic clock
    stream: weakref.ref[RequestStream]
    loop: asyncio.AbstractEventLoop
    accepted: concurrent.futures.Future[None]
    replica: int | None = None  # None: parked until a replica is up
    streamed: bool = False  # an output reached the stream: it can no longer move
    replayable: bool = False  # ...unless its consumer keeps only the final output
    lora_request: LoRARequest | None = None

    def add_command(self) -> AddRequest:
        age = time.monotonic() - self.arrival
        return AddRequest(
            self.request_id, self.prompt, self.params, self.priority, age, self.lora_request
        )


_Delivery = list[tuple[RequestStream, RequestOutput | BaseException]]
_T = TypeVar("_T")


class DataParallelLLM:
    def __init__(
        self,
        config: EngineConfig,
        *,
        max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
        start: StartReplica | None = None,
    ) -> None:
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.config = config
        self.max_waiting_requests = max_waiting_requests
        model_config, self.tokenizer = load_tokenizer(
            config.model, config.revision, MemoryBudget.of(config)
        )
        if config.chat_template:
            self.tokenizer.set_chat_template(resolve_chat_template(config.chat_template))
        self.vocab_size = model_config.vocab_size
        n = config.data_parallel_size
        self.router = Router(n, config.block_size, max_loras=config.max_loras)
        # Re-entrant: a dropped stream's __del__ aborts its request, and the collector may
        # run it on a thread that already holds the lock.
        self._lock = threading.RLock()
        self._requests: dict[str, _Inflight] = {}
        self._parked: list[_Inflight] = []
        self._loads = [0] * n
        # Requests of dead replicas: sent again elsewhere, or ended with an error.
        self.num_resent = 0
        self.num_lost = 0
        self._ids = itertools.count()
        # LoRA adapters: those served (lora_modules, then run-time loads and unloads),
        # those being loaded, and the adapter commands awaiting a replica's answer.
        self._adapters = {r.lora_name: r for r in config.lora_requests()}
        self._loading: dict[str, LoRARequest] = {}
        self._adapter_calls: dict[tuple[int, int], concurrent.futures.Future[bool]] = {}
        self._tokens = itertools.count(1)  # 0: an answer nobody waits for
        self._accepting = True
        self._stopped = False
        start = start or starter(config.distributed_executor_backend)
        rc = replica_config(config)
        self.replicas = [ReplicaClient(i, rc, start, self) for i in range(n)]
        self._wait_started()
        self.max_model_len = min(r.max_model_len for r in self.replicas)
        self.router.capacity_blocks = [
            int(r.stats.get("kv_total_blocks", 1 << 16)) for r in self.replicas
        ]

    def _wait_started(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for r in self.replicas:
            if not r.first_start.wait(max(0.0, deadline - time.monotonic())):
                r.start_error = EngineShutdownError(f"replica {r.index} did not start in time")
            if r.start_error is not None:
                self.shutdown()
                raise r.start_error

    # ---- the AsyncLLM surface --------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return not self._stopped and not all(r.gave_up for r in self.replicas)

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    async def generate(
        self,
        prompt: str | list[int],
        params: RequestParams,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        *,
        replayable: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Submit a request and return its output stream; its replica's validation
        errors and QueueFullError are raised here, before any output. A `replayable`
        request (its consumer keeps only the final output) is run again from the start
        on another replica if its replica dies, even after outputs came."""
        if not self._accepting or not self.is_running:
            raise EngineShutdownError("the engine is shutting down")
        rid = request_id or self.new_request_id()
        stream = RequestStream(self, rid, asyncio.get_running_loop())
        entry = _Inflight(
            rid,
            self._encode(prompt),
            params,
            priority,
            time.monotonic() if arrival_time is None else arrival_time,
            weakref.ref(stream),
            stream._loop,
            concurrent.futures.Future(),
            replayable=replayable,
            lora_request=lora_request,
        )
        with self._lock:
            self._admit(entry)
            target = self._place(entry)
        if target is not None:
            target.send(entry.add_command())
        try:
            await asyncio.wrap_future(entry.accepted)
        except asyncio.CancelledError:
            stream.finished = True
            self.abort(rid)
            raise
        except BaseException:
            stream.finished = True
            self._forget(rid)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        entry = self._forget(request_id)
        if entry is not None and entry.replica is not None:
            self.replicas[entry.replica].send(AbortRequest(request_id))

    def lora_adapters(self) -> dict[str, LoRARequest]:
        """The adapters every replica serves: the lora_modules they start with, as
        loaded and unloaded since."""
        with self._lock:
            return dict(self._adapters)

    async def load_lora_adapter(self, request: LoRARequest) -> None:
        """Load an adapter on every replica (each reads the files); if one refuses,
        those that took it drop it again and its error is raised. A replica that
        restarts later loads it before its first request."""
        name = request.lora_name
        with self._lock:
            if not self.config.enable_lora:
                raise RequestError("lora_name", "LoRA adapters need --enable-lora")
            if name in self._adapters or name in self._loading:
                raise RequestError("lora_name", f"an adapter named {name!r} is already loaded")
            self._loading[name] = request
        try:
            answers = await self._on_every_replica(lambda token: LoadAdapter(token, request))
            errors = [a for a in answers if isinstance(a, BaseException)]
            if errors:
                await self._on_every_replica(lambda token: UnloadAdapter(token, name))
                raise errors[0]
            with self._lock:
                self._adapters[name] = request
        finally:
            with self._lock:
                self._loading.pop(name, None)

    async def unload_lora_adapter(self, name: str) -> bool:
        """Stop serving an adapter on every replica (their running requests for it
        finish); False if it was not served."""
        with self._lock:
            if self._adapters.pop(name, None) is None:
                return False
        answers = await self._on_every_replica(lambda token: UnloadAdapter(token, name))
        errors = [a for a in answers if isinstance(a, BaseException)]
        if errors:
            raise errors[0]
        return True

    async def _on_every_replica(
        self, command: Callable[[int], LoadAdapter | UnloadAdapter]
    ) -> list[bool | BaseException]:
        """Send an adapter command to every live replica and gather their answers (a
        replica that dies first answers with an EngineStepError)."""
        with self._lock:
            token = next(self._tokens)
            targets = [r for r in self.replicas if r.alive]
            futures = []
            for r in targets:
                future: concurrent.futures.Future[bool] = concurrent.futures.Future()
                self._adapter_calls[(token, r.index)] = future
                futures.append(asyncio.wrap_future(future))
        for r in targets:
            r.send(command(token))
        return await asyncio.gather(*futures, return_exceptions=True)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            pending = len(self._parked) + sum(
                not e.accepted.done() for e in self._requests.values()
            )
            loads = list(self._loads)
        snap = merged_stats(self.replicas, loads, self.router.counts)
        mine = FrontEndStats(
            num_pending=pending,
            num_resent_after_replica_death=self.num_resent,
            num_lost_to_replica_death=self.num_lost,
            engine_alive=self.is_running,
        )
        snap.update(mine.as_dict())
        return snap

    def shutdown(self, timeout: float = 0.0) -> None:
        """Stop taking requests; let those in flight finish for up to `timeout` seconds,
        then stop every replica (they abort what is left) and end the rest with an error."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._requests and time.monotonic() < deadline and self.is_running:
            time.sleep(0.05)
        if self._stopped:
            return
        self._stopped = True
        for r in self.replicas:
            r.stop()
        with self._lock:
            left, self._requests, self._parked = list(self._requests.values()), {}, []
        _fail(left, EngineShutdownError("the server is shutting down"))
        for r in self.replicas:
            r.join(30.0)

    # ---- bookkeeping (callers hold the lock where noted) --------------------------------

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt", "prompt must not be empty")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list | tuple):
            raise RequestError("prompt", "prompt must be a string or a list of token ids")
        return list(prompt)  # the replica checks the ids

    def _admit(self, entry: _Inflight) -> None:
        """Under the lock: refuse a duplicate id or a full queue, else record it."""
        if entry.request_id in self._requests:
            raise RequestError("request_id", f"request id {entry.request_id!r} is already in use")
        waiting = len(self._parked) + sum(
            int(r.stats.get("num_waiting", 0)) for r in self.replicas if r.alive
        )
        waiting += sum(not e.accepted.done() for e in self._requests.values())
        if waiting >= self.max_waiting_requests:
            raise QueueFullError(waiting, self.max_waiting_requests)
        self._requests[entry.request_id] = entry

    def _place(self, entry: _Inflight) -> ReplicaClient | None:
        """Under the lock: the replica `entry` goes to, or None where it is parked."""
        alive = [r.alive for r in self.replicas]
        if not any(alive):
            entry.replica = None
            self._parked.append(entry)
            return None
        adapter = None if entry.lora_request is None else entry.lora_request.lora_name
        i = self.router.choose(entry.prompt, self._loads, alive, adapter)
        entry.replica = i
        self._loads[i] += 1
        return self.replicas[i]

    def _forget(self, request_id: str) -> _Inflight | None:
        with self._lock:
            entry = self._requests.pop(request_id, None)
            if entry is not None:
                self._release(entry)
        return entry

    def _release(self, entry: _Inflight) -> None:
        """Under the lock: `entry` no longer counts where it was."""
        if entry.replica is not None:
            self._loads[entry.replica] -= 1
        elif entry in self._parked:
            self._parked.remove(entry)

    # ---- events from the replicas' reader threads -------------------------------------

    def on_ready(self, replica: ReplicaClient) -> None:
        with self._lock:
            replica.alive = True
            parked, self._parked = self._parked, []
            moves = [(e, self._place(e)) for e in parked]
            changes = self._adapter_changes()
        for change in changes:  # before any request that may name them
            replica.send(change)
        _send_adds(moves)

    def _adapter_changes(self) -> list[LoadAdapter | UnloadAdapter]:
        """Under the lock: what a (re)started replica, which serves the lora_modules,
        must load and unload to serve what the others do."""
        started = {r.lora_name for r in self.config.lora_requests()}
        wanted = {**self._adapters, **self._loading}
        changes: list[LoadAdapter | UnloadAdapter] = [
            UnloadAdapter(0, name) for name in started if name not in wanted
        ]
        changes += [LoadAdapter(0, r) for name, r in wanted.items() if name not in started]
        return changes

    def on_event(self, replica: ReplicaClient, event: Event) -> None:
        if isinstance(event, Accepted | Outputs | StepFailed):
            replica.stats = event.stats
        if isinstance(event, Accepted):
            for rid in event.request_ids:
                entry = self._requests.get(rid)
                if entry is not None:
                    _resolve(entry.accepted, None, None)
        elif isinstance(event, Rejected):
            entry = self._own(replica, event.request_id)
            if entry is not None:
                _fail([entry], event.error)
        elif isinstance(event, AdapterDone):
            with self._lock:
                call = self._adapter_calls.pop((event.token, replica.index), None)
            if call is not None:
                _resolve(call, event.error, event.changed)
            elif event.error is not None:
                logger.warning("replica %d: %s", replica.index, event.error)
        elif isinstance(event, Outputs):
            self._dispatch(replica, event.outputs)
        elif isinstance(event, StepFailed):
            error = EngineStepError(f"the engine failed while generating: {event.message}")
            _fail([e for rid in event.request_ids if (e := self._own(replica, rid))], error)

    def _own(self, replica: ReplicaClient, request_id: str) -> _Inflight | None:
        """Forget `request_id` if it is still `replica`'s (else it moved or ended)."""
        with self._lock:
            entry = self._requests.get(request_id)
            if entry is None or entry.replica != replica.index:
                return None
            del self._requests[request_id]
            self._release(entry)
        return entry

    def _dispatch(self, replica: ReplicaClient, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, _Delivery] = {}
        for out in outputs:
            entry = self._requests.get(out.request_id)
            if entry is None or entry.replica != replica.index:
                continue  # aborted, or moved here after its old replica's last word
            stream = entry.stream()
            if stream is None:  # its consumer dropped it
                self.abort(out.request_id)
                continue
            entry.streamed = True
            if out.finished:
                self._own(replica, out.request_id)
            by_loop.setdefault(entry.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            _call_soon(loop, items)

    def on_death(self, replica: ReplicaClient) -> None:
        with self._lock:
            was_alive, replica.alive = replica.alive, False
            replica.stats = {}
            self.router.forget(replica.index)
            mine = [e for e in self._requests.values() if e.replica == replica.index]
            lost = [e for e in mine if e.streamed and not e.replayable]
            for e in mine:
                self._release(e)
            for e in lost:
                del self._requests[e.request_id]
            moves = [(e, self._place(e)) for e in mine if e not in lost]
            self.num_resent += len(moves)
            self.num_lost += len(lost)
            calls = [k for k in self._adapter_calls if k[1] == replica.index]
            unanswered = [self._adapter_calls.pop(k) for k in calls]
        for call in unanswered:
            _resolve(call, EngineStepError(f"replica {replica.index} died"), False)
        if was_alive:
            logger.warning(
                "replica %d died: %d requests re-sent, %d ended with an error",
                replica.index,
                len(moves),
                len(lost),
            )
        _send_adds(moves)
        _fail(lost, EngineStepError(f"replica {replica.index} died while generating this request"))

    def on_gave_up(self, replica: ReplicaClient) -> None:
        with self._lock:
            if not all(r.gave_up for r in self.replicas):
                return
            left, self._requests, self._parked = list(self._requests.values()), {}, []
        _fail(left, EngineShutdownError("every replica is down"))


def _send_adds(moves: list[tuple[_Inflight, ReplicaClient | None]]) -> None:
    for entry, target in moves:
        if target is not None:
            target.send(entry.add_command())


def _resolve(
    future: concurrent.futures.Future[_T], error: BaseException | None, result: _T
) -> None:
    """Give `future` its result, or `error`; one already settled keeps what it has."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass  # already settled, or cancelled by its caller


def _fail(entries: list[_Inflight], error: BaseException) -> None:
    """End each request with `error`: raised from generate() if it was not accepted
    yet, else from its stream."""
    by_loop: dict[asyncio.AbstractEventLoop, _Delivery] = {}
    for entry in entries:
        if not entry.accepted.done():
            _resolve(entry.accepted, error, None)
            continue
        stream = entry.stream()
        if stream is not None:
            by_loop.setdefault(entry.loop, []).append((stream, error))
    for loop, items in by_loop.items():
        _call_soon(loop, items)


def _call_soon(loop: asyncio.AbstractEventLoop, items: _Delivery) -> None:
    try:
        loop.call_soon_threadsafe(_deliver, items)
    except RuntimeError:
        pass  # that event loop is closed: nobody is listening any more


def _deliver(items: _Delivery) -> None:
    for stream, item in items:
        stream._put(item)
