"""The sandbox chat templates run in: a template ships inside a model file, so it is
untrusted code.

Jinja's immutable sandbox already keeps a template from reaching Python's internals
or mutating what it is given (SGLang's CVE-2026-5760 rendered GGUF templates outside
one). More bounds make it safe to render on a server:
- time: a render may run at most ``MAX_TEMPLATE_STEPS`` lines of the template's compiled
  code (nested loops over ``range(100000)`` would otherwise run for hours), and a
  template that recurses without end stops at Python's recursion limit;
- memory: no value the template builds (a string, list or dict) may pass
  ``MAX_VALUE_LENGTH`` items, checked before the work where one call can multiply its
  input (``'x' * 10**10``, ``'x'|center(10**9)``, ``s|replace('x', s)``, a format
  width of 10**9, ``tojson(indent=10**9)``) and after every operator, call and ``~``
  otherwise, so doubling a value in a loop stops at the bound; the rendered text may
  not pass it either; ``lipsum``, which builds text by the paragraph, is gone.
Each is a ``jinja2.TemplateError``, and so is any other error the template's own code
raises (a division by zero, a type error): the caller turns it into a 400 (server).
"""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Callable, Iterable
from datetime import datetime
from types import FrameType
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import _PassArg

# A long conversation with tools renders in tens of thousands of template lines; a
# million takes ~0.5 s, so this stops a runaway template within a second or two.
MAX_TEMPLATE_STEPS = 2_000_000
MAX_VALUE_LENGTH = 10_000_000
MAX_EXPONENT = 1_000
MAX_JSON_INDENT = 64  # tojson's indent: a nested value's lines grow by it per level
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


def _length(value: Any) -> int:
    """How many items a value holds (characters of a string); 0 for scalars."""
    return len(value) if isinstance(value, str | list | tuple | dict) else 0


def _refuse_past_bound(items: int, what: str) -> None:
    if items > MAX_VALUE_LENGTH:
        raise SecurityError(f"the chat template builds a value of {items:,} items ({what})")


def _checked(value: Any, what: str) -> Any:
    """value, unless it is past MAX_VALUE_LENGTH items."""
    _refuse_past_bound(_length(value), what)
    return value


def _format_size(fmt: str, args: Iterable[Any]) -> int:
    """An upper bound on a %- or {}-format's output: every number in the format string
    taken as a width (a width of 10**9 is 10**9 characters), plus the arguments."""
    widths = sum(int(d) for d in re.findall(r"\d+", fmt))
    return len(fmt) + widths + sum(len(str(a)) for a in args)


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) else default


# What one call of a str method or filter of this name can build, from its string (or
# sequence) and its arguments (after the value): the callables that multiply their
# input. Each is a bound taken before the call does the work.
def _replace_size(s: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> int:
    old, new = [*args, "", ""][:2]
    count = _int(args[2] if len(args) > 2 else kw.get("count"), -1)
    n = str(s).count(str(old)) if old else len(str(s)) + 1
    return len(str(s)) + (n if count < 0 else min(n, count)) * len(str(new))


def _pad_size(s: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> int:
    return max(len(str(s)), _int(args[0] if args else kw.get("width"), 0))


def _tabs_size(s: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> int:
    tab = _int(args[0] if args else kw.get("tabsize"), 8)
    return len(str(s)) + str(s).count("\t") * tab


def _indent_size(s: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> int:
    width = args[0] if args else kw.get("width", 4)
    per_line = len(width) if isinstance(width, str) else _int(width, 4)
    return len(str(s)) + (str(s).count("\n") + 1) * per_line


def _wrap_size(s: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> int:
    width = max(_int(args[0] if args else kw.get("width"), 79), 1)
    wrap = args[2] if len(args) > 2 else kw.get("wrapstring")
    return len(str(s)) + (len(str(s)) // width + 1) * len(str(wrap or "\n"))


def _chunks_size(s: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> int:
    return _length(s) + _int(args[0] if args else 0, 0)  # slice's slices, batch's size


def _format_filter_size(s: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> int:
    return _format_size(str(s), [*args, *kw.values()])


def _json_size(s: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> int:
    indent = args[1] if len(args) > 1 else kw.get("indent")
    if isinstance(indent, int) and indent > MAX_JSON_INDENT:
        raise SecurityError(f"the chat template asks tojson for an indent of {indent:,}")
    return 0  # its output is checked after the call


Bound = Callable[[Any, tuple[Any, ...], dict[str, Any]], int]
STR_METHOD_BOUNDS: dict[str, Bound] = {
    "replace": _replace_size, "center": _pad_size, "ljust": _pad_size,
    "rjust": _pad_size, "zfill": _pad_size, "expandtabs": _tabs_size,
}  # fmt: skip
FILTER_BOUNDS: dict[str, Bound] = {
    "replace": _replace_size, "center": _pad_size, "indent": _indent_size,
    "wordwrap": _wrap_size, "slice": _chunks_size, "batch": _chunks_size,
    "format": _format_filter_size, "tojson": _json_size,
}  # fmt: skip


def _joined(value: Any, sep: Any) -> list[Any]:
    """A join's items as a list, refused when their text and separators would pass the
    bound (items may be a generator: it is run once, here)."""
    items = list(value)  # a dict's keys, as iterating it (and so joining it) gives
    total = len(str(sep)) * max(len(items) - 1, 0)
    for item in items:
        total += len(item) if isinstance(item, str) else len(str(item))
        _refuse_past_bound(total, "join")
    return items


def _bounded_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """A filter that refuses to build a value past the bound, before (FILTER_BOUNDS)
    and after the call."""
    lead = 0 if _PassArg.from_obj(fn) is None else 1  # its context/environment argument
    bound = FILTER_BOUNDS.get(name)

    @functools.wraps(fn)  # keeps jinja's pass-argument mark
    def bounded(*args: Any, **kwargs: Any) -> Any:
        if len(args) > lead:
            value, rest = args[lead], args[lead + 1 :]
            if name == "join":
                sep = rest[0] if rest else kwargs.get("d", "")
                args = (*args[:lead], _joined(value, sep), *rest)
            elif bound is not None:
                _refuse_past_bound(bound(value, rest, kwargs), name)
        return _checked(fn(*args, **kwargs), name)

    return bounded


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator, with each ``~`` concatenation's result checked."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        self.write("environment.checked_concat(")
        super().visit_Concat(node, frame)
        self.write(")")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox (no attribute access to internals, no mutation, ranges of
    at most 100,000) that also refuses to build values past MAX_VALUE_LENGTH items: the
    sandbox leaves ``*``, ``**``, ``+``, ``%``, ``~`` and what calls build alone."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _BoundedCodeGenerator

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(right, int) and abs(right) > MAX_EXPONENT:
            raise SecurityError(f"the chat template raises to the power {right}")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(n, int):
                    _refuse_past_bound(len(seq) * n, "*")
        if operator == "%" and isinstance(left, str):
            args = right if isinstance(right, tuple) else (right,)
            _refuse_past_bound(_format_size(left, args), "%")
        return _checked(super().call_binop(context, operator, left, right), operator)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        receiver, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
        if isinstance(receiver, str) and name in STR_METHOD_BOUNDS:
            _refuse_past_bound(STR_METHOD_BOUNDS[name](receiver, args, kwargs), name)
        if isinstance(receiver, str) and name == "join" and args:
            args = (_joined(args[0], receiver), *args[1:])
        result = super().call(__context, __obj, *args, **kwargs)
        return _checked(result, name or "a call")

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__

        def bounded(*args: Any, **kwargs: Any) -> str:
            values = [*args, *kwargs.values()]
            _refuse_past_bound(_format_size(fmt, values), "format")
            return wrapped(*args, **kwargs)

        return bounded

    def checked_concat(self, value: str) -> str:
        _refuse_past_bound(len(value), "~")
        return value


def environment() -> ImmutableSandboxedEnvironment:
    """The Jinja environment chat templates run in: transformers' settings and helpers."""
    env = _BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    for name, fn in list(env.filters.items()):
        env.filters[name] = _bounded_filter(name, fn)
    env.globals.pop("lipsum", None)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def compile_chat_template(template: str) -> jinja2.Template:
    """A chat template ready to render; jinja2.TemplateSyntaxError if it is not one."""
    return environment().from_string(template)


class TemplateBudgetError(jinja2.exceptions.TemplateError):
    """A template that ran past MAX_TEMPLATE_STEPS or rendered past MAX_VALUE_LENGTH."""


def render_bounded(template: jinja2.Template, variables: dict[str, Any]) -> str:
    """`template` rendered with `variables`, stopped after MAX_TEMPLATE_STEPS lines of its
    own code (only frames of the template are traced, so the cost is per template line)
    or once its text passes MAX_VALUE_LENGTH characters. Every failure is a
    jinja2.TemplateError."""
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
        parts, length = [], 0
        for part in template.generate(**variables):
            length += len(part)
            if length > MAX_VALUE_LENGTH:
                raise TemplateBudgetError(
                    f"the chat template renders more than {MAX_VALUE_LENGTH:,} characters"
                )
            parts.append(part)
        return "".join(parts)
    except RecursionError:
        raise jinja2.exceptions.TemplateError("the chat template recursed without end") from None
    except jinja2.exceptions.TemplateError:
        raise
    except Exception as exc:  # the template's own code failed: 1 / 0, "a" < 1, ...
        raise jinja2.exceptions.TemplateError(
            f"the chat template failed: {type(exc).__name__}: {exc}"
        ) from None
    finally:
        sys.settrace(previous)
