"""Tool calls in a model's output: the parser that finds them (whole or streamed) and
the grammar that makes a model write one.

A *format* is how a model family writes calls. Hermes (``<tool_call>\\n{"name": ...,
"arguments": {...}}\\n</tool_call>``; Qwen2.5, Hermes 2/3 and our ``hermes_tools``
template) is the one most models use; gpt-oss writes harmony's messages to a function
(``HarmonyFormat``), which its reasoning parser turns into Hermes blocks, so one parser
reads both. Another format is one more ``ToolCallFormat`` in
``FORMATS``, with its parser and its grammar side by side, because what the grammar
forces is exactly what the parser must read back.

One incremental parser serves both responses: a non-streamed reply is the stream fed
in one piece, and every decision depends only on the text seen, never on how it was
cut, so the streamed deltas reassemble into exactly the non-streamed message. Text
that may still turn into a call (a trailing ``<tool_c``) or that might end the content
(trailing whitespace) is held back until the next piece decides it. A call is
committed as soon as its header (``{"name": "...", "arguments":``) is complete; its
arguments are then passed on as the model writes them, as OpenAI streams them, so an
unconstrained model that breaks off may leave arguments that are not JSON (OpenAI's
caveat too). With ``tool_choice`` ``required`` or a named function the grammar makes
every call complete and its arguments valid against the function's schema.

Some models drop the tags: Qwen2.5-Coder answers a weather question with a bare
``{"name": "get_weather", "arguments": {...}}``, or the same object in a Markdown
code block (```` ```json ````). A reply that *opens* with such an object, fenced or
not, naming one of the request's functions, is read as calls too (so a reply that
opens with ``{`` or a backtick waits until it is known not to be one); JSON later in
a reply, or with another name, stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass, field
from typing import Any, Protocol

from sluice.core.structured_output import JSON_FORMAT, lark_text


@dataclass
class CallDelta:
    """New text of call `index`: its id and name the first time, then argument pieces."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    """What one piece of output adds: content text and call pieces, in order."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def call(self, index: int) -> CallDelta:
        if not self.calls or self.calls[-1].index != index:
            self.calls.append(CallDelta(index))
        return self.calls[-1]


@dataclass
class FunctionSpec:
    """One tool as the grammar needs it: its name and its parameters' JSON Schema."""

    name: str
    parameters: dict[str, Any]


class ToolCallParser(Protocol):
    def feed(self, text: str, final: bool) -> ParsedDelta:
        """Take the next piece of output (`final`: the last one) and return what it adds."""
        ...

    @property
    def num_calls(self) -> int: ...


class ToolCallFormat(Protocol):
    name: str

    def parser(self, max_calls: int | None, names: Set[str]) -> ToolCallParser:
        """A parser for one output; calls past `max_calls` are dropped; `names` are the
        request's functions (a format may use them to recognise calls)."""
        ...

    def grammar(
        self, functions: list[FunctionSpec], parallel: bool, added: Mapping[str, int]
    ) -> str:
        """A Lark grammar (llguidance's dialect) for one call of one of `functions`, or
        one or more calls if `parallel`; `added` is the tokenizer's added tokens (text
        to id), which the grammar's literals name by id (``lark_text``)."""
        ...


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_all(parser: ToolCallParser, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole output as OpenAI's message fields: (content or None, tool_calls)."""
    delta = parser.feed(text, final=True)
    calls: list[dict[str, Any]] = []
    for piece in delta.calls:
        if piece.id is not None:
            calls.append(
                {
                    "id": piece.id,
                    "type": "function",
                    "function": {"name": piece.name or "", "arguments": ""},
                }
            )
        calls[piece.index]["function"]["arguments"] += piece.arguments
    return delta.content or None, calls


def partial_suffix(text: str, start: int, tag: str) -> int:
    """The length of the longest end of text[start:] that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if tag.startswith(text[len(text) - n :]):
            return n
    return 0


class TrimmedText:
    """Text fed in pieces with the whitespace at its two ends left out: leading whitespace
    is dropped, trailing whitespace waits until more text follows it (the tool-call and
    reasoning parsers' content)."""

    def __init__(self) -> None:
        self.started = False
        self.pending = ""

    def add(self, piece: str) -> str:
        if not self.started:
            piece = piece.lstrip()
            if not piece:
                return ""
            self.started = True
        text = self.pending + piece
        kept = text.rstrip()
        self.pending = text[len(kept) :]
        return kept


class _JsonValue:
    """Finds where a JSON value ends in text that arrives in pieces: nesting and strings
    are tracked, a scalar ends at a delimiter, and the value never runs into `stop`
    (the call's closing tag), nor into what may be its start until that is decided."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False
        self.done = False

    def scan(self, text: str, i: int, final: bool) -> int:
        """Advance over text[i:] (which must not start with whitespace before the value
        has started); the position up to which the value's text is known."""
        while i < len(text) and not self.done:
            ch = text[i]
            if not self.in_string and self._ends_before(text, i, final):
                return i
            self.started = True
            i += 1
            if self.in_string:
                self._string_char(ch)
                self.done = self.depth == 0 and not self.in_string
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                self.done = self.depth <= 0
        return i

    def _ends_before(self, text: str, i: int, final: bool) -> bool:
        """Whether the value ends (or must wait) before text[i]."""
        ch = text[i]
        if ch == "<":
            if text.startswith(self.stop, i):
                self.done = True
                return True
            if not final and self.stop.startswith(text[i:]):
                return True  # maybe the closing tag: wait for more
        if self.started and self.depth == 0 and (ch in ",}]" or ch.isspace()):
            self.done = True  # the end of a scalar
            return True
        return False

    def _string_char(self, ch: str) -> None:
        if self.escaped:
            self.escaped = False
        elif ch == "\\":
            self.escaped = True
        elif ch == '"':
            self.in_string = False


HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"
# A call's header, up to where its arguments start: whitespace, literals and the name
# (a JSON string). _HEADER matches a whole one; _HEADER_START every text that may still
# become one, so a reply that opens with "{" waits only as long as it might be a call.
_WS, _STRING = r"\s*", r'"(?:[^"\\]|\\.)*"'
_PARTS = [_WS, "{", _WS, '"name"', _WS, ":", _WS, _STRING, _WS, ",", _WS, '"arguments"', _WS, ":"]


def _full(part: str) -> str:
    return part if part in (_WS, _STRING) else re.escape(part)


def _partial(part: str) -> str:
    """Any proper prefix of `part` (the empty one included)."""
    if part == _WS:
        return _WS
    if part == _STRING:
        return r'(?:"(?:[^"\\]|\\.)*\\?)?'
    return "(?:" + "|".join(re.escape(part[:i]) for i in range(len(part))) + ")"


def _prefixes(parts: list[str]) -> str:
    if not parts:
        return ""
    return f"(?:{_partial(parts[0])}|{_full(parts[0])}{_prefixes(parts[1:])})"


# A Markdown code block around a bare call: its opening line, every text that may still
# become one, its closing backticks and every text that may still become them.
_FENCE = re.compile(r"\s*```(?:json)?[ \t]*\n")
_FENCE_START = re.compile(r"\s*`{1,3}(?:j|js|jso|json)?[ \t]*")
_FENCE_CLOSE = re.compile(r"\s*```")
_FENCE_CLOSE_START = re.compile(r"\s*`{0,2}")
_HEADER = re.compile("".join(_full(p) if p != _STRING else f"({p})" for p in _PARTS) + _WS)
_HEADER_START = re.compile(_prefixes(_PARTS))


def _json_string(quoted: str) -> str | None:
    try:
        value = json.loads(quoted)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _call_of(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a whole call block in any key order, or None
    when it is not one. Arguments given as a JSON string are read as JSON."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


class HermesParser:
    """Hermes calls in one output: ``<tool_call>\\n{"name": ..., "arguments": ...}
    \\n</tool_call>`` blocks among plain text (see the module's docstring).

    With `names`, a reply may also open with calls written without the tags (bare
    ``{"name": ..., "arguments": ...}`` objects, name first, one of `names`, each
    maybe in a ```` ```json ```` code block): Qwen2.5-Coder writes its calls that way.
    """

    def __init__(self, max_calls: int | None = None, names: Set[str] = frozenset()) -> None:
        self._text = ""
        self._pos = 0  # everything before it is decided
        self._body: int | None = None  # where the open block's body starts
        self._args: _JsonValue | None = None  # the open block's arguments, once committed
        self._bare = False  # the open call has no tags
        self._fenced = False  # ... and sits in a Markdown code block
        self._index = -1  # the open call's index (-1: dropped, past max_calls)
        self._content = TrimmedText()
        self._calls = 0
        self._max_calls = max_calls
        self._names = names

    @property
    def num_calls(self) -> int:
        return self._calls

    def feed(self, text: str, final: bool) -> ParsedDelta:
        self._text += text
        out = ParsedDelta()
        while self._step(out, final):
            pass
        return out

    def _step(self, out: ParsedDelta, final: bool) -> bool:
        """One decision; whether another may follow on the text there is."""
        if self._body is None:
            return self._in_text(out, final)
        if self._args is None:
            return self._in_header(out, final)
        return self._in_arguments(out, final)

    def _in_text(self, out: ParsedDelta, final: bool) -> bool:
        text, pos = self._text, self._pos
        if self._names and not self._content.started:  # only calls so far
            bare = self._bare_call(out, final)
            if bare is not None:
                return bare
        k = text.find(HERMES_START, pos)
        if k < 0:
            end = len(text) - (0 if final else partial_suffix(text, pos, HERMES_START))
            out.content += self._content.add(text[pos:end])
            self._pos = end
            return False
        out.content += self._content.add(text[pos:k])
        self._pos = self._body = k + len(HERMES_START)
        return True

    def _bare_call(self, out: ParsedDelta, final: bool) -> bool | None:
        """A call without tags at the reply's start, maybe in a code block: committed
        (True), undecided (False: wait for more text), or not one (None: content)."""
        text, pos = self._text, self._pos
        fence = _FENCE.match(text, pos)
        start = fence.end() if fence else pos
        m = _HEADER.match(text, start)
        if m is None:
            maybe_fence = fence is None and _FENCE_START.fullmatch(text, pos)
            undecided = not final and (_HEADER_START.fullmatch(text, start) or maybe_fence)
            return False if undecided else None
        name = _json_string(m.group(1))
        if name not in self._names:
            return None
        assert name is not None
        self._body, self._bare, self._fenced = pos, True, fence is not None
        self._open(out, name, m.end())
        return True

    def _open(self, out: ParsedDelta, name: str, args_start: int) -> None:
        self._args = _JsonValue(HERMES_END)
        self._pos = args_start
        self._index = self._new_call(out, name)

    def _in_header(self, out: ParsedDelta, final: bool) -> bool:
        text, body = self._text, self._body
        assert body is not None
        end = text.find(HERMES_END, body)
        m = _HEADER.match(text, body)
        name = _json_string(m.group(1)) if m else None
        if m and name is not None and (end < 0 or end >= m.end()):
            self._open(out, name, m.end())
            return True
        if end < 0 and not final:
            return False  # the header may still complete
        closed = end >= 0
        block = text[body : end if closed else len(text)]
        call = _call_of(block)
        if call is None:  # not a call after all: the model's text, as written
            tail = HERMES_END if closed else ""
            out.content += self._content.add(HERMES_START + block + tail)
        elif (index := self._new_call(out, call[0])) >= 0:
            out.call(index).arguments += call[1]
        self._pos = end + len(HERMES_END) if closed else len(text)
        self._body = None
        return True

    def _in_arguments(self, out: ParsedDelta, final: bool) -> bool:
        text, args = self._text, self._args
        assert args is not None
        i = self._pos
        if not args.started:
            while i < len(text) and text[i].isspace():
                i += 1
        end = args.scan(text, i, final)
        if self._index >= 0 and end > i:
            out.call(self._index).arguments += text[i:end]
        self._pos = end
        if not (args.done or final):
            return False
        close = self._bare_end(end, final) if self._bare else self._block_end(end, final)
        if close is None:
            return False
        self._pos = close
        self._body, self._args, self._bare, self._fenced = None, None, False, False
        return True

    def _block_end(self, i: int, final: bool) -> int | None:
        """Where the text after a tagged call's arguments resumes (None: not known yet)."""
        text = self._text
        close = text.find(HERMES_END, i)
        after = text.find(HERMES_START, i)
        if 0 <= after and (close < 0 or after < close):
            return after  # a new call before this one was closed
        if close >= 0:
            return close + len(HERMES_END)
        return len(text) if final else None

    def _bare_end(self, i: int, final: bool) -> int | None:
        """Past the "}" that closes a bare call and its code block's closing backticks
        (None: not known yet)."""
        text = self._text
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return i if final else None
        if text[i] != "}":
            return i
        if not self._fenced:
            return i + 1
        close = _FENCE_CLOSE.match(text, i + 1)
        if close is not None:
            return close.end()
        return None if not final and _FENCE_CLOSE_START.fullmatch(text, i + 1) else i + 1

    def _new_call(self, out: ParsedDelta, name: str) -> int:
        if self._max_calls is not None and self._calls >= self._max_calls:
            return -1
        index = self._calls
        self._calls += 1
        piece = out.call(index)
        piece.id = new_call_id()
        piece.name = name
        return index


def with_json_format(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with sluice's JSON layout unless it asks for its own (x-guidance)."""
    own = schema.get("x-guidance")
    return {**schema, "x-guidance": {**JSON_FORMAT, **(own if isinstance(own, dict) else {})}}


def calls_grammar(
    start: str, functions: list[FunctionSpec], head: Callable[[str], str], tail: str
) -> str:
    """A Lark grammar (llguidance's dialect) whose `start` rule is made of `call`s: each
    one of `functions`, as `head(name)`, its arguments (the function's JSON Schema, its
    own root, so its ``$ref``s resolve), then `tail` (head and tail Lark text)."""
    rules = [start, "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, fn in enumerate(functions):
        rules.append(f"call_{i}: {head(fn.name)} args_{i} {tail}")
        rules.append(f"args_{i}: %json {json.dumps(with_json_format(fn.parameters))}")
    return "\n".join(rules) + "\n"


class HermesFormat:
    name = "hermes"

    def parser(self, max_calls: int | None, names: Set[str]) -> HermesParser:
        return HermesParser(max_calls, names)

    def grammar(
        self, functions: list[FunctionSpec], parallel: bool, added: Mapping[str, int]
    ) -> str:
        """Each call's text as the template renders it, calls one per line. A newline
        may end the reply: Qwen2.5 writes one before it ends a turn, and without it a
        model that wants to stop after a call would be pushed into another one."""
        start = "start: call" + (' ("\\n" call)*' if parallel else "") + ' "\\n"?'

        def head(name: str) -> str:
            return lark_text(f'{HERMES_START}\n{{"name": {json.dumps(name)}, "arguments": ', added)

        return calls_grammar(start, functions, head, lark_text("}\n" + HERMES_END, added))


# gpt-oss's harmony: a call is a message on the commentary channel to the function, its
# arguments JSON, ended by <|call|>; a message after a first one opens with the role.
HARMONY_CALL_OPEN = "<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
HARMONY_CALL_END = "<|call|>"
HARMONY_NEXT_MESSAGE = "<|start|>assistant"


class HarmonyFormat(HermesFormat):
    """gpt-oss's calls. Its replies are read by the harmony reasoning parser
    (sluice/server/reasoning.py), which hands each call on as a Hermes block, so the
    calls are then parsed as Hermes's (the parser inherited); the grammar makes the
    model write them as it was trained to, in harmony's own messages."""

    name = "harmony"

    def grammar(
        self, functions: list[FunctionSpec], parallel: bool, added: Mapping[str, int]
    ) -> str:
        """One call message (or several, each after the assistant's role where
        `parallel`), as the reply's first message or after its thinking (whose end the
        reasoning format's call_end includes: the role of the next message)."""
        following = lark_text(HARMONY_NEXT_MESSAGE, added)
        start = "start: call" + (f" ({following} call)*" if parallel else "")
        return calls_grammar(
            start,
            functions,
            lambda name: lark_text(HARMONY_CALL_OPEN.format(name=name), added),
            lark_text(HARMONY_CALL_END, added),
        )


FORMATS: dict[str, ToolCallFormat] = {"hermes": HermesFormat(), "harmony": HarmonyFormat()}


# ---- OpenAI's shapes -------------------------------------------------------------------


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """The finish_reason to report: "tool_calls" for an output that ended by itself after
    calling; a call cut off by max_tokens keeps "length", which says that it was cut."""
    return "tool_calls" if made_calls and reason == "stop" else reason


def message_fields(
    parser: ToolCallParser, text: str, reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """A whole output as an assistant message (content null when empty, tool_calls when
    there are any) and its finish_reason."""
    content, calls = parse_all(parser, text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message, finish_reason(reason, bool(calls))


def _call_chunk(piece: CallDelta) -> dict[str, Any]:
    if piece.id is None:
        return {"index": piece.index, "function": {"arguments": piece.arguments}}
    function = {"name": piece.name, "arguments": piece.arguments}
    return {"index": piece.index, "id": piece.id, "type": "function", "function": function}


def stream_delta(
    parser: ToolCallParser, text: str, reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """The chunk delta for the next piece of output, as OpenAI streams calls (id, type and
    name in a call's first piece; arguments in pieces), and the chunk's finish_reason."""
    parsed = parser.feed(text, final=reason is not None)
    delta: dict[str, Any] = {}
    if parsed.content:
        delta["content"] = parsed.content
    if parsed.calls:
        delta["tool_calls"] = [_call_chunk(piece) for piece in parsed.calls]
    return delta, finish_reason(reason, parser.num_calls > 0)
