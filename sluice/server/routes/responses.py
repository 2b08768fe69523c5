"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API.

The request becomes a chat request (``responses.py``), validated and submitted as
/v1/chat/completions does it; the output (thinking split off, the answer parsed for
tool calls by the same parsers) becomes output items: ``reasoning``, a ``message``
with ``output_text``, ``function_call``s. One builder, ``_Output``, makes the items
and the stream's events together, so the streamed response ends in exactly the
non-streamed one.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response

from sluice.core.errors import EngineShutdownError, EngineStepError
from sluice.outputs import CompletionOutput, RequestOutput
from sluice.server.context import ServerContext, server_context
from sluice.server.errors import renamed_params
from sluice.server.generation import Tracked, collect, submit, until_disconnected
from sluice.server.reasoning import ReasoningSplitter
from sluice.server.responses import (
    ResponsesRequest,
    conversation,
    echo_fields,
    to_chat_request,
)
from sluice.server.routes.chat import prepare_chat, reasoning_for
from sluice.server.streaming import event_stream
from sluice.server.tool_calls import ToolCallParser
from sluice.server.validation import check_model, parse

router = APIRouter()

# The chat request's field names (and prefixes of them), as this API calls them.
_PARAMS = {
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "response_format.json_schema": "text.format",
    "response_format": "text.format",
}


def _hex() -> str:
    return uuid.uuid4().hex[:24]


class _Output:
    """One reply's output items, built from its pieces; each piece returns the stream
    events it makes (the non-streamed path feeds the whole text and drops them)."""

    def __init__(self, parser: ToolCallParser | None, thinking: ReasoningSplitter | None) -> None:
        self.parser, self.thinking = parser, thinking
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.seq = 0
        self.calls: list[dict[str, Any]] = []

    def event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        data = {"type": kind, "sequence_number": self.seq, **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _start(self, item: dict[str, Any]) -> list[str]:
        events = self.close()
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        return [*events, self.event("response.output_item.added", output_index=index, item=item)]

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def reasoning(self, text: str) -> list[str]:
        if not text:
            return []
        events: list[str] = []
        if self.open is None or self.open["type"] != "reasoning":
            part = {"type": "reasoning_text", "text": ""}
            item = {"type": "reasoning", "id": f"rs_{_hex()}", "summary": [], "content": [part]}
            events = self._start(item)
        self.open["content"][0]["text"] += text  # type: ignore[index]
        return [*events, self.event("response.reasoning_text.delta", **self._where(),
                                    content_index=0, delta=text)]  # fmt: skip

    def text(self, text: str) -> list[str]:
        if not text:
            return []
        events: list[str] = []
        if self.open is None or self.open["type"] != "message":
            item: dict[str, Any] = {"type": "message", "id": f"msg_{_hex()}",
                                    "status": "in_progress", "role": "assistant",
                                    "content": []}  # fmt: skip
            events = self._start(item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            events.append(self.event("response.content_part.added", **self._where(),
                                     content_index=0, part=part))  # fmt: skip
        self.open["content"][0]["text"] += text  # type: ignore[index]
        return [*events, self.event("response.output_text.delta", **self._where(),
                                    content_index=0, delta=text, logprobs=[])]  # fmt: skip

    def call(self, call_id: str | None, name: str | None, arguments: str) -> list[str]:
        events: list[str] = []
        if call_id is not None:
            item = {"type": "function_call", "id": f"fc_{_hex()}", "call_id": call_id,
                    "name": name, "arguments": "", "status": "in_progress"}  # fmt: skip
            events = self._start(item)
            self.calls.append(item)
        if arguments and self.open is not None:
            self.open["arguments"] += arguments
            events.append(self.event("response.function_call_arguments.delta", **self._where(),
                                     delta=arguments))  # fmt: skip
        return events

    def close(self) -> list[str]:
        item = self.open
        if item is None:
            return []
        where = self._where()
        self.open = None
        events: list[str] = []
        if item["type"] == "message":
            part = item["content"][0]
            events += [
                self.event("response.output_text.done", **where, content_index=0,
                           text=part["text"], logprobs=[]),
                self.event("response.content_part.done", **where, content_index=0, part=part),
            ]  # fmt: skip
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(self.event("response.reasoning_text.done", **where, content_index=0,
                                     text=text))  # fmt: skip
        else:
            events.append(self.event("response.function_call_arguments.done", **where,
                                     arguments=item["arguments"]))  # fmt: skip
        if "status" in item:
            item["status"] = "completed"
        return [*events, self.event("response.output_item.done",
                                    output_index=where["output_index"], item=item)]  # fmt: skip

    def feed(self, c: CompletionOutput) -> list[str]:
        final = c.finish_reason is not None
        text, events = c.delta_text, []
        if self.thinking is not None:
            thought, text = self.thinking.feed(text, final)
            events += self.reasoning(thought)
        if self.parser is None:
            events += self.text(text)
        else:
            parsed = self.parser.feed(text, final)
            events += self.text(parsed.content)
            for piece in parsed.calls:
                events += self.call(piece.id, piece.name, piece.arguments)
        return events + (self.close() if final else [])

    def assistant_turn(self) -> dict[str, Any]:
        """The reply as a chat message, for the stored conversation."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        turn: dict[str, Any] = {"role": "assistant", "content": text}
        if self.calls:
            turn["tool_calls"] = [
                {"id": c["call_id"], "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in self.calls
            ]  # fmt: skip
        return turn


def _body(
    head: dict[str, Any],
    output: _Output,
    final: RequestOutput | None,
) -> dict[str, Any]:
    """The Response object: in progress (no `final`) or finished."""
    body = {**head, "status": "in_progress", "output": output.items, "usage": None}
    if final is None:
        return body
    (c,) = final.outputs
    prompt, cached, out = len(final.prompt_token_ids), final.num_cached_tokens, len(c.token_ids)
    cut = c.finish_reason == "length"
    body["status"] = "incomplete" if cut else "completed"
    body["incomplete_details"] = {"reason": "max_output_tokens"} if cut else None
    body["usage"] = {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + out,
    }
    return body


def _finish(
    ctx: ServerContext,
    req: ResponsesRequest,
    conv: list[dict[str, Any]],
    body: dict[str, Any],
    output: _Output,
) -> None:
    if req.store:
        ctx.responses.put(body, [*conv, output.assistant_turn()])


async def _events(
    ctx: ServerContext,
    req: ResponsesRequest,
    conv: list[dict[str, Any]],
    head: dict[str, Any],
    tracked: Tracked,
    output: _Output,
) -> AsyncIterator[str]:
    try:
        start = _body(head, output, None)
        yield output.event("response.created", response=start)
        yield output.event("response.in_progress", response=start)
        async for out in tracked:
            for event in output.feed(out.outputs[0]):
                yield event
            if out.finished:
                body = _body(head, output, out)
                _finish(ctx, req, conv, body, output)
                # Also when cut off (status "incomplete" inside): the SDK's stream
                # ends only on response.completed, as vLLM sends it.
                yield output.event("response.completed", response=body)
    except (EngineStepError, EngineShutdownError) as exc:
        error = {"code": "server_error", "message": str(exc)}
        yield output.event("error", **error)
    finally:
        tracked.close()


@router.post("/v1/responses", response_model=None)
async def create_response(request: Request) -> Response | dict[str, Any]:
    ctx = server_context(request)
    req = await parse(request, ResponsesRequest)
    with renamed_params(_PARAMS):
        earlier = (
            []
            if req.previous_response_id is None
            else ctx.responses.get(req.previous_response_id)[1]
        )
        conv = conversation(req, earlier)
        chat = to_chat_request(req, conv)
        params, ids, plan = await prepare_chat(ctx, chat)
    rid = f"resp_{uuid.uuid4().hex}"
    lora = check_model(ctx, chat.model)
    (tracked,) = await submit(ctx, [ids], params, rid, 0, "input", streamed=req.stream, lora=lora)
    reasoning = reasoning_for(ctx, ids)
    output = _Output(
        plan.new_parser() if plan.new_parser else None, reasoning() if reasoning else None
    )
    head = {"id": rid, "object": "response", "created_at": int(time.time()),
            "model": ctx.model_name, "error": None, "incomplete_details": None,
            **echo_fields(req)}  # fmt: skip
    if req.stream:
        return event_stream(_events(ctx, req, conv, head, tracked, output))
    (final,) = await until_disconnected(request, collect([tracked]))
    c = final.outputs[0]
    output.feed(CompletionOutput(c.index, c.text, c.token_ids, delta_text=c.text,
                                 finish_reason=c.finish_reason))  # fmt: skip
    body = _body(head, output, final)
    _finish(ctx, req, conv, body, output)
    return body


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str) -> dict[str, Any]:
    return server_context(request).responses.get(response_id)[0]


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> dict[str, Any]:
    server_context(request).responses.delete(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}
