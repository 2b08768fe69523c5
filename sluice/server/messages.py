"""Chat messages to prompt token ids, through the model's chat template.

Shared by /v1/chat/completions and /tokenize, so both count the same tokens. Each
message is checked field by field, and what sluice does not support (tools, images,
audio...) is a 400 that says so rather than being silently dropped.
"""

from __future__ import annotations

from typing import Any

from sluice.server.context import ServerContext
from sluice.server.errors import bad_request, unsupported
from sluice.server.protocol import ChatCompletionRequest

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant"})


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _content_part(where: str, part: Any) -> str:
    if not isinstance(part, dict):
        raise bad_request(where, f"{where} must be an object, got {_kind(part)}")
    kind = part.get("type")
    if kind != "text":
        if isinstance(kind, str) and kind:
            raise unsupported(f"{where}.type", f"content part type {kind!r} (only 'text')")
        raise bad_request(f"{where}.type", f"{where}.type must be 'text'")
    text = part.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}.text", f"{where}.text must be a string, got {_kind(text)}")
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
            where, f"{where} must be a string or a list of content parts, got {_kind(content)}"
        )
    return "\n".join(_content_part(f"{where}[{j}]", part) for j, part in enumerate(content))


def _message(i: int, msg: dict[str, Any]) -> dict[str, str]:
    role = msg.get("role")
    where = f"messages[{i}].role"
    if not isinstance(role, str):
        raise bad_request(where, f"{where} must be a string, got {_kind(role)}")
    if role not in CHAT_ROLES:
        raise bad_request(
            where,
            f"unsupported role {role!r} in messages[{i}]; sluice supports "
            f"{', '.join(sorted(CHAT_ROLES))}",
        )
    if msg.get("tool_calls"):
        raise unsupported(f"messages[{i}].tool_calls", "tool calling")
    text = message_text(i, role, msg.get("content"))
    # Chat templates know "system"; "developer" is OpenAI's newer name for it.
    return {"role": "system" if role == "developer" else role, "content": text}


def render_chat(
    ctx: ServerContext, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> list[int]:
    if not messages:
        raise bad_request("messages", "messages must be a non-empty list")
    conv = [_message(i, msg) for i, msg in enumerate(messages)]
    try:
        rendered = ctx.tokenizer.apply_chat_template(
            conv, add_generation_prompt=add_generation_prompt
        )
    except Exception as exc:  # the template's own raise_exception() or a Jinja error
        raise bad_request("messages", f"the chat template rejected the messages: {exc}") from None
    ids = ctx.tokenizer.encode(rendered, add_special_tokens=False)
    if not ids:
        raise bad_request("messages", "the messages render to an empty prompt")
    return ids


def check_chat_unsupported(req: ChatCompletionRequest) -> None:
    if req.tools:
        raise unsupported("tools", "tool calling")
    if req.functions:
        raise unsupported("functions", "function calling")
    if req.tool_choice not in (None, "none"):
        raise unsupported("tool_choice", "tool calling")
    if req.function_call not in (None, "none"):
        raise unsupported("function_call", "function calling")
    if req.audio is not None:
        raise unsupported("audio", "audio output")
    if req.modalities is not None and req.modalities != ["text"]:
        raise unsupported("modalities", "an output modality other than text")
    if req.prediction is not None:
        raise unsupported("prediction", "predicted outputs")
