"""OpenAI's Responses API as a translation to the chat request sluice already serves,
and the bounded store behind ``previous_response_id``.

A ``/v1/responses`` body (``instructions``, ``input`` as a string or items: messages,
``function_call`` and ``function_call_output`` items; function tools; ``text.format``)
becomes a ``ChatCompletionRequest``, so rendering, tool grammars, structured output and
sampling are the chat endpoint's own. With ``store`` (OpenAI's default), the finished
conversation is kept under the response's id, in memory and bounded (oldest dropped
first), so the next turn can send only what is new with ``previous_response_id``; as
in OpenAI's API, the earlier turn's ``instructions`` do not carry over.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from typing import Any

from pydantic import BaseModel, ConfigDict

from sluice.server.errors import OpenAIError, bad_request, json_kind, unsupported
from sluice.server.protocol import ChatCompletionRequest

# Responses kept for previous_response_id and GET; each holds its conversation's text.
MAX_STORED = 1024

_ROLES = frozenset({"user", "assistant", "system", "developer"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


class ResponsesRequest(BaseModel):
    """The fields of a Responses request that sluice reads; others are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    # vLLM's extension, for reasoning models' templates (enable_thinking...).
    chat_template_kwargs: dict[str, Any] | None = None


class ResponseStore:
    """Finished responses by id (their body, and the conversation they end), bounded."""

    def __init__(self, capacity: int = MAX_STORED) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, body: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[body["id"]] = (body, conversation)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        with self._lock:
            item = self._items.get(response_id)
        if item is None:
            raise OpenAIError(
                404,
                f"no stored response with id {response_id!r} (responses are kept in memory, "
                f"the last {self.capacity}, and only with store=true)",
                param="previous_response_id",
                code="response_not_found",
            )
        return item

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        with self._lock:
            self._items.pop(response_id, None)


def _part_text(where: str, part: Any) -> str:
    if not isinstance(part, dict):
        raise bad_request(where, f"{where} must be an object, got {json_kind(part)}")
    kind = part.get("type")
    if kind not in _TEXT_PARTS:
        raise unsupported(f"{where}.type", f"content type {kind!r} (only text)")
    text = part.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}.text", f"{where}.text must be a string")
    return text


def _message(where: str, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(f"{where}.role", f"{where}.role must be one of {sorted(_ROLES)}")
    content = item.get("content")
    if isinstance(content, list):
        content = "\n".join(_part_text(f"{where}.content[{j}]", p) for j, p in enumerate(content))
    elif not isinstance(content, str):
        raise bad_request(f"{where}.content", f"{where}.content must be a string or a list")
    return {"role": "system" if role == "developer" else role, "content": content}


def _call_id(where: str, item: dict[str, Any]) -> str:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"{where}.call_id", f"{where}.call_id must be a string")
    return call_id


def _items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive function calls join one assistant turn."""
    conv: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(where, f"{where} must be an object, got {json_kind(item)}")
        kind = item.get("type", "message")
        if kind == "message":
            conv.append(_message(where, item))
        elif kind == "function_call":
            function = {"name": item.get("name"), "arguments": item.get("arguments")}
            call = {"id": _call_id(where, item), "type": "function", "function": function}
            if conv and conv[-1]["role"] == "assistant" and "tool_calls" in conv[-1]:
                conv[-1]["tool_calls"].append(call)
            else:
                conv.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = "\n".join(
                    _part_text(f"{where}.output[{j}]", p) for j, p in enumerate(output or [])
                )
            conv.append({"role": "tool", "tool_call_id": _call_id(where, item), "content": output})
        elif kind == "reasoning":
            continue  # a model's earlier thinking is not fed back
        else:
            raise unsupported(f"{where}.type", f"input item type {kind!r}")
    return conv


def _tool(i: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise bad_request(where, f"{where} must be an object, got {json_kind(tool)}")
    if tool.get("type") != "function":  # web_search, file_search, ...: OpenAI's own
        raise unsupported(f"{where}.type", f"the built-in tool {tool.get('type')!r}")
    keys = ("name", "description", "parameters", "strict")
    return {"type": "function", "function": {k: tool[k] for k in keys if k in tool}}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: dict[str, Any] | None) -> Any:
    """``text.format`` as chat's response_format (a schema sits beside its name here)."""
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return fmt
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def conversation(req: ResponsesRequest, earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of this turn: the stored conversation, then the input."""
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    conv = [*copy.deepcopy(earlier), *_items(items)]
    if req.instructions:
        conv.insert(0, {"role": "system", "content": req.instructions})
    if not conv:
        raise bad_request("input", "input must not be empty")
    return conv


def to_chat_request(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": None if req.tools is None else [_tool(i, t) for i, t in enumerate(req.tools)],
        "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text),
        "stream": req.stream,
        "chat_template_kwargs": req.chat_template_kwargs,
    }
    return ChatCompletionRequest.model_validate(body)


def echo_fields(req: ResponsesRequest) -> dict[str, Any]:
    """The request's settings a Response object repeats."""
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "text": {"format": fmt},
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
    }
