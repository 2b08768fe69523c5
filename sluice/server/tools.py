"""Tool calling's request side: ``tools``, ``tool_choice`` and ``parallel_tool_calls``
checked field by field (errors name ``tools[0].function.parameters``...) and turned
into a plan: which tools the chat template renders, whether the output is parsed for
calls, and the grammar that enforces a call when one is required.

``tool_choice``:

- ``"none"``: the tools are neither rendered nor parsed, so the model is never shown
  functions it may not call, and a template without tool support can still serve the
  request (vLLM renders them anyway).
- ``"auto"`` (the default when there are tools): rendered, and the output parsed for
  calls; nothing is constrained. ``parallel_tool_calls: false`` keeps the first call.
- ``"required"``: a grammar makes the output one or more calls (exactly one with
  ``parallel_tool_calls: false``) of the given functions, each with arguments that
  match its parameters' schema.
- ``{"type": "function", "function": {"name": ...}}``: exactly one call of that one.

Every parameters schema is compiled here (llguidance, no tokenizer needed, well under a
millisecond), even for ``auto``, so a schema that can never be enforced is a 400 up
front rather than a surprise the day a client switches to ``required``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llguidance

from sluice.core.sampling_params import SamplingParams
from sluice.core.structured_output import StructuredOutput
from sluice.server.context import ServerContext
from sluice.server.errors import bad_request, json_kind, require_type
from sluice.server.protocol import ChatCompletionRequest
from sluice.server.structured import check_compiles
from sluice.server.tool_calls import (
    FORMATS,
    FunctionSpec,
    ToolCallFormat,
    ToolCallParser,
    with_json_format,
)

# OpenAI's rule for function names; it also keeps them safe inside a grammar's literal.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CHOICES = ("none", "auto", "required")


def call_format(ctx: ServerContext) -> ToolCallFormat:
    """How the served model writes calls (tool_calls.FORMATS): harmony's messages where
    its replies are harmony (gpt-oss), else Hermes's blocks."""
    harmony = ctx.reasoning is not None and ctx.reasoning.harmony
    return FORMATS["harmony" if harmony else "hermes"]


@dataclass
class ToolPlan:
    """What a chat request's tools mean for rendering, sampling and the response."""

    tools: list[dict[str, Any]] | None = None  # for the chat template; None: not rendered
    new_parser: Callable[[], ToolCallParser] | None = None  # None: the output is text
    constraint: StructuredOutput | None = None


def check_schema(where: str, schema: Any) -> None:
    """A 400 naming `where` unless `schema` is a JSON Schema llguidance can enforce."""
    if not isinstance(schema, dict):
        raise bad_request(where, f"{where} must be a JSON Schema object, got {json_kind(schema)}")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(with_json_format(schema))
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError) as exc:
        error = str(exc)
    if error:
        raise bad_request(where, f"{where} is not a JSON Schema sluice can enforce: {error}")


def _function(i: int, tool: Any) -> FunctionSpec:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise bad_request(where, f"{where} must be an object, got {json_kind(tool)}")
    require_type(where, tool, "function", "tool type")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise bad_request(f"{where}.function", f"{where}.function must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(
            f"{where}.function.name",
            f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
        )
    if not isinstance(fn.get("description", ""), str):
        raise bad_request(f"{where}.function.description", "a description must be a string")
    if not isinstance(fn.get("strict", False), bool | None):
        raise bad_request(f"{where}.function.strict", "strict must be a boolean")
    parameters = fn.get("parameters")
    if parameters is None:  # OpenAI: no parameters means an empty argument list
        parameters = {"type": "object", "properties": {}}
    check_schema(f"{where}.function.parameters", parameters)
    return FunctionSpec(name, parameters)


def _functions(tools: Any) -> list[FunctionSpec]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request("tools", f"tools must be a list of tools, got {json_kind(tools)}")
    functions = [_function(i, tool) for i, tool in enumerate(tools)]
    seen: set[str] = set()
    for i, fn in enumerate(functions):
        if fn.name in seen:
            where = f"tools[{i}].function.name"
            raise bad_request(where, f"{where}: the function {fn.name!r} is defined twice")
        seen.add(fn.name)
    return functions


def _choice(value: Any, functions: list[FunctionSpec]) -> str:
    """'none', 'auto', 'required' or ':<name>' for a named function."""
    if value is None:
        return "auto" if functions else "none"
    if isinstance(value, str):
        if value not in _CHOICES:
            raise bad_request(
                "tool_choice",
                f"tool_choice must be one of 'none', 'auto', 'required' or "
                f'{{"type": "function", "function": {{"name": ...}}}}, got {value!r}',
            )
        choice = value
    else:
        choice = ":" + _named_choice(value, functions)
    if choice not in ("none", "auto") and not functions:
        raise bad_request("tool_choice", f"tool_choice {value!r} needs a non-empty tools list")
    return choice


def _named_choice(value: Any, functions: list[FunctionSpec]) -> str:
    if not isinstance(value, dict) or value.get("type") != "function":
        raise bad_request(
            "tool_choice",
            'tool_choice must be a string or {"type": "function", "function": {"name": ...}}',
        )
    fn = value.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_request("tool_choice.function.name", "tool_choice.function.name is required")
    if name not in {f.name for f in functions}:
        raise bad_request(
            "tool_choice.function.name",
            f"tool_choice names the function {name!r}, which is not among the tools",
        )
    return name


def _grammar(
    ctx: ServerContext, functions: list[FunctionSpec], choice: str, parallel: bool
) -> StructuredOutput:
    if choice.startswith(":"):
        functions, parallel = [f for f in functions if f.name == choice[1:]], False
    grammar = call_format(ctx).grammar(functions, parallel, ctx.tokenizer.added_tokens)
    return StructuredOutput(grammar=grammar)


async def with_tool_constraint(
    ctx: ServerContext, params: SamplingParams, plan: ToolPlan
) -> SamplingParams:
    """`params` constrained to the plan's calls, if it has a grammar (compiled now, off
    the event loop, so a failure is a 400 before the request is queued)."""
    if plan.constraint is None:
        return params
    if params.structured_output is not None:
        raise bad_request(
            "tool_choice",
            "tool_choice 'required' or a named function cannot be combined with "
            "response_format or structured_outputs (both constrain the whole reply)",
        )
    # Each schema compiled alone (check_schema); together they should too.
    await check_compiles(ctx, plan.constraint, "tools")
    return params.clone(structured_output=plan.constraint)


def tool_plan(ctx: ServerContext, req: ChatCompletionRequest) -> ToolPlan:
    """The request's tool fields, checked, as a plan (an empty one without tools)."""
    functions = _functions(req.tools)
    choice = _choice(req.tool_choice, functions)
    if choice == "none" or not functions:
        return ToolPlan()
    if not ctx.tokenizer.chat_template_takes_tools:
        raise bad_request(
            "tools",
            "this model's chat template does not render tools (it never reads `tools`), so "
            "the model cannot call them; serve it with a template that does, e.g. "
            "`sluice serve --chat-template hermes_tools` for a ChatML model",
        )
    parallel = req.parallel_tool_calls is not False
    return ToolPlan(
        tools=list(req.tools),
        new_parser=functools.partial(
            call_format(ctx).parser,
            None if parallel else 1,
            frozenset(f.name for f in functions),
        ),
        constraint=None if choice == "auto" else _grammar(ctx, functions, choice, parallel),
    )
