"""The request fields that constrain the output, to one `StructuredOutput`.

OpenAI's `response_format` (`json_object`, `json_schema`) on both endpoints, and, for
everything else, vLLM's `structured_outputs` extra (`{"json" | "regex" | "choice" |
"grammar" | "json_object": ...}`) with its older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar` spellings, which clients still send. At most one of
them per request. A constraint the grammar library cannot compile is a 400 naming the
field the client used, found before the request is queued.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from sluice.core.errors import RequestError, SamplingParamsError
from sluice.core.sampling_params import SamplingParams
from sluice.core.structured_output import StructuredOutput, ThinkingSpan
from sluice.server.context import ServerContext
from sluice.server.errors import bad_request, json_kind
from sluice.server.protocol import ChatCompletionRequest, CompletionRequest

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _from_response_format(rf: Any) -> StructuredOutput | None:
    if not isinstance(rf, dict):
        raise bad_request(
            "response_format", f"response_format must be an object, got {json_kind(rf)}"
        )
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise bad_request(
            "response_format.type",
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        )
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request(
            "response_format.json_schema",
            f"response_format.json_schema must be an object, got {json_kind(spec)}",
        )
    schema = spec.get("schema", {})  # OpenAI: no schema means any JSON
    if not isinstance(schema, dict):
        raise bad_request(
            "response_format.json_schema.schema",
            f"response_format.json_schema.schema must be an object, got {json_kind(schema)}",
        )
    return StructuredOutput(json=schema)


def _from_extras(req: CompletionRequest | ChatCompletionRequest) -> tuple[Any, str] | None:
    """(structured_outputs-shaped dict, the field it came from), or None."""
    given = [(name, getattr(req, name)) for name in ("structured_outputs", *_GUIDED)]
    given = [(name, value) for name, value in given if value is not None]
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise bad_request(given[1][0], f"only one of {names} may be given")
    name, value = given[0]
    if name == "structured_outputs":
        if not isinstance(value, dict):
            raise bad_request(name, f"{name} must be an object, got {json_kind(value)}")
        return value, name
    return {_GUIDED[name]: value}, name


def constraint_of(
    req: CompletionRequest | ChatCompletionRequest,
) -> tuple[StructuredOutput | None, str]:
    """The request's constraint and the field to name in its errors."""
    extra = _from_extras(req)
    rf = req.response_format
    if extra is not None and rf is not None and rf != {"type": "text"}:
        raise bad_request(extra[1], f"{extra[1]} and response_format cannot both be given")
    try:
        if extra is None:
            return (None if rf is None else _from_response_format(rf)), "response_format"
        fields, param = extra
        return StructuredOutput.from_dict(fields), param
    except SamplingParamsError as exc:
        param = _field(extra, exc.param)
        raise bad_request(param, str(exc).replace(exc.param, param, 1)) from None


def _field(extra: tuple[Any, str] | None, param: str) -> str:
    """The client's name for StructuredOutput's field `param`."""
    if extra is None:
        return "response_format"
    name = extra[1]
    if name == "structured_outputs":
        return param.replace("structured_output", name, 1)
    return name


async def check_compiles(ctx: ServerContext, constraint: StructuredOutput, param: str) -> None:
    """Compile the constraint now (off the event loop; cached for the engine), so a
    grammar the library rejects is a 400 naming `param`."""
    # Data-parallel replicas compile in their own processes (a bad grammar is their 400).
    compiler = getattr(getattr(ctx.llm, "engine", None), "grammars", None)
    if compiler is None:
        return
    try:
        await asyncio.to_thread(compiler.compile, constraint)
    except RequestError as exc:
        raise bad_request(param, str(exc).replace("structured_output", param, 1)) from None


async def with_thinking(
    ctx: ServerContext, params: SamplingParams, prompt_ids: list[int], calls: bool = False
) -> SamplingParams:
    """With a reasoning parser, a constraint (response_format, a required tool call)
    holds the answer, not the thinking: its grammar lets the model think first. `calls`:
    the constraint is a required call's, which follows the thinking where the format
    says (harmony: in a message of its own, not the final answer's)."""
    constraint = params.structured_output
    if ctx.reasoning is None or constraint is None:
        return params
    tail = ctx.tokenizer.decode(prompt_ids[-16:], skip_special_tokens=False)
    end = ctx.reasoning.call_end if calls and ctx.reasoning.call_end else ctx.reasoning.end
    span = ThinkingSpan(ctx.reasoning.start, end, ctx.reasoning.opens(tail))
    constraint = dataclasses.replace(constraint, thinking=span)
    await check_compiles(ctx, constraint, "structured_output")
    return params.clone(structured_output=constraint)


async def constrained(
    ctx: ServerContext, req: CompletionRequest | ChatCompletionRequest, params: SamplingParams
) -> SamplingParams:
    """`params` with the request's constraint, if it has one (checked and compiled)."""
    constraint, param = constraint_of(req)
    if constraint is None:
        return params
    await check_compiles(ctx, constraint, param)
    return params.clone(structured_output=constraint)
