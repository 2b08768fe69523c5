"""The engine loop for the server: one thread steps the engine; asyncio callers submit,
stream and abort.

Only the loop thread touches the LLMEngine. Callers talk to it through a thread-safe
inbox that the loop drains between steps, and get their outputs back on their own
event loop via ``call_soon_threadsafe``. When nothing is running the thread blocks on
the inbox, so an idle server costs no CPU but a stats refresh once a second (a KV
connector's counters move on its own threads).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

from sluice.config import EngineConfig
from sluice.core.errors import (
    EngineShutdownError,
    EngineStepError,
    QueueFullError,
    RequestError,
)
from sluice.core.lora import LoRARequest
from sluice.core.request import RequestParams
from sluice.engine.engine import LLMEngine
from sluice.engine.lora import LoRARegistry
from sluice.engine.stats import FrontEndStats
from sluice.outputs import RequestOutput
from sluice.sampling_params import SamplingParams

logger = logging.getLogger("sluice")

DEFAULT_MAX_WAITING_REQUESTS = 512
# How often an idle loop wakes to refresh the stats snapshot.
_IDLE_REFRESH_S = 1.0


class EngineLike(Protocol):
    """What AsyncLLM needs from an engine (LLMEngine; tests may pass a fake)."""

    max_model_len: int

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: RequestParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None: ...

    def abort_request(self, request_id: str) -> bool: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def stats(self) -> dict[str, Any]: ...


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: RequestParams
    priority: int
    arrival_time: float
    stream: weakref.ref[RequestStream]  # weak: the command may outlive its handling
    accepted: concurrent.futures.Future[None]
    lora_request: LoRARequest | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Stop:
    """The command that ends the engine loop."""


_Command = _Add | _Abort | _Stop


class Aborter(Protocol):
    """Who a stream tells when its consumer gives up (AsyncLLM, or the data-parallel
    front end)."""

    def abort(self, request_id: str) -> None: ...


class RequestStream:
    """The outputs of one request, as an async iterator on the caller's event loop.

    Iteration ends after the output with ``finished=True``. If the consumer stops early
    (cancelled, ``aclose()``, or the stream is dropped), the request is aborted.
    """

    def __init__(self, owner: Aborter, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._owner = owner
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    # Called on the caller's loop (scheduled from the engine thread).
    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:
            # Cancelled while waiting (e.g. the client went away): free the request.
            self.abort()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Abort the request unless it already finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()

    def __del__(self) -> None:
        # A stream dropped mid-way must not keep generating (and holding KV blocks).
        if not self.finished:
            self._owner.abort(self.request_id)


class EngineClient(Protocol):
    """What the server needs from an engine: AsyncLLM (one engine in this process) or
    DataParallelLLM (sluice.distributed: replicas in other processes)."""

    max_model_len: int
    max_waiting_requests: int

    @property
    def is_running(self) -> bool: ...

    def new_request_id(self, prefix: str = "req") -> str: ...

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
        """`replayable`: the consumer keeps only the final output (a non-streamed
        response), so after a fault the request may be run again from the start;
        `lora_request`: the LoRA adapter it runs through."""
        ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def lora_adapters(self) -> dict[str, LoRARequest]:
        """The LoRA adapters requests may name, by name (empty without enable_lora)."""
        ...

    async def load_lora_adapter(self, request: LoRARequest) -> None:
        """Load and serve an adapter (RequestError naming lora_name if taken)."""
        ...

    async def unload_lora_adapter(self, name: str) -> bool:
        """Stop serving an adapter; its running requests finish. False if unknown."""
        ...

    def shutdown(self, timeout: float = 0.0) -> None: ...


class AsyncLLM:
    """An LLMEngine stepped by one background thread, driven from asyncio.

    ``AsyncLLM.from_config(config)`` builds the engine on the loop thread;
    ``AsyncLLM(engine)`` wraps one built elsewhere (tests pass fakes).

    Why build it on the loop thread: each thread that starts OpenMP regions gets its
    own pool of worker threads, and once libgomp manages more threads than there are
    cores it stops spinning between regions and sleeps on futexes instead. Loading
    the model on the main thread and stepping on this one did exactly that: every
    parallel kernel call then paid a futex wake-up (~85 us on these VMs), which made a
    1-token step 2-3x slower in the server than offline.
    """

    def __init__(
        self,
        engine: EngineLike | Callable[[], EngineLike],
        *,
        max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
    ) -> None:
        """`engine`: an engine, or a function that builds one on the loop thread (its
        exceptions are raised here)."""
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.max_waiting_requests = max_waiting_requests
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        # Weak: a stream its consumer dropped is collected, and its request aborted.
        self._streams: dict[str, weakref.ref[RequestStream]] = {}
        self._lock = threading.Lock()
        # Adds submitted but not yet taken by the loop: they count as waiting too.
        self._pending_adds = 0
        self._ids = itertools.count()
        self._accepting = True
        self._dead: BaseException | None = None
        self._stats: dict[str, Any] = {}
        self._num_step_errors = 0
        built: concurrent.futures.Future[EngineLike] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(engine, built), name="sluice-engine", daemon=True
        )
        self._thread.start()
        self.engine = built.result()  # re-raises what building the engine raised
        self.max_model_len = self.engine.max_model_len

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        *,
        max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
    ) -> AsyncLLM:
        return cls(lambda: LLMEngine.from_config(config), max_waiting_requests=max_waiting_requests)

    # ---- caller side (any thread with a running event loop) ------------------------

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._thread.is_alive()

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
        replayable: bool = False,  # one engine: a failed step has nowhere else to go
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Submit a request and return its output stream.

        Validation errors (SamplingParamsError, RequestError) and QueueFullError are
        raised here, before any output, so a server can still answer with a 4xx/503.
        """
        if not self._accepting or not self.is_running:
            raise EngineShutdownError("the engine is shutting down")
        rid = request_id or self.new_request_id()
        grammars = getattr(self.engine, "grammars", None)
        if (
            isinstance(params, SamplingParams)
            and params.structured_output is not None
            and grammars is not None
        ):
            # Off the engine loop (the library releases the GIL while it compiles); the
            # engine then finds it in the cache. A rejected grammar raises here.
            await asyncio.to_thread(grammars.compile, params.structured_output)
        with self._lock:
            waiting = int(self._stats.get("num_waiting", 0)) + self._pending_adds
            if waiting >= self.max_waiting_requests:
                raise QueueFullError(waiting, self.max_waiting_requests)
            self._pending_adds += 1
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, rid, loop)
        accepted: concurrent.futures.Future[None] = concurrent.futures.Future()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._inbox.put(
            _Add(
                rid, prompt, params, priority, arrival, weakref.ref(stream), accepted, lora_request
            )
        )
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            # The add may still go through after we stop waiting: abort behind it.
            stream.finished = True
            self.abort(rid)
            raise
        except BaseException:
            stream.finished = True  # never added, so nothing to abort
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if unknown or finished); takes effect within one step."""
        self._inbox.put(_Abort(request_id))

    def _lora(self) -> LoRARegistry | None:
        registry = getattr(self.engine, "lora", None)
        return registry if isinstance(registry, LoRARegistry) else None

    def lora_adapters(self) -> dict[str, LoRARequest]:
        registry = self._lora()
        return {} if registry is None else registry.names()

    async def load_lora_adapter(self, request: LoRARequest) -> None:
        registry = self._lora()
        if registry is None:
            raise RequestError(
                "lora_name", "LoRA adapters need the server started with --enable-lora"
            )
        # Off the event loop: reading and checking the files takes a while. The
        # registry is thread-safe against the engine loop resolving adapters.
        await asyncio.to_thread(registry.register, request)

    async def unload_lora_adapter(self, name: str) -> bool:
        registry = self._lora()
        return registry is not None and registry.unregister(name)

    def stats(self) -> dict[str, Any]:
        """The engine's stats as of its last step (a copy; safe from any thread)."""
        with self._lock:
            snap = dict(self._stats)
            pending = self._pending_adds
        mine = FrontEndStats(
            num_pending=pending, num_step_errors=self._num_step_errors, engine_alive=self.is_running
        )
        snap.update(mine.as_dict())
        return snap

    def shutdown(self, timeout: float = 0.0) -> None:
        """Stop taking requests; let in-flight ones finish for up to `timeout` seconds,
        then abort the rest and stop the loop thread."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and self.is_running:
            time.sleep(0.05)
        self._inbox.put(_Stop())
        self._thread.join(timeout=30)

    # ---- the loop thread ----------------------------------------------------------------

    def _run(
        self,
        engine: EngineLike | Callable[[], EngineLike],
        built: concurrent.futures.Future[EngineLike],
    ) -> None:
        try:
            if callable(engine) and not hasattr(engine, "step"):
                # A factory (e.g. from_config's lambda), run here on the loop thread.
                self.engine = engine()
            else:
                self.engine = cast(EngineLike, engine)
            self._stats = dict(self.engine.stats())
        except BaseException as exc:
            built.set_exception(exc)
            return
        built.set_result(self.engine)
        try:
            self._loop()
        except BaseException as exc:  # the loop must never die silently
            logger.exception("sluice engine loop died")
            self._dead = exc
            self._fail_all(EngineShutdownError(f"the engine loop died: {exc}"))

    def _loop(self) -> None:
        while True:
            # Block when idle; otherwise take whatever arrived during the last step.
            block = not self.engine.has_unfinished_requests()
            commands: list[_Command] = []
            with contextlib.suppress(queue.Empty):  # nothing arrived: just step
                commands.append(self._inbox.get(block=block, timeout=_IDLE_REFRESH_S))
            if block and not commands:
                # Idle for a while: counters that move on other threads (a prefill
                # instance's held KV blocks expiring) reach the stats all the same.
                self._update_snapshot()
                continue
            while True:
                try:
                    commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            accepted: list[concurrent.futures.Future[None]] = []
            num_adds = 0
            for cmd in commands:
                if isinstance(cmd, _Stop):
                    self._fail_all(EngineShutdownError("the server is shutting down"))
                    for fut in accepted:
                        if not fut.cancelled():
                            fut.set_exception(EngineShutdownError("the server is shutting down"))
                    self._close_engine()
                    return
                if isinstance(cmd, _Add):
                    num_adds += 1
                    if self._handle_add(cmd):
                        accepted.append(cmd.accepted)
                else:
                    self._handle_abort(cmd)
            if commands:
                # A request leaves the pending count in the same update that shows it in
                # the snapshot's waiting count, and its caller hears "accepted" only
                # after that: admission control never sees it in neither.
                self._update_snapshot(num_adds)
                for fut in accepted:
                    if not fut.cancelled():
                        fut.set_result(None)
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:
                # Which request broke the step is unknown: fail all in flight, keep serving.
                # (The engine has already taken the failed step's blocks out of the
                # prefix cache: their KV may never have been written.)
                self._num_step_errors += 1
                logger.exception("engine step failed; failing %d requests", len(self._streams))
                self._fail_all(EngineStepError(f"the engine failed while generating: {exc}"))
                self._update_snapshot()
                continue
            # The snapshot first: a client that hears a token may send its next request
            # at once, and admission control must not count the first as waiting.
            self._update_snapshot()
            self._dispatch(outputs)

    def _close_engine(self) -> None:
        """Let the engine finish what it writes in the background (the KV disk tier's
        block files) and stop its tensor-parallel workers (`shutdown`, which closes
        too); engines without either have nothing to finish."""
        close = getattr(self.engine, "shutdown", None) or getattr(self.engine, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                logger.exception("closing the engine failed")

    def _handle_abort(self, cmd: _Abort) -> None:
        self._streams.pop(cmd.request_id, None)
        self.engine.abort_request(cmd.request_id)

    def _handle_add(self, cmd: _Add) -> bool:
        """Add the request to the engine; False if it was cancelled or rejected (its
        caller has been told)."""
        if cmd.accepted.cancelled():
            return False
        try:
            self.engine.add_request(
                cmd.request_id,
                cmd.prompt,
                cmd.params,
                priority=cmd.priority,
                arrival_time=cmd.arrival_time,
                lora_request=cmd.lora_request,
            )
        except Exception as exc:
            cmd.accepted.set_exception(exc)
            return False
        self._streams[cmd.request_id] = cmd.stream
        return True

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for out in outputs:
            ref = (
                self._streams.pop(out.request_id, None)
                if out.finished
                else self._streams.get(out.request_id)
            )
            stream = ref() if ref is not None else None
            if stream is not None:
                by_loop.setdefault(stream._loop, []).append((stream, out))
            elif ref is not None:
                self._streams.pop(out.request_id, None)
                self.engine.abort_request(out.request_id)
        # One wake-up per event loop per step, not one per request.
        for loop, items in by_loop.items():
            self._call_soon(loop, _deliver, items)

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, BaseException]]] = {}
        for rid, ref in streams.items():
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("aborting %s failed", rid)
            stream = ref()
            if stream is not None:
                by_loop.setdefault(stream._loop, []).append((stream, exc))
        for loop, items in by_loop.items():
            self._call_soon(loop, _deliver, items)

    @staticmethod
    def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any, items: list[Any]) -> None:
        try:
            loop.call_soon_threadsafe(fn, items)
        except RuntimeError:
            pass  # that event loop is closed: nobody is listening any more

    def _update_snapshot(self, num_adds_handled: int = 0) -> None:
        try:
            stats = dict(self.engine.stats())
        except Exception:
            logger.exception("engine stats failed")
            stats = None
        with self._lock:
            if stats is not None:
                self._stats = stats
            self._pending_adds -= num_adds_handled


def _deliver(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream._put(item)
