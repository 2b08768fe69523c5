"""Tool calling on /v1/chat/completions: one real `sluice serve` of the bundled SmolLM2
with the shipped Hermes template (its own template has no tool support), driven by
the official `openai` client; the Hermes parser on whole and streamed text; the chat
template override. A slow test runs Qwen2.5-Coder-0.5B's own template with `auto`.

SmolLM2-135M was never trained to call tools: with `required` or a named function the
grammar writes the call's frame and keeps the arguments to the schema, which is what
these tests check; whether a call is *sensible* is the slow Qwen test's business.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anthropic
import httpx
import jsonschema
import llguidance
import openai
import pytest
import tokenizers
from serving import API_KEY, Server, serve

from sluice.config import EngineConfig
from sluice.core.errors import ConfigError, ModelNotFoundError
from sluice.loader import resolve_model_path
from sluice.loader.chat_template import resolve_chat_template
from sluice.loader.gguf_metadata import GGUFMetadata
from sluice.loader.tokenizer import Tokenizer
from sluice.server.app import build_app
from sluice.server.tool_calls import (
    FunctionSpec,
    HermesFormat,
    HermesParser,
    lark_text,
    parse_all,
)

MODEL = "smollm2-135m"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


def _tool(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    function = {"name": name, "description": description, "parameters": parameters}
    return {"type": "function", "function": function}


TOOLS = [_tool("get_weather", "The weather in a city", WEATHER), _tool("add", "Add two ints", ADD)]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
# Enough for a whole call (most of it forced by the grammar) with room to spare.
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def server(hermes_server: Server) -> Server:
    return hermes_server  # conftest.py: one server for the API tests


def _request(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "temperature": 0,
        "seed": 7,
        "max_tokens": MAX_TOKENS,
    }
    return body | changes


def _check_calls(message: Any, count: int | None = None) -> list[tuple[str, str]]:
    """(name, arguments) of a message's calls, each checked against its tool's schema."""
    calls = message.tool_calls or []
    assert calls and (count is None or len(calls) == count), message
    assert message.content is None
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [(c.function.name, c.function.arguments) for c in calls]


# ---- enforced calls ---------------------------------------------------------------------


def test_required_calls_validate(server: Server) -> None:
    # SmolLM2 never learned to stop after a call, and with parallel calls allowed the
    # grammar lets it go on calling; a bias on <|im_end|>, which only counts where the
    # grammar allows the end (after a whole call), shows the reply can end there.
    (im_end,) = server.post("/tokenize", {"prompt": "<|im_end|>"}).json()["tokens"]
    r = server.client().chat.completions.create(
        **_request(tool_choice="required", logit_bias={str(im_end): 10})
    )
    assert r.choices[0].finish_reason == "tool_calls"
    _check_calls(r.choices[0].message)


@pytest.fixture(scope="module")
def one_call(server: Server) -> openai.types.chat.ChatCompletion:
    """`required` with parallel_tool_calls false: the non-streamed reference."""
    return server.client().chat.completions.create(
        **_request(tool_choice="required", parallel_tool_calls=False)
    )


def test_parallel_false_gives_exactly_one_call(one_call: Any) -> None:
    (choice,) = one_call.choices
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message, count=1)


def test_named_choice_calls_that_function_in_every_choice(server: Server) -> None:
    r = server.client().chat.completions.create(
        **_request(
            tool_choice={"type": "function", "function": {"name": "add"}},
            n=2,
            temperature=1.0,
        )
    )
    assert len(r.choices) == 2
    for choice in r.choices:  # each choice parsed on its own
        assert choice.finish_reason == "tool_calls"
        ((name, _),) = _check_calls(choice.message, count=1)
        assert name == "add"


def test_streamed_calls_reassemble_into_the_same_call(server: Server, one_call: Any) -> None:
    client = server.client()
    chunks = []
    with client.chat.completions.stream(
        **_request(tool_choice="required", parallel_tool_calls=False)
    ) as stream:
        for event in stream:
            if event.type == "chunk":
                chunks.append(event.chunk)
        final = stream.get_final_completion()
    (choice,) = final.choices
    assert choice.finish_reason == "tool_calls"
    assert _check_calls(choice.message, count=1) == _check_calls(one_call.choices[0].message)
    # As OpenAI streams them: id, type and name once, in the call's first delta; the
    # arguments in pieces; finish_reason on the last chunk.
    pieces = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or []]
    assert pieces[0].id and pieces[0].type == "function" and pieces[0].function.name
    assert all(p.id is None and p.function.name is None for p in pieces[1:])
    assert len(pieces) > 1
    reasons = [ch.finish_reason for c in chunks for ch in c.choices]
    assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}


# ---- conversations with calls and results ---------------------------------------------------

_ARGS = '{"city": "Paris", "unit": "celsius"}'  # OpenAI sends arguments as JSON text
CALLED = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": _ARGS},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
]


def test_tool_result_round_trip(server: Server) -> None:
    ids = server.post("/tokenize", {"messages": CALLED}).json()["tokens"]
    text = server.post("/detokenize", {"tokens": ids}).json()["prompt"]
    # The arguments reach the template as an object, rendered back as JSON.
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    assert call in text
    assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in text
    r = server.client().chat.completions.create(**_request(messages=CALLED, max_tokens=8))
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


# ---- bad requests -----------------------------------------------------------------------

_FN = {"name": "f", "parameters": {"type": "object"}}
BAD = [
    ("tools-not-list", {"tools": {"type": "function"}}, "tools"),
    ("tool-type", {"tools": [{"type": "retrieval", "function": _FN}]}, "tools[0].type"),
    ("tool-no-function", {"tools": [{"type": "function"}]}, "tools[0].function"),
    ("tool-name", {"tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name"),
    ("tool-duplicate", {"tools": [{"type": "function", "function": _FN}] * 2},
     "tools[1].function.name"),
    ("schema-type", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}]},
     "tools[0].function.parameters"),
    ("schema-ref", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/nope"}}}}}]},
     "tools[0].function.parameters"),
    ("schema-list", {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[0].function.parameters"),
    ("choice-word", {"tool_choice": "sometimes"}, "tool_choice"),
    ("choice-unknown-name", {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ("choice-without-tools", {"tools": None, "tool_choice": "required"}, "tool_choice"),
    ("parallel-type", {"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ("choice-and-response-format",
     {"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ("arguments-not-json", {"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{a: 1"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ("arguments-not-object", {"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "[1, 2]"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ("tool-message-no-id", {"messages": [*ASK, {"role": "tool", "content": "x"}]},
     "messages[1].tool_call_id"),
]  # fmt: skip


@pytest.mark.parametrize(("changes", "param"), [pytest.param(*c[1:], id=c[0]) for c in BAD])
def test_bad_tool_request(server: Server, changes: dict[str, Any], param: str) -> None:
    r = server.post("/v1/chat/completions", _request(**changes))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["message"]


def test_server_keeps_serving_after_bad_tools(server: Server) -> None:
    bad = _request(tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(**bad)
    r = server.client().chat.completions.create(**_request(tool_choice="none", max_tokens=2))
    assert r.choices[0].message.tool_calls is None
    stats = httpx.get(f"{server.url}/stats", headers=server.headers, timeout=10).json()
    assert stats["engine_alive"] and stats["num_step_errors"] == 0


def test_template_without_tools_is_a_400(smollm2_path: Path) -> None:
    """The bundled model's own template never reads `tools`: say so instead of dropping
    them. Answered before anything reaches the engine, so no engine is needed."""
    template = GGUFMetadata.of(smollm2_path).get("tokenizer.chat_template")
    tokenizer = Tokenizer(
        tokenizers.Tokenizer(tokenizers.models.BPE()),
        bos_token_id=None,
        eos_token_ids=[],
        chat_template=template,
    )
    assert not tokenizer.chat_template_takes_tools
    app = build_app(SimpleNamespace(max_model_len=1024), tokenizer, MODEL)  # type: ignore[arg-type]

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/chat/completions", json=_request())

    r = asyncio.run(post())
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tools"
    assert "hermes_tools" in r.json()["error"]["message"]


# ---- the chat template option ---------------------------------------------------------------


def test_chat_template_option(tmp_path: Path) -> None:
    hermes = resolve_chat_template("hermes_tools")
    assert "<tool_call>" in hermes
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    assert resolve_chat_template(str(path)) == "{{ messages[0].content }}"
    assert resolve_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    for bad in (str(tmp_path / "missing.jinja"), "{% for %}"):
        with pytest.raises(ConfigError) as info:
            resolve_chat_template(bad)
        assert info.value.param == "chat_template"
    with pytest.raises(ConfigError):
        EngineConfig(chat_template="")


# ---- the Hermes parser ---------------------------------------------------------------------

TWO_CALLS = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris \\"}<\\" ", "unit": "celsius"}}'
    '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, {}]}}\n'
    "</tool_call>\n"
)
PARSER_CASES = [
    # (text, content, [(name, arguments)])
    (TWO_CALLS, "Let me look.", [
        ("get_weather", '{"city": "Paris \\"}<\\" ", "unit": "celsius"}'),
        ("add", '{"a": 1, "b": [2, {}]}'),
    ]),
    ("No call here, only <tool_c", "No call here, only <tool_c", []),
    ("  \n", None, []),
    # Key order other than Hermes': parsed whole, arguments re-serialized.
    ('<tool_call>{"arguments": {"x":1}, "name": "f"}</tool_call> then text', "then text",
     [("f", '{"x": 1}')]),
    # Not a call after all: the model's text, as written.
    ("<tool_call>\nnot json\n</tool_call>\nok", "<tool_call>\nnot json\n</tool_call>\nok", []),
    # Cut off by max_tokens: the call as far as it got.
    ('<tool_call>\n{"name": "f", "arguments": {"x": [1', None, [("f", '{"x": [1')]),
    # A second call before the first was closed.
    ('<tool_call>{"name": "f", "arguments": {}}\n<tool_call>{"name": "g", "arguments": {}}',
     None, [("f", "{}"), ("g", "{}")]),
    # Calls without the tags (Qwen2.5-Coder's habit), only at the reply's start and only
    # of the request's functions.
    ('{"name": "f", "arguments": {"x": "}"}}\n{"name": "g", "arguments": {}}\n', None,
     [("f", '{"x": "}"}'), ("g", "{}")]),
    ('{"name": "f", "arguments": {}} and then text', "and then text", [("f", "{}")]),
    ('{"name": "other", "arguments": {}}', '{"name": "other", "arguments": {}}', []),
    ('{"answer": {"name": "f"}}', '{"answer": {"name": "f"}}', []),
    ('Sure: {"name": "f", "arguments": {}}', 'Sure: {"name": "f", "arguments": {}}', []),
    # ... or in a Markdown code block (Qwen2.5-Coder-0.5B on "auto"), fenced or not.
    ('```json\n{"name": "f", "arguments": {"x": "`"}}\n```\n```\n{"name": "g", "arguments": {}}```'
     " done", "done", [("f", '{"x": "`"}'), ("g", "{}")]),
    ('```json\n{"name": "other", "arguments": {}}\n```',
     '```json\n{"name": "other", "arguments": {}}\n```', []),
    ("```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
    ('```json\n{"name": "f", "arguments": {}}\n`` tail', "`` tail", [("f", "{}")]),
]  # fmt: skip
NAMES = frozenset({"f", "g", "get_weather", "add"})


def _feed(parser: HermesParser, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """What a client reassembles from the deltas of `pieces` fed one by one."""
    content, calls = "", []
    for i, piece in enumerate(pieces):
        delta = parser.feed(piece, final=i == len(pieces) - 1)
        content += delta.content
        for call in delta.calls:
            if call.id is not None:
                assert call.name is not None and call.index == len(calls)
                calls.append([call.name, ""])
            calls[call.index][1] += call.arguments
    return content or None, [(name, args) for name, args in calls]


@pytest.mark.parametrize(("text", "content", "calls"), PARSER_CASES)
def test_parser_on_whole_and_streamed_text(
    text: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    got_content, got_calls = parse_all(HermesParser(names=NAMES), text)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got_calls)
    rng = random.Random(0)
    for _ in range(50):  # any cut of the text gives the same reply
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _feed(HermesParser(names=NAMES), pieces) == (content, calls), pieces
    assert _feed(HermesParser(names=NAMES), list(text)) == (content, calls)


def test_parser_holds_back_what_may_start_a_call() -> None:
    parser = HermesParser()
    assert parser.feed("Sure. <tool_", final=False).content == "Sure."
    delta = parser.feed('call>\n{"name": "f", "arguments": {"a"', final=False)
    assert delta.content == "" and delta.calls[0].name == "f"
    assert delta.calls[0].arguments == '{"a"'
    assert parser.feed(": 1}}\n</tool_call>", final=True).calls[0].arguments == ": 1}"


def test_parser_keeps_max_calls() -> None:
    content, calls = parse_all(HermesParser(max_calls=1), TWO_CALLS)
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["get_weather"]
    bare = '{"name": "f", "arguments": {}}'  # without the request's names: just text
    assert parse_all(HermesParser(), bare) == (bare, [])


def test_grammar_names_added_tokens_by_id() -> None:
    # Qwen2.5's <tool_call> and </tool_call> are added tokens (not "special" in the
    # tokenizer), which llguidance matches only by id: written as text, the grammar
    # refused the model's own token and the forced call ended after "<tool_call>".
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())  # one token a byte
    backend = tokenizers.Tokenizer(
        tokenizers.models.BPE({c: i for i, c in enumerate(alphabet)}, [])
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_tokens(["<tool_call>", "</tool_call>"])  # plain added tokens, as in the GGUF
    tokenizer = Tokenizer(backend, bos_token_id=None, eos_token_ids=[])
    added = tokenizer.added_tokens
    start, end = added["<tool_call>"], added["</tool_call>"]
    assert lark_text("a<tool_call>\n", added) == f'"a" <[{start}]> "\\n"'
    assert lark_text("plain", added) == '"plain"'
    grammar = HermesFormat().grammar([FunctionSpec("f", ADD)], False, added)
    lltok = llguidance.LLTokenizer(backend.to_str(), n_vocab=backend.get_vocab_size())
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
    ids = tokenizer.encode(call)
    assert ids[0] == start and end in ids
    assert matcher.consume_tokens(ids), matcher.get_error()
    assert matcher.is_accepting()
    # The grammar without the ids (the old one) refuses the same tokens.
    old = llguidance.LLMatcher(lltok, HermesFormat().grammar([FunctionSpec("f", ADD)], False, {}))
    assert not old.consume_tokens(ids[:1])


def test_grammar_compiles_with_refs_in_parameters() -> None:
    # Each function's schema is its own %json root, so its $refs resolve.
    params = {"$defs": {"N": {"type": "integer"}}, "type": "object",
              "properties": {"n": {"$ref": "#/$defs/N"}}}  # fmt: skip
    for parallel in (True, False):
        grammar = HermesFormat().grammar([FunctionSpec("f", params)], parallel, {})
        lark = llguidance.LLMatcher.grammar_from_lark(grammar)
        assert llguidance.LLMatcher.validate_grammar(lark) == ""


# ---- a model trained to call tools ----------------------------------------------------------

QWEN = "qwen2.5-coder-0.5b"  # installed by `make install`; its <tool_call> is a token


@pytest.fixture(scope="module")
def qwen() -> Iterator[Server]:
    try:
        resolve_model_path(QWEN)
    except ModelNotFoundError as exc:
        pytest.skip(f"{QWEN} is not installed (`make install` installs it): {exc}")
    with serve("--model", QWEN, "--max-model-len", "2048", "--kv-cache-memory", "0.5") as srv:
        yield srv


def _ask_qwen(server: Server, **changes: Any) -> Any:
    body: Any = {"model": QWEN, "messages": ASK, "tools": TOOLS, "temperature": 0,
                 "max_tokens": 96} | changes  # fmt: skip
    return server.client().chat.completions.create(**body)


@pytest.mark.parametrize(
    "choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_qwen_calls_the_weather_tool(qwen: Server, choice: Any) -> None:
    # The forced choices once ended after "<tool_call>" (an added token the grammar
    # refused), and "auto" left the call in a ```json block in the content.
    choice_out = _ask_qwen(qwen, tool_choice=choice).choices[0]
    assert choice_out.finish_reason == "tool_calls", choice_out
    ((name, arguments),) = _check_calls(choice_out.message, count=1)
    assert name == "get_weather"
    assert "paris" in json.loads(arguments)["city"].lower()


def test_qwen_streamed_forced_call(qwen: Server) -> None:
    with qwen.client().chat.completions.stream(
        model=QWEN, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,  # type: ignore[arg-type]
        max_tokens=96,
    ) as stream:  # fmt: skip
        final = stream.get_final_completion()
    whole = _ask_qwen(qwen, tool_choice="required").choices[0].message
    assert _check_calls(final.choices[0].message) == _check_calls(whole)


def test_qwen_calls_through_the_messages_and_responses_apis(qwen: Server) -> None:
    client = anthropic.Anthropic(base_url=qwen.url, api_key=API_KEY, max_retries=0)
    tool: Any = {"name": "get_weather", "input_schema": WEATHER}
    msg = client.messages.create(
        model=QWEN, max_tokens=96, messages=ASK, tools=[tool], tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    )  # fmt: skip
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)
    function: Any = {"type": "function", "name": "get_weather", "parameters": WEATHER}
    r = qwen.client().responses.create(
        model=QWEN, input=ASK[0]["content"], tools=[function], tool_choice="required",
        temperature=0, max_output_tokens=96,
    )  # fmt: skip
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and "paris" in json.loads(call.arguments)["city"].lower()
