"""Structured-output constraints are request input: random JSON Schemas, regexes and
grammars (hypothesis) each compile to a matcher, or are refused with the documented
RequestError naming `structured_output`, within a bounded time; never another
exception (a 500, or a dead engine thread). A matcher that compiles gives its first
mask and walks a few tokens. `make fuzz` runs them far longer."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.core.errors import RequestError, SamplingParamsError
from sluice.core.structured_output import StructuredOutput
from sluice.loader import load_tokenizer
from sluice.structured.compiler import GrammarCompiler
from sluice.structured.constraints import fill_mask, new_bitmask

# Each compile must end well within this (llguidance bounds its own work; a schema of
# the JSONSchemaBench compiles in milliseconds).
SECONDS = 10.0

SCHEMA_KEYS = [
    "type", "properties", "items", "required", "enum", "const", "pattern", "minLength",
    "maxLength", "minimum", "maximum", "exclusiveMinimum", "multipleOf", "anyOf", "oneOf",
    "allOf", "not", "$ref", "$defs", "definitions", "additionalProperties",
    "patternProperties", "format", "minItems", "maxItems", "prefixItems", "uniqueItems",
    "if", "then", "else", "x-guidance", "a",
]  # fmt: skip
SCHEMA_WORDS = [
    "object", "string", "integer", "number", "array", "boolean", "null", "#/$defs/a",
    "#", "#/properties/a", "a", "(a+)+$", "^[a-z]{1,1000}$", "date-time", "email", "uuid",
]  # fmt: skip
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats(allow_subnormal=False)  # the kernels may leave the CPU flushing them
    | st.text(max_size=12)
    | st.sampled_from(SCHEMA_WORDS)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(SCHEMA_KEYS) | st.text(max_size=4), inner, max_size=5)
    ),
    max_leaves=40,
)
schemas = st.dictionaries(st.sampled_from(SCHEMA_KEYS), json_values, max_size=6)

regexes = st.text(alphabet="ab.|()[]{}*+?^$\\-,0123456789dwsSD^!:", max_size=40)

GRAMMAR_PIECES = [
    "start: ", "root ::= ", "a", "b", '"x"', "'y'", " | ", "(", ")", "*", "+", "?",
    "{1,1000}", "{3}", "\n", "rule", "rule: ", "rule ::= ", "[a-z]", "[^\\n]", "/a+/",
    "/(a|b)*c/", "%json {", '"type": "string"', "}", "%ignore ", "%import common.WS",
    "<[128000]>", "<|im_end|>", "::=", ":", " ", "\\", '"', "#",
]  # fmt: skip
grammars = st.lists(st.sampled_from(GRAMMAR_PIECES), min_size=1, max_size=30).map("".join)

# A request's structured_output fields.
constraints = st.one_of(
    schemas.map(lambda s: {"json": s}),
    json_values.map(lambda s: {"json": s}),
    regexes.map(lambda r: {"regex": r}),
    grammars.map(lambda g: {"grammar": g}),
)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tok = load_tokenizer("smollm2-135m")[1]
    return GrammarCompiler(tok.backend, tok.vocab_size, tok.eos_token_ids)


def _walk(compiler: GrammarCompiler, fields: dict[str, Any]) -> None:
    """Check the fields and compile; where it compiles, a mask and a few of the tokens
    it allows."""
    try:
        matcher = compiler.matcher(StructuredOutput.from_dict(fields))
    except SamplingParamsError as exc:  # refused by shape, before compiling
        assert exc.param.startswith("structured_output"), exc.param
        return
    except RequestError as exc:
        assert exc.param == "structured_output"
        assert str(exc).startswith("invalid ")
        return
    bitmask = new_bitmask(1, compiler.tokenizer.vocab_size)
    for _ in range(4):
        if matcher.is_stopped():
            return
        fill_mask(matcher, bitmask, 0)
        words = bitmask[0].tolist()
        allowed = next((32 * i + b for i, w in enumerate(words) for b in range(32)
                        if (w >> b) & 1), None)  # fmt: skip
        if allowed is None:
            return
        matcher.consume_token(allowed)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fields=constraints)
def test_random_constraints_compile_or_are_refused(
    compiler: GrammarCompiler, fields: dict[str, Any]
) -> None:
    t0 = time.perf_counter()
    _walk(compiler, fields)
    assert time.perf_counter() - t0 < SECONDS, fields


@pytest.mark.parametrize(
    "fields",
    [
        {"json": {"required": [{}]}},  # unhashable names
        {"json": {"properties": {"a": {}}, "required": 3}},
        {"json": {"type": "object", "properties": []}},
        {"json": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
        {"json": {"pattern": "(a+)+$" * 50, "type": "string"}},
        {"regex": "(a{1,1000}){1,1000}"},
        {"regex": "((((((((((a*)*)*)*)*)*)*)*)*)*)b"},
        {"grammar": 'start: a\na: a a | "x"'},
        {"grammar": "root ::= root"},
    ],
    ids=lambda c: str(c)[:40],
)
def test_hostile_constraints_compile_or_are_refused(
    compiler: GrammarCompiler, fields: dict[str, Any]
) -> None:
    t0 = time.perf_counter()
    _walk(compiler, fields)
    assert time.perf_counter() - t0 < SECONDS


def test_a_schema_nested_deep_is_refused_not_a_recursion_error(compiler: GrammarCompiler) -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    _walk(compiler, {"json": schema})
