"""Server-sent events for streamed completions and chat completions.

A streamed response is a sequence of ``data: {chunk}`` events ended by ``data: [DONE]``,
as OpenAI sends them. Both endpoints share this module: only the chunk's ``object``
and where its text goes (``text`` or ``delta.content``) differ. Headers are already
out when an engine error happens mid-stream, so it is sent as an error event.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from sluice.core.errors import EngineShutdownError, EngineStepError
from sluice.outputs import CompletionOutput
from sluice.sampling_params import SamplingParams
from sluice.server.context import ServerContext
from sluice.server.errors import error_body
from sluice.server.generation import Tracked, merge, usage
from sluice.server.logprobs import chat_logprobs, completion_logprobs
from sluice.server.protocol import ChatCompletionRequest, CompletionRequest
from sluice.server.reasoning import ReasoningSplitter
from sluice.server.tool_calls import ToolCallParser, stream_delta

SSE_DONE = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        # Proxies must pass each event on as it comes, not buffer the response.
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@dataclass
class StreamSpec:
    """What a stream's chunks carry, fixed for the whole response."""

    request_id: str
    chat: bool
    n: int
    include_usage: bool
    top_n: int | None
    # Chat with tools: each choice's text goes through its own parser (tool_calls.py).
    tool_parser: Callable[[], ToolCallParser] | None = None
    # --reasoning-parser: each choice's thinking is split off first (reasoning.py).
    reasoning_parser: Callable[[], ReasoningSplitter] | None = None


class _Chunks:
    """Builds one stream's chunks, remembering what each choice has been sent so far."""

    def __init__(self, ctx: ServerContext, spec: StreamSpec, n_choices: int) -> None:
        self.ctx = ctx
        self.spec = spec
        self.object = "chat.completion.chunk" if spec.chat else "text_completion"
        self.created = int(time.time())
        self.done = [False] * n_choices
        self.lp_sent = [0] * n_choices
        self.offsets = [0] * n_choices
        self.finals: list[CompletionOutput | None] = [None] * n_choices
        self.cached: dict[int, int] = {}  # prompt index -> its prefix-cache hit
        new_parser = spec.tool_parser
        self.parsers = [new_parser() for _ in range(n_choices)] if new_parser else None
        new_reasoning = spec.reasoning_parser
        self.thinking = [new_reasoning() for _ in range(n_choices)] if new_reasoning else None

    def event(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        body: dict[str, Any] = {
            "id": self.spec.request_id,
            "object": self.object,
            "created": self.created,
            "model": self.ctx.model_name,
            "choices": choices,
        }
        if self.spec.include_usage:
            body["usage"] = usage
        return sse(body)

    def role(self, index: int) -> str:
        # With tools, content starts as null, as OpenAI sends it: a reply that only
        # calls reassembles to content null, as the non-streamed message has it.
        delta = {"role": "assistant", "content": None if self.parsers else ""}
        return self.event(
            [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]
        )

    def choice(self, prompt_index: int, c: CompletionOutput) -> str | None:
        """The chunk for this output of choice `c`, or None when it carries nothing new."""
        idx = prompt_index * self.spec.n + c.index
        if self.done[idx]:
            return None
        lp_obj, n_new = self._logprobs(idx, c)
        choice: dict[str, Any] = {"index": idx}
        if self.spec.chat:
            choice["delta"], reason = self._delta(idx, c)
            news = bool(choice["delta"])
        else:
            choice["text"], reason = c.delta_text, c.finish_reason
            news = bool(c.delta_text)
        if not news and reason is None and not n_new:
            return None
        choice["logprobs"] = lp_obj
        choice["finish_reason"] = reason
        if c.finish_reason is not None:
            self.done[idx] = True
            self.finals[idx] = c
        return self.event([choice])

    def _delta(self, idx: int, c: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        """A chat chunk's delta and finish_reason: the new text, or with tools what it
        adds to the content and the calls (text that may start a call waits); with a
        reasoning parser, the thinking goes to reasoning_content first."""
        text, thought = c.delta_text, ""
        if self.thinking is not None:
            thought, text = self.thinking[idx].feed(text, final=c.finish_reason is not None)
        delta: dict[str, Any]
        reason: str | None
        if self.parsers is None:
            delta, reason = ({"content": text} if text else {}), c.finish_reason
        else:
            delta, reason = stream_delta(self.parsers[idx], text, c.finish_reason)
        if thought:
            delta["reasoning_content"] = delta["reasoning"] = thought
        return delta, reason

    def _logprobs(self, idx: int, c: CompletionOutput) -> tuple[dict[str, Any] | None, int]:
        """Logprobs of the tokens this choice was not sent yet (None if not asked for), and
        how many tokens they cover."""
        n_tok = len(c.token_ids)
        start, self.lp_sent[idx] = self.lp_sent[idx], n_tok
        top_n = self.spec.top_n
        if top_n is None or c.logprobs is None:
            return None, 0
        new_ids, entries = c.token_ids[start:n_tok], c.logprobs[start:n_tok]
        tokenizer = self.ctx.tokenizer
        if self.spec.chat:
            return chat_logprobs(tokenizer, new_ids, entries, top_n), len(entries)
        lp_obj, self.offsets[idx] = completion_logprobs(
            tokenizer, new_ids, entries, top_n, self.offsets[idx]
        )
        return lp_obj, len(entries)

    def usage_event(self, prompts: list[list[int]]) -> str:
        outs = [f for f in self.finals if f is not None]
        return self.event([], usage(prompts, outs, sum(self.cached.values())))


async def stream_events(
    ctx: ServerContext, tracked: list[Tracked], prompts: list[list[int]], spec: StreamSpec
) -> AsyncIterator[str]:
    """The SSE events of one response; aborts whatever is unfinished when it ends."""
    chunks = _Chunks(ctx, spec, len(tracked) * spec.n)
    merged = merge(tracked)
    try:
        if spec.chat:
            for i in range(len(chunks.done)):
                yield chunks.role(i)
        async for pi, out in merged:
            chunks.cached[pi] = out.num_cached_tokens
            for c in out.outputs:
                if (event := chunks.choice(pi, c)) is not None:
                    yield event
        if spec.include_usage:
            yield chunks.usage_event(prompts)
        yield SSE_DONE
    except (EngineStepError, EngineShutdownError) as exc:
        # Headers are out: all we can do is say so in the stream, as vLLM does.
        yield sse(error_body(str(exc), "server_error", None, "engine_error"))
        yield SSE_DONE
    finally:
        await merged.aclose()
        for t in tracked:
            t.close()


def streamed_response(
    ctx: ServerContext,
    req: CompletionRequest | ChatCompletionRequest,
    request_id: str,
    params: SamplingParams,
    tracked: list[Tracked],
    prompts: list[list[int]],
    tool_parser: Callable[[], ToolCallParser] | None = None,
    reasoning_parser: Callable[[], ReasoningSplitter] | None = None,
) -> StreamingResponse:
    """The streamed answer to a submitted completion or chat request (with tools, parsed
    for calls by `tool_parser`'s parsers)."""
    spec = StreamSpec(
        request_id,
        chat=isinstance(req, ChatCompletionRequest),
        n=params.n,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        top_n=params.logprobs,
        tool_parser=tool_parser,
        reasoning_parser=reasoning_parser,
    )
    return event_stream(stream_events(ctx, tracked, prompts, spec))
