"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

The request is translated to a chat request (``anthropic.py``) and validated, rendered
and submitted exactly as /v1/chat/completions does it; the output is parsed for tool
calls by the same parser and returned as Anthropic's content blocks, or streamed as
its events (``message_start``, a ``content_block_start`` / ``_delta`` / ``_stop``
run per block, ``message_delta`` with the stop reason and usage, ``message_stop``).
Errors on these paths take Anthropic's shape (errors.py decides by path).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request, Response

from sluice.core.errors import EngineShutdownError, EngineStepError
from sluice.outputs import CompletionOutput, RequestOutput
from sluice.server.anthropic import (
    CountTokensRequest,
    MessagesRequest,
    stop_reason,
    to_chat_request,
    tool_input,
    tool_use_id,
)
from sluice.server.context import ServerContext, server_context
from sluice.server.errors import anthropic_error_body, renamed_params
from sluice.server.generation import Tracked, collect, submit, until_disconnected
from sluice.server.messages import render_chat
from sluice.server.reasoning import ReasoningSplitter
from sluice.server.routes.chat import prepare_chat, reasoning_for
from sluice.server.streaming import event_stream
from sluice.server.tool_calls import ToolCallParser, parse_all
from sluice.server.tools import tool_plan
from sluice.server.validation import check_model, parse

router = APIRouter()

# The chat request's field names (prefixes of them), as this API calls them.
_PARAMS = {"stop": "stop_sequences", "response_format.json_schema": "output_config.format"}


def _usage(prompt_tokens: int, cached: int, output: int) -> dict[str, int]:
    """Anthropic counts prompt tokens read from the prefix cache apart from the rest."""
    return {
        "input_tokens": prompt_tokens - cached,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": output,
    }


def _content(
    c: CompletionOutput,
    new_parser: Callable[[], ToolCallParser] | None,
    reasoning: Callable[[], ReasoningSplitter] | None,
) -> list[Any]:
    """The reply's blocks: its thinking, its text, its calls (found in the answer only)."""
    answer, thought = c.text, ""
    if reasoning is not None:
        thought, answer = reasoning().feed(c.text, final=True)
    blocks: list[dict[str, Any]] = []
    if thought:  # no signature: nothing to verify against on a local server
        blocks.append({"type": "thinking", "thinking": thought, "signature": ""})
    if new_parser is None:
        return blocks + ([{"type": "text", "text": answer}] if answer else [])
    text, calls = parse_all(new_parser(), answer)
    if text:
        blocks.append({"type": "text", "text": text})
    for call in calls:
        fn = call["function"]
        blocks.append(
            {
                "type": "tool_use",
                "id": tool_use_id(call["id"]),
                "name": fn["name"],
                "input": tool_input(fn["arguments"]),
            }
        )
    return blocks


def _message(
    ctx: ServerContext,
    rid: str,
    final: RequestOutput,
    new_parser: Callable[[], ToolCallParser] | None,
    reasoning: Callable[[], ReasoningSplitter] | None,
) -> dict[str, Any]:
    (c,) = final.outputs
    content = _content(c, new_parser, reasoning)
    called = any(b["type"] == "tool_use" for b in content)
    reason, sequence = stop_reason(c.finish_reason, c.stop_reason, called)
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": ctx.model_name,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(len(final.prompt_token_ids), final.num_cached_tokens, len(c.token_ids)),
    }


def _event(kind: str, body: dict[str, Any]) -> str:
    data = json.dumps({"type": kind, **body}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n"


class _Blocks:
    """A streamed reply's content blocks: text pieces go to an open text block, each
    call gets a tool_use block of its own; starting a block closes the open one."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the open block's type
        self.called = False

    def _start(self, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index += 1
        self.open = block["type"]
        return [
            *events,
            _event("content_block_start", {"index": self.index, "content_block": block}),
        ]

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def text(self, text: str) -> list[str]:
        if not text:
            return []
        events = [] if self.open == "text" else self._start({"type": "text", "text": ""})
        return [*events, self._delta({"type": "text_delta", "text": text})]

    def thinking(self, text: str) -> list[str]:
        if not text:
            return []
        events = []
        if self.open != "thinking":
            events = self._start({"type": "thinking", "thinking": "", "signature": ""})
        return [*events, self._delta({"type": "thinking_delta", "thinking": text})]

    def call(self, call_id: str | None, name: str | None, arguments: str) -> list[str]:
        events: list[str] = []
        if call_id is not None:
            self.called = True
            block: dict[str, Any] = {
                "type": "tool_use",
                "id": tool_use_id(call_id),
                "name": name,
                "input": {},
            }
            events = self._start(block)
        if arguments:
            events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]


def _pieces(
    c: CompletionOutput,
    parser: ToolCallParser | None,
    thinking: ReasoningSplitter | None,
    blocks: _Blocks,
) -> list[str]:
    """The events for what this output of the reply adds."""
    final = c.finish_reason is not None
    text, events = c.delta_text, []
    if thinking is not None:
        thought, text = thinking.feed(text, final)
        events = blocks.thinking(thought)
    if parser is None:
        return events + blocks.text(text)
    parsed = parser.feed(text, final)
    events += blocks.text(parsed.content)
    for piece in parsed.calls:
        events += blocks.call(piece.id, piece.name, piece.arguments)
    return events


async def _events(
    ctx: ServerContext,
    rid: str,
    prompt_len: int,
    tracked: Tracked,
    new_parser: Callable[[], ToolCallParser] | None,
    reasoning: Callable[[], ReasoningSplitter] | None,
) -> AsyncIterator[str]:
    parser = new_parser() if new_parser else None
    thinking = reasoning() if reasoning else None
    blocks = _Blocks()
    start: dict[str, Any] = {
        "id": rid, "type": "message", "role": "assistant", "model": ctx.model_name,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": _usage(prompt_len, 0, 0),
    }  # fmt: skip
    try:
        yield _event("message_start", {"message": start})
        yield _event("ping", {})
        async for out in tracked:
            (c,) = out.outputs
            for event in _pieces(c, parser, thinking, blocks):
                yield event
            if c.finish_reason is not None:
                for event in blocks.close():
                    yield event
                reason, sequence = stop_reason(c.finish_reason, c.stop_reason, blocks.called)
                usage = _usage(prompt_len, out.num_cached_tokens, len(c.token_ids))
                delta = {"stop_reason": reason, "stop_sequence": sequence}
                yield _event("message_delta", {"delta": delta, "usage": usage})
                yield _event("message_stop", {})
    except (EngineStepError, EngineShutdownError) as exc:
        # Headers are out: the failure becomes an error event, as Anthropic sends one.
        body = anthropic_error_body(500, str(exc))
        yield _event("error", {"error": body["error"]})
    finally:
        tracked.close()


@router.post("/v1/messages", response_model=None)
async def messages(request: Request) -> Response | dict[str, Any]:
    ctx = server_context(request)
    req = await parse(request, MessagesRequest)
    chat = to_chat_request(req)
    with renamed_params(_PARAMS):
        params, ids, plan = await prepare_chat(ctx, chat)
    rid = f"msg_{uuid.uuid4().hex[:24]}"
    lora = check_model(ctx, chat.model)
    (tracked,) = await submit(
        ctx, [ids], params, rid, 0, "messages", streamed=req.stream, lora=lora
    )
    reasoning = reasoning_for(ctx, ids)
    if req.stream:
        return event_stream(_events(ctx, rid, len(ids), tracked, plan.new_parser, reasoning))
    (final,) = await until_disconnected(request, collect([tracked]))
    return _message(ctx, rid, final, plan.new_parser, reasoning)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict[str, Any]:
    ctx = server_context(request)
    req = await parse(request, CountTokensRequest)
    chat = to_chat_request(req)
    check_model(ctx, chat.model)
    plan = tool_plan(ctx, chat)
    ids = render_chat(ctx, chat.messages, True, plan.tools, chat.chat_template_kwargs)
    return {"input_tokens": len(ids)}
