"""Constraints to grammar matchers, through llguidance, compiled once per content.

Why llguidance (and not xgrammar): it is one self-contained wheel (xgrammar pulls in
torch, transformers and triton pins of its own), it compiles a JSON Schema in well
under a millisecond here, it computes a 49k-vocabulary mask in ~20 µs on this CPU,
it reads JSON Schema, regexes, Lark and llama.cpp's GBNF, and it reports the tokens
a grammar forces (which we append without a forward pass each).

JSON is compiled with fixed separators (``", "`` and ``": "``, as Python's
``json.dumps``) and no free whitespace: the output is still JSON that any parser
reads, the fixed punctuation becomes forced tokens, and a small model cannot wander
into endless whitespace, a known way for constrained decoding to never finish. A
schema may ask for other options with llguidance's ``x-guidance`` key.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import llguidance
import tokenizers

from sluice.core.errors import RequestError
from sluice.core.structured_output import (
    JSON_FORMAT,
    StructuredOutput,
    ThinkingSpan,
    lark_text,
)

# Defined in core: the server's tool-call grammars embed JSON Schemas with the same format.
JSON_OPTIONS: Any = JSON_FORMAT
# Compiled grammars kept (each is a matcher in its start state, a few KB to a few MB).
CACHE_SIZE = 256
FIELD = "structured_output"


class GrammarCompiler:
    """Compiles constraints for one tokenizer; safe to call from several threads.

    ``compile`` returns a matcher in its start state (cached by the constraint's
    content); every sequence gets its own copy (``matcher``). A constraint the
    library rejects raises RequestError naming ``structured_output`` (the server
    renames it to the field the client used), and the rejection is cached too.
    """

    def __init__(
        self, backend: tokenizers.Tokenizer, vocab_size: int, eos_token_ids: list[int]
    ) -> None:
        self._backend = backend
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        # Added tokens by text: a grammar names them by id (structured_output.lark_text).
        self._added = {t.content: i for i, t in backend.get_added_tokens_decoder().items()}
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher | str] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        # Built on first use (~0.2 s for a 49k vocabulary), not at every engine start.
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._backend.to_str(), n_vocab=self._vocab_size, eos_token=self._eos
                )
            return self._tokenizer

    def compile(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        key = constraint.key()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
        if cached is None:
            cached = self._build(constraint)
            with self._lock:
                self._cache[key] = cached
                self.num_compiled += 1
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        if isinstance(cached, str):
            raise RequestError(FIELD, cached)
        return cached

    def matcher(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence."""
        return self.compile(constraint).deep_copy()

    def _build(self, constraint: StructuredOutput) -> llguidance.LLMatcher | str:
        """The start-state matcher, or the error message if the library rejects it."""
        try:
            grammar = grammar_text(constraint, self._added)
        except ValueError as exc:
            return f"invalid {constraint.kind} for {FIELD}: {exc}"
        except RecursionError:
            return f"invalid {constraint.kind} for {FIELD}: nested too deeply"
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return f"invalid {constraint.kind} for {FIELD}: {matcher.get_error()}"
        return matcher


def grammar_text(constraint: StructuredOutput, added: Mapping[str, int] | None = None) -> str:
    """The llguidance grammar for a constraint; ValueError when it cannot be converted.
    `added` are the tokenizer's added tokens (a thinking span's tags may be some)."""
    if constraint.thinking is not None:
        return _after_thinking(constraint, constraint.thinking, added or {})
    kind = constraint.kind
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=JSON_OPTIONS
        )
    if kind == "json":
        schema: Any = constraint.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        schema = _any_json(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(
            close_objects(schema), defaults=JSON_OPTIONS
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(str(constraint.regex))
    if kind == "choice":
        alternatives = " | ".join(json.dumps(c) for c in constraint.choice or [])
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    # A grammar: GBNF (llama.cpp's "::=" rules) or Lark.
    return llguidance.grammar_from("grammar", str(constraint.grammar))


def _any_json(schema: Any) -> Any:
    if schema is True or schema == {}:  # "anything": still JSON
        return {"type": ["object", "array", "string", "number", "boolean", "null"]}
    return schema


def _answer_rules(constraint: StructuredOutput) -> str:
    """The constraint as Lark rules whose start is ``answer``."""
    kind = constraint.kind
    if kind in ("json", "json_object"):
        schema: Any = {"type": "object"} if kind == "json_object" else constraint.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        schema = close_objects(_any_json(schema))
        if isinstance(schema, dict):
            own = schema.get("x-guidance")
            schema = {
                **schema,
                "x-guidance": {**JSON_OPTIONS, **(own if isinstance(own, dict) else {})},
            }
        return f"answer: %json {json.dumps(schema)}"
    if kind == "regex":
        return "answer: /" + str(constraint.regex).replace("/", "\\/") + "/"
    if kind == "choice":
        return "answer: " + " | ".join(json.dumps(c) for c in constraint.choice or [])
    text = str(constraint.grammar)
    if "::=" in text:
        raise ValueError(
            "a GBNF grammar cannot follow a reasoning model's thinking (--reasoning-parser); "
            "write it as a Lark grammar"
        )
    renamed, n = re.subn(r"(?m)^(\s*)start(\s*:)", r"\1answer\2", text)
    if n != 1:
        raise ValueError("a Lark grammar after the thinking needs exactly one `start` rule")
    return renamed


# Between the thinking and the answer: the blank line Qwen3 and R1 write, no more (free
# whitespace there is where a small model wanders off and never answers).
_AFTER = "/\\n{0,2}/"


def _after_thinking(
    constraint: StructuredOutput, span: ThinkingSpan, added: Mapping[str, int]
) -> str:
    """A Lark grammar that lets the model think first (free text up to the end tag, then
    up to two newlines) and holds its answer to the constraint, as vLLM starts the grammar
    after the reasoning ends. An end tag that is (or opens with) an added token ends the
    thinking's text on its own (text cannot contain it: Qwen3's </think>, harmony's
    <|end|><|start|>assistant...); one that is plain text stops a lazy rule."""
    end = lark_text(span.end, added)
    if any(token and span.end.startswith(token) for token in added):
        think = f"think: THINK {end} {_AFTER}\nTHINK: /(.|\\n)*/"
    else:
        think = f"think: think_text {_AFTER}\nthink_text[stop={json.dumps(span.end)}]: /(.|\\n)*/"
    prefix = "think" if span.opened else f"({lark_text(span.start, added)} think)?"
    return f"start: {prefix} answer\n{think}\n{_answer_rules(constraint)}\n"


# Keywords whose values are one subschema, or a list or a name -> subschema map of them.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else")
_LIST = ("prefixItems", "anyOf", "oneOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_objects(schema: Any) -> Any:
    """A copy of `schema` in which objects that list their properties take no others
    (``additionalProperties: false`` where the schema leaves it unsaid), as xgrammar's
    strict mode and OpenAI's strict schemas do. Every output still validates against
    the original schema (it allows a subset); what it removes is the room a small model
    uses to invent key after key until max_tokens. Left alone: objects whose
    ``required`` names keys outside ``properties``, and everything under ``allOf``
    (closing each branch would forbid the other branches' keys)."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {k: close_objects(v) for k, v in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = close_objects(out["additionalProperties"])
    props, required = out.get("properties"), out.get("required", [])
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf")
    if (
        isinstance(props, dict)
        and props
        and not any(k in out for k in open_keys)
        # (a `required` that is no list of names is left for the compiler to refuse)
        and isinstance(required, list)
        and all(isinstance(r, str) for r in required)
        and set(required) <= set(props)
    ):
        out["additionalProperties"] = False
    return out
