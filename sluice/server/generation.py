"""Submitting requests to the engine and following them, for both endpoints.

``submit`` queues a request (all prompts of a batch, or none), ``collect`` waits for
the final outputs of a non-streamed request, and ``until_disconnected`` aborts one
whose client hangs up. Every stream goes through ``Tracked``, which feeds the metrics
and makes sure an unfinished request is aborted when its response ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable
from typing import Any, TypeVar

from fastapi import Request

from sluice.core.lora import LoRARequest
from sluice.core.request import RequestParams
from sluice.engine.async_engine import RequestStream
from sluice.outputs import CompletionOutput, RequestOutput
from sluice.sampling_params import SamplingParams
from sluice.server.context import ServerContext
from sluice.server.errors import OpenAIError, engine_errors, shutting_down
from sluice.server.metrics import ServerMetrics

T = TypeVar("T")


class Tracked:
    """One request's stream that also feeds the metrics; ``close()`` aborts it if unfinished."""

    def __init__(self, stream: RequestStream, metrics: ServerMetrics, n: int) -> None:
        self.stream = stream
        self.metrics = metrics
        self.n = n
        self.final: RequestOutput | None = None
        self._first_seen = False
        self._closed = False

    def __aiter__(self) -> Tracked:
        return self

    async def __anext__(self) -> RequestOutput:
        out = await self.stream.__anext__()
        m = self.metrics
        new_tokens = sum(len(c.delta_token_ids) for c in out.outputs)
        if new_tokens:
            m.generation_tokens.inc(new_tokens)
            if not self._first_seen:
                self._first_seen = True
                m.observe_first_token(out)
        if out.finished:
            self.final = out
            for c in out.outputs:
                m.finished(c.finish_reason or "stop")
            m.observe_finished(out)
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.final is None:
            self.metrics.finished("abort", self.n)
        self.stream.abort()


async def merge(tracked: list[Tracked]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Outputs of several requests as they come, tagged with the request's index."""
    if len(tracked) == 1:
        async for out in tracked[0]:
            yield 0, out
        return
    q: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, t: Tracked) -> None:
        try:
            async for out in t:
                q.put_nowait((i, out))
            q.put_nowait((i, None))
        except Exception as exc:
            q.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, t)) for i, t in enumerate(tracked)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def submit(
    ctx: ServerContext,
    prompts: list[list[int]],
    params: RequestParams,
    base_id: str,
    priority: int,
    prompt_param: str,
    *,
    streamed: bool = True,
    lora: LoRARequest | None = None,
) -> list[Tracked]:
    """Queue one request per prompt; all or nothing: a batch with one bad prompt runs none.
    A request not `streamed` to its client may be run again after a replica fault; `lora`
    is the adapter the request's `model` named (check_model)."""
    if ctx.draining:
        raise shutting_down()
    arrival = time.monotonic()
    n = params.n if isinstance(params, SamplingParams) else 1

    async def add(i: int, ids: list[int]) -> RequestStream:
        rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
        return await ctx.llm.generate(
            ids, params, rid, priority, arrival, replayable=not streamed, lora_request=lora
        )

    # All at once: the engine loop takes every add waiting between two steps, so the
    # prompts of one request (an embeddings batch) share its steps instead of joining
    # one a step.
    added = await asyncio.gather(
        *(add(i, ids) for i, ids in enumerate(prompts)), return_exceptions=True
    )
    streams = [a for a in added if not isinstance(a, BaseException)]
    failed = [a for a in added if isinstance(a, BaseException)]
    if failed:
        for stream in streams:
            stream.abort()
        with engine_errors(prompt_param):
            raise failed[0]
    tracked = [Tracked(stream, ctx.metrics, n) for stream in streams]
    ctx.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
    return tracked


async def _final(t: Tracked) -> RequestOutput:
    async for _ in t:  # drain: only the final output matters here
        continue
    if t.final is None:
        raise OpenAIError(500, "the request ended without output", type="server_error")
    return t.final


async def collect(tracked: list[Tracked]) -> list[RequestOutput]:
    """The final output of each request (a non-streamed response)."""
    try:
        with engine_errors("prompt"):
            return list(await asyncio.gather(*(_final(t) for t in tracked)))
    finally:
        for t in tracked:
            t.close()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work` unless the client hangs up first (then cancel it, which aborts it)."""

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        # 499 as nginx logs it; the client is gone and never sees it.
        raise OpenAIError(499, "the client closed the request", type="client_closed")
    return task.result()


def usage(
    prompts: list[list[int]], outputs: list[CompletionOutput], cached: int = 0
) -> dict[str, Any]:
    """OpenAI's usage; `cached` prompt tokens came from the prefix cache or the disk
    tier (clients show and price prompt caching by it)."""
    p = sum(len(ids) for ids in prompts)
    c = sum(len(o.token_ids) for o in outputs)
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
