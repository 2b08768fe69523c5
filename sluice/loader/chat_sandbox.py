"""The sandbox chat templates run in: a template ships inside a model file, so it is
untrusted code.

Jinja's immutable sandbox already keeps a template from reaching Python's internals
or mutating what it is given (SGLang's CVE-2026-5760 rendered GGUF templates outside
one). Two more bounds make it safe to render on a server: values cannot be built past
``MAX_VALUE_LENGTH`` items (``"x" * 10**10``), and a render may run at most
``MAX_TEMPLATE_STEPS`` lines of the template's compiled code (nested loops over
``range(100000)`` would otherwise run for hours). A template that recurses without
end stops at Python's recursion limit. Each is a ``jinja2.TemplateError`` the caller
turns into a 400 (server) or a ValueError naming the template (Python).
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from types import FrameType
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# A long conversation with tools renders in tens of thousands of template lines; a
# million takes ~0.5 s, so this stops a runaway template within a second or two.
MAX_TEMPLATE_STEPS = 2_000_000
MAX_VALUE_LENGTH = 10_000_000
MAX_EXPONENT = 1_000
_TEMPLATE_FILE = "<template>"  # the file name Jinja gives code compiled from a string


class _GenerationTag(jinja2.ext.Extension):
    """HF templates may mark assistant text with {% generation %}...{% endgeneration %}; for
    rendering it is a no-op block."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's API is a class attribute

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's builtin tojson HTML-escapes; HF's does not, and templates expect HF's.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox (no attribute access to internals, no mutation, ranges of
    at most 100,000) that also refuses to build huge values: ``"x" * 10**10`` would
    allocate 10 GB, and the sandbox leaves ``*`` and ``**`` alone by default."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(right, int) and abs(right) > MAX_EXPONENT:
            raise SecurityError(f"the chat template raises to the power {right}")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(n, int):
                    if len(seq) * n > MAX_VALUE_LENGTH:
                        raise SecurityError(
                            f"the chat template builds a value of {len(seq) * n:,} items"
                        )
        return super().call_binop(context, operator, left, right)


def environment() -> ImmutableSandboxedEnvironment:
    """The Jinja environment chat templates run in: transformers' settings and helpers."""
    env = _BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def compile_chat_template(template: str) -> jinja2.Template:
    """A chat template ready to render; jinja2.TemplateSyntaxError if it is not one."""
    return environment().from_string(template)


class TemplateBudgetError(jinja2.exceptions.TemplateError):
    """A template that ran past MAX_TEMPLATE_STEPS."""


def render_bounded(template: jinja2.Template, variables: dict[str, Any]) -> str:
    """`template` rendered with `variables`, stopped after MAX_TEMPLATE_STEPS lines of its
    own code (only frames of the template are traced, so the cost is per template line)."""
    steps = 0

    def count(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal steps
        if event == "line":
            steps += 1
            if steps > MAX_TEMPLATE_STEPS:
                raise TemplateBudgetError(
                    f"the chat template ran more than {MAX_TEMPLATE_STEPS:,} steps "
                    "(a loop that does not end?)"
                )
        return count

    def enter(frame: FrameType, event: str, arg: Any) -> Any:
        return count if frame.f_code.co_filename == _TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(enter)
    try:
        return template.render(**variables)
    except RecursionError:
        raise jinja2.exceptions.TemplateError("the chat template recursed without end") from None
    finally:
        sys.settrace(previous)
