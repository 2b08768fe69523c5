"""Chat messages to prompt token ids, through the model's chat template.

Shared by /v1/chat/completions and /tokenize, so both count the same tokens. Each
message is checked field by field, and what sluice does not support (images, audio...)
is a 400 that says so rather than being silently dropped. Tool calls in assistant
messages reach the template as transformers passes them: ``function.arguments`` an
object, not OpenAI's JSON string, since templates render it with ``tojson``.
"""

from __future__ import annotations

import json
from typing import Any

from sluice.server.context import ServerContext
from sluice.server.errors import bad_request, json_kind, require_type, unsupported
from sluice.server.protocol import ChatCompletionRequest
from sluice.server.validation import check_text_length

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def _content_part(where: str, part: Any) -> str:
    if not isinstance(part, dict):
        raise bad_request(where, f"{where} must be an object, got {json_kind(part)}")
    require_type(where, part, "text", "content part type")
    text = part.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}.text", f"{where}.text must be a string, got {json_kind(text)}")
    return text


def message_text(index: int, role: str, content: Any) -> str:
    where = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if content is None:
        if role == "assistant":
            return ""
        raise bad_request(where, f"{where} is required for role '{role}'")
    if not isinstance(content, list):
        raise bad_request(
            where, f"{where} must be a string or a list of content parts, got {json_kind(content)}"
        )
    return "\n".join(_content_part(f"{where}[{j}]", part) for j, part in enumerate(content))


def _arguments(where: str, value: Any) -> dict[str, Any]:
    """A call's arguments as an object; OpenAI sends them as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise bad_request(where, f"{where} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise bad_request(where, f"{where} must be a JSON object, got {json_kind(value)}")
    return value


def _tool_call(where: str, call: Any) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise bad_request(where, f"{where} must be an object, got {json_kind(call)}")
    if call.get("type", "function") != "function":
        raise bad_request(f"{where}.type", f"{where}.type must be 'function'")
    if not isinstance(call.get("id", ""), str):
        raise bad_request(f"{where}.id", f"{where}.id must be a string")
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise bad_request(f"{where}.function", f"{where}.function must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.function.name", f"{where}.function.name must be a string")
    arguments = _arguments(f"{where}.function.arguments", fn.get("arguments"))
    function = {"name": name, "arguments": arguments}
    return {"id": call.get("id"), "type": "function", "function": function}


def _tool_fields(i: int, role: str, msg: dict[str, Any]) -> dict[str, Any]:
    """An assistant's tool_calls, or a tool result's tool_call_id (and name)."""
    fields: dict[str, Any] = {}
    calls = msg.get("tool_calls")
    if calls is not None:
        where = f"messages[{i}].tool_calls"
        if role != "assistant":
            raise bad_request(where, f"{where} is only allowed in assistant messages")
        if not isinstance(calls, list):
            raise bad_request(where, f"{where} must be a list, got {json_kind(calls)}")
        if calls:
            fields["tool_calls"] = [_tool_call(f"{where}[{j}]", c) for j, c in enumerate(calls)]
    if role == "tool":
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str):
            where = f"messages[{i}].tool_call_id"
            raise bad_request(where, f"{where} (a string) is required for role 'tool'")
        fields["tool_call_id"] = call_id
        if isinstance(msg.get("name"), str):
            fields["name"] = msg["name"]
    return fields


def _message(i: int, msg: dict[str, Any]) -> dict[str, Any]:
    role = msg.get("role")
    where = f"messages[{i}].role"
    if not isinstance(role, str):
        raise bad_request(where, f"{where} must be a string, got {json_kind(role)}")
    if role not in CHAT_ROLES:
        raise bad_request(
            where,
            f"unsupported role {role!r} in messages[{i}]; sluice supports "
            f"{', '.join(sorted(CHAT_ROLES))}",
        )
    text = message_text(i, role, msg.get("content"))
    # Chat templates know "system"; "developer" is OpenAI's newer name for it.
    message = {"role": "system" if role == "developer" else role, "content": text}
    return message | _tool_fields(i, role, msg)


# Template variables the server sets itself, which chat_template_kwargs may not replace.
_RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def _template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    for key in kwargs or {}:
        if key in _RESERVED:
            where = f"chat_template_kwargs.{key}"
            raise bad_request(where, f"{where}: '{key}' is set by the server, not by a request")
    return dict(kwargs or {})


def render_chat(
    ctx: ServerContext,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt ids of `messages` (and `tools`, given only to a template that reads
    them: tools.tool_plan checks that; `template_kwargs` are more template variables,
    such as enable_thinking)."""
    if not messages:
        raise bad_request("messages", "messages must be a non-empty list")
    conv = [_message(i, msg) for i, msg in enumerate(messages)]
    extra = _template_kwargs(template_kwargs)
    if tools is not None:
        extra["tools"] = tools
    try:
        rendered = ctx.tokenizer.apply_chat_template(
            conv, add_generation_prompt=add_generation_prompt, **extra
        )
    except Exception as exc:  # the template's own raise_exception() or a Jinja error
        raise bad_request("messages", f"the chat template rejected the messages: {exc}") from None
    check_text_length(ctx, rendered, "messages")
    ids = ctx.tokenizer.encode(rendered, add_special_tokens=False)
    if not ids:
        raise bad_request("messages", "the messages render to an empty prompt")
    return ids


def check_chat_unsupported(req: ChatCompletionRequest) -> None:
    # tools, tool_choice and parallel_tool_calls are tools.py's; the deprecated
    # functions / function_call are not supported.
    if req.functions:
        raise unsupported("functions", "functions (deprecated; use tools)")
    if req.function_call not in (None, "none"):
        raise unsupported("function_call", "function calling")
    if req.audio is not None:
        raise unsupported("audio", "audio output")
    if req.modalities is not None and req.modalities != ["text"]:
        raise unsupported("modalities", "an output modality other than text")
    if req.prediction is not None:
        raise unsupported("prediction", "predicted outputs")
