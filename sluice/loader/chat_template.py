"""The chat template to use instead of the model's own (EngineConfig.chat_template).

As vLLM's ``--chat-template``: a file, the template text itself, or the name of a
template shipped in ``sluice/templates`` (``hermes_tools``: ChatML with Hermes-style
tool calls, so that a model whose own template ignores ``tools`` can be served with
tool calling). It is resolved and compiled once at start-up, so a wrong path or a
syntax error is a ConfigError naming ``chat_template`` before the model loads, not a
400 on every request.
"""

from __future__ import annotations

from pathlib import Path

import jinja2

from sluice.core.errors import ConfigError

from .chat_sandbox import compile_chat_template

TEMPLATES_DIR = Path(__file__).resolve().parents[1] / "templates"
_FIELD = "chat_template"


def bundled_templates() -> dict[str, Path]:
    """The templates sluice ships, by name (the file's stem)."""
    return {p.stem: p for p in sorted(TEMPLATES_DIR.glob("*.jinja"))}


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(_FIELD, f"cannot read the chat template {path}: {exc}") from None


def resolve_chat_template(value: str) -> str:
    """The template text `value` names; ConfigError if it names none or does not compile."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(_FIELD, f"{_FIELD} must be a non-empty string, got {value!r}")
    bundled = bundled_templates()
    path = Path(value).expanduser()
    if value in bundled:
        text = _read(bundled[value])
    elif "{{" in value or "{%" in value:
        text = value
    elif path.is_file():
        text = _read(path)
    else:
        raise ConfigError(
            _FIELD,
            f"{_FIELD} {value!r} is neither a file, nor template text (it has no '{{{{' or "
            f"'{{%'), nor a bundled template ({', '.join(bundled) or 'none'})",
        )
    try:
        compile_chat_template(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(
            _FIELD, f"the chat template does not compile: {exc.message} (line {exc.lineno})"
        ) from None
    return text
