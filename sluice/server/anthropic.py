"""Anthropic's Messages API as a translation to the chat request sluice already serves.

A ``/v1/messages`` body becomes a ``ChatCompletionRequest`` (system prompt, messages,
tools and tool_choice in OpenAI's shapes), so rendering, tool grammars, sampling and
length checks are the chat endpoint's own; what comes back is turned into Anthropic's
content blocks here. Content blocks are checked with Anthropic's paths in the messages
(``messages[1].content[0].tool_use_id``); what a local server cannot do (images,
documents, Anthropic's server-side tools) is a 400 that says so, and request fields
that only mean something on Anthropic's service (``metadata``, ``service_tier``,
``cache_control``, ...) are accepted and ignored.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from sluice.server.errors import bad_request, json_kind, unsupported
from sluice.server.protocol import ChatCompletionRequest

# Anthropic's stop_reason for each finish_reason (tool calls and stop strings aside).
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "abort": "end_turn"}


class MessagesRequest(BaseModel):
    """The fields of a Messages request that sluice reads; others are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: int
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    # Structured output: {"format": {"type": "json_schema", "schema": ...}} (and the
    # beta's older top-level output_format); the rest of output_config (effort) is ignored.
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None


class CountTokensRequest(BaseModel):
    """``/v1/messages/count_tokens``: the prompt part of a Messages request."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


def _text_of(where: str, block: Any) -> str:
    if not isinstance(block, dict):
        raise bad_request(where, f"{where} must be a content block, got {json_kind(block)}")
    if block.get("type") != "text":
        kind = block.get("type")
        raise unsupported(f"{where}.type", f"content block type {kind!r} here (only 'text')")
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}.text", f"{where}.text must be a string")
    return text


def _texts(where: str, content: Any) -> str:
    """A string, or a list of text blocks joined (system prompts, tool results)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(where, f"{where} must be a string or a list of text blocks")
    return "\n".join(_text_of(f"{where}[{j}]", b) for j, b in enumerate(content))


def _tool_use(where: str, block: dict[str, Any]) -> dict[str, Any]:
    """An assistant's tool_use block as an OpenAI tool call."""
    call_id, name, args = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not isinstance(name, str) or not name:
        raise bad_request(where, f"{where} needs a string 'id' and 'name'")
    if not isinstance(args, dict):
        raise bad_request(f"{where}.input", f"{where}.input must be an object")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _tool_result(where: str, block: dict[str, Any]) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise bad_request(f"{where}.tool_use_id", f"{where}.tool_use_id must be a string")
    content = block.get("content", "")
    text = _texts(f"{where}.content", content)
    if block.get("is_error") is True:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}


# Blocks a model's earlier turn may carry that the template has no place for: its
# thinking is not fed back (the reasoning templates drop it too).
_DROPPED = frozenset({"thinking", "redacted_thinking"})


def _message(i: int, msg: Any) -> list[dict[str, Any]]:
    """One Anthropic message as one or more chat messages: a user turn's tool results
    become tool messages (ahead of its text), an assistant's tool_use blocks calls."""
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise bad_request(where, f"{where} must be an object, got {json_kind(msg)}")
    role = msg.get("role")
    if role not in ("user", "assistant"):
        raise bad_request(f"{where}.role", f"{where}.role must be 'user' or 'assistant'")
    content = msg.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content", f"{where}.content must be a string or a list")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(at, block))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(at, block))
        elif kind in _DROPPED and role == "assistant":
            continue
        else:
            texts.append(_text_of(at, block))
    out = list(results)
    if texts or calls or not results:
        turn: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


def _tool(i: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise bad_request(where, f"{where} must be an object, got {json_kind(tool)}")
    kind = tool.get("type", "custom")
    if kind != "custom":  # web_search_..., bash_..., Anthropic's own tools
        raise unsupported(f"{where}.type", f"the server tool {kind!r} (only custom tools)")
    if "input_schema" not in tool:
        raise bad_request(f"{where}.input_schema", f"{where}.input_schema is required")
    function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if "description" in tool:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(OpenAI's tool_choice, parallel_tool_calls) for Anthropic's tool_choice."""
    if choice is None:
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") is True else None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise bad_request("tool_choice.type", "tool_choice.type must be auto, any, tool or none")


def _response_format(req: MessagesRequest) -> Any:
    """Anthropic's output format as chat's response_format (None: plain text)."""
    fmt = (req.output_config or {}).get("format", req.output_format)
    if fmt is None:
        return None
    where = "output_config.format"
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad_request(f"{where}.type", f"{where}.type must be 'json_schema'")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.get("schema")}}


def thinking_enabled(thinking: dict[str, Any] | None) -> bool | None:
    """Whether the request turns thinking on (True), off (False) or leaves it (None)."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad_request("thinking.type", "thinking.type must be 'enabled' or 'disabled'")
    return bool(kind != "disabled")


def chat_messages(
    system: str | list[dict[str, Any]] | None, messages: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The system prompt and messages as chat messages."""
    if not messages:
        raise bad_request("messages", "messages must be a non-empty list")
    conv: list[dict[str, Any]] = []
    if system is not None:
        text = _texts("system", system)
        if text:
            conv.append({"role": "system", "content": text})
    for i, msg in enumerate(messages):
        conv.extend(_message(i, msg))
    return conv


def to_chat_request(req: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that does what `req` asks (count_tokens: its prompt part)."""
    tool_choice, parallel = _tool_choice(req.tool_choice)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req.system, req.messages),
        "tools": None if req.tools is None else [_tool(i, t) for i, t in enumerate(req.tools)],
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
    }
    thinking = thinking_enabled(req.thinking)
    if thinking is not None:  # Qwen3's templates read it
        body["chat_template_kwargs"] = {"enable_thinking": thinking}
    if isinstance(req, MessagesRequest):
        body |= {
            "max_tokens": req.max_tokens,
            "stream": req.stream,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "stop": req.stop_sequences,
            "response_format": _response_format(req),
        }
    return ChatCompletionRequest.model_validate(body)


def tool_use_id(call_id: str) -> str:
    """Anthropic's id for a call sluice named ``call_...``."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic sends; a call cut off by max_tokens
    may not be JSON yet, and is then an empty object (its stop_reason says max_tokens)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(finish: str | None, stop: str | int | None, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for an output that ended with `finish`."""
    if finish == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    if called and finish == "stop":
        return "tool_use", None
    return STOP_REASONS.get(finish or "stop", "end_turn"), None
