"""What a constrained request's output must match: a JSON Schema, any JSON object, a
regular expression, one of a list of strings, or a grammar.

Only the shape is checked here (exactly one kind, the right types), so a bad value
fails at the API boundary with the field's name. Whether the grammar library can
compile it is the structured-output package's job (`sluice.structured`), which the
engine calls when the request is added.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sluice.core.errors import SamplingParamsError

_FIELD = "structured_output"
# The kinds that hold a value (json_object is a flag), and all of them.
_VALUED = ("json", "regex", "choice", "grammar")
_KINDS = ("json", "json_object", "regex", "choice", "grammar")

# How constrained JSON is laid out (llguidance's JSON compile options): Python's
# ``json.dumps`` separators and no free whitespace (sluice.structured.compiler says why).
# Here, in core, because the server embeds JSON Schemas in tool-call grammars too.
JSON_FORMAT: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


@dataclass(frozen=True)
class ThinkingSpan:
    """A reasoning model's thinking, which a constraint lets it write first: between
    `start` and `end` (the start already in the prompt when `opened`)."""

    start: str
    end: str
    opened: bool


def lark_text(text: str, added: Mapping[str, int]) -> str:
    """`text` as a sequence of Lark terms that a tokenizer with the `added` tokens can
    produce: plain pieces as string literals, each added token's text as that token by
    id (``<[151657]>``). llguidance treats every added token as special, matched only
    by id: Qwen2.5's ``<tool_call>`` is one, so a literal "<tool_call>" would forbid
    the very token the model was trained to write (and reject it when forced)."""
    present = sorted((t for t in added if t and t in text), key=len, reverse=True)
    if not present:
        return json.dumps(text)
    pieces = re.split("(" + "|".join(re.escape(t) for t in present) + ")", text)
    terms = [f"<[{added[p]}]>" if i % 2 else json.dumps(p) for i, p in enumerate(pieces) if p]
    return " ".join(terms)


# Real schemas nest a few tens of levels; the compiler and the cache key's JSON text
# recurse per level and meet Python's recursion limit near 1,000.
MAX_SCHEMA_DEPTH = 100


def _depth(value: Any) -> int:
    """How deep lists and dicts nest in a JSON value (a scalar: 0), without recursing."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((c, level + 1) for c in children)
    return deepest


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of the fields is set.

    - ``json``: a JSON Schema (a dict, or its JSON text);
    - ``json_object``: True for any JSON object (OpenAI's ``{"type": "json_object"}``);
    - ``regex``: a regular expression the whole output must match;
    - ``choice``: the output is exactly one of these strings;
    - ``grammar``: a Lark grammar (llguidance's dialect, which may embed JSON Schemas
      with ``%json {...}``) or a llama.cpp GBNF grammar.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    # With a reasoning parser: the output may think first, and the constraint covers
    # the answer after the thinking (sluice.structured.compiler builds that grammar).
    thinking: ThinkingSpan | None = None

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> StructuredOutput:
        """From a dict of the fields (an API body); an unknown key names itself."""
        unknown = sorted(set(fields) - set(_KINDS))
        if unknown:
            raise SamplingParamsError(
                f"{_FIELD}.{unknown[0]}",
                f"{_FIELD} has no field {unknown[0]!r} (it takes {', '.join(_KINDS)})",
            )
        return cls(**fields)

    def __post_init__(self) -> None:
        kinds = [k for k in _VALUED if getattr(self, k) is not None]
        if not isinstance(self.json_object, bool):
            raise SamplingParamsError(
                f"{_FIELD}.json_object",
                f"{_FIELD}.json_object must be a bool, got {type(self.json_object).__name__}",
            )
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            raise SamplingParamsError(
                _FIELD,
                f"{_FIELD} needs exactly one of {', '.join(_KINDS)}; "
                f"got {', '.join(kinds) if kinds else 'none'}",
            )
        self._check(kinds[0])

    def _check(self, kind: str) -> None:
        where = f"{_FIELD}.{kind}"
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise SamplingParamsError(where, f"{where} is not valid JSON: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise SamplingParamsError(
                    where, f"{where} must be a JSON Schema object, got {type(schema).__name__}"
                )
            if _depth(schema) > MAX_SCHEMA_DEPTH:
                raise SamplingParamsError(
                    where, f"{where} is nested more than {MAX_SCHEMA_DEPTH} levels deep"
                )
        elif kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise SamplingParamsError(where, f"{where} must be a non-empty string")
        elif kind == "choice":
            choice = self.choice
            if not isinstance(choice, list | tuple) or not choice:
                raise SamplingParamsError(where, f"{where} must be a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in choice):
                raise SamplingParamsError(where, f"{where} must contain only non-empty strings")

    @property
    def kind(self) -> str:
        for k in _VALUED:
            if getattr(self, k) is not None:
                return k
        return "json_object"

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints compile once.

        A schema's keys keep their order: the grammar writes an object's properties in
        the order the schema lists them, so two schemas that differ only in that order
        are different constraints (sorted keys once gave the second the first's order).
        """
        kind = self.kind
        if self.thinking is not None:
            t = self.thinking
            kind = f"{kind}+thinking:{json.dumps([t.start, t.end, t.opened])}"
        return kind, self._text()

    def _text(self) -> str:
        kind = self.kind
        if kind == "json":
            schema = self.json if isinstance(self.json, dict | bool) else json.loads(self.json)  # type: ignore[arg-type]
            return json.dumps(schema, separators=(",", ":"))
        if kind == "choice":
            return json.dumps(list(self.choice or []))
        if kind == "json_object":
            return ""
        return str(getattr(self, kind))
