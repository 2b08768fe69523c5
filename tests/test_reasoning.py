"""--reasoning-parser: a reasoning model's <think>...</think> split from its answer.

The parser on whole and streamed text (any cut gives the same split); a real `sluice
serve` of the bundled SmolLM2 with `--reasoning-parser qwen3`, made to think by a
regex constraint, answering /v1/chat/completions with reasoning_content streamed and
not (a call written inside the thinking is not made); and the Messages API's thinking
blocks as the official `anthropic` SDK reads them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any, cast

import anthropic
import httpx
import httpx2
import jsonschema
import pytest
import tokenizers
from serving import API_KEY, Server, serve

from sluice.core.structured_output import StructuredOutput, ThinkingSpan
from sluice.outputs import CompletionOutput, RequestOutput
from sluice.sampling_params import SamplingParams
from sluice.server.reasoning import REASONING_FORMATS
from sluice.server.routes import messages as messages_route
from sluice.server.tool_calls import FORMATS, FunctionSpec
from sluice.server.tools import call_format
from sluice.structured.compiler import GrammarCompiler

QWEN3, R1 = REASONING_FORMATS["qwen3"], REASONING_FORMATS["deepseek_r1"]
HARMONY = REASONING_FORMATS["openai_gptoss"]
# gpt-oss's markers, as its reply is decoded (special tokens kept).
A = "<|channel|>analysis<|message|>"
F = "<|start|>assistant<|channel|>final<|message|>"
TO_TOOL = "<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>"

CASES = [
    # (format, prompt's end, output, reasoning, content)
    (QWEN3, "assistant\n", "<think>\nLet me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
    (QWEN3, "assistant\n", "  <think>a</think>b", "a", "b"),
    (QWEN3, "assistant\n", "No thinking here.", "", "No thinking here."),
    (QWEN3, "assistant\n", "<thin", "", "<thin"),  # not the tag after all
    (QWEN3, "assistant\n", "<think>cut off while thi", "cut off while thi", ""),
    (QWEN3, "assistant\n<think>\n", "opened by the template</think>ok", "opened by the template",
     "ok"),
    (QWEN3, "", "a </think> in the answer", "", "a </think> in the answer"),
    (R1, "", "thinking without the tag</think>\n\nanswer", "thinking without the tag", "answer"),
    (R1, "", "<think>with it</think>answer", "with it", "answer"),
    (R1, "", "never closed", "never closed", ""),
    # gpt-oss's harmony (the prompt ends with <|start|>assistant).
    (HARMONY, "", f"{A}Let me see.<|end|>{F}Paris.", "Let me see.", "Paris."),
    (HARMONY, "", f"{A}  a <|end|>{F} b <|return|>", "a", "b"),
    (HARMONY, "", "<|channel|>final<|message|>Just the answer.", "", "Just the answer."),
    (HARMONY, "", "No markers at all.", "", "No markers at all."),
    (HARMONY, "", "<|chan", "", "<|chan"),  # not a marker after all
    (HARMONY, "", f"{A}cut off while thi", "cut off while thi", ""),
    (HARMONY, "", f"{A}x<|end|><|start|>assistant<|chan", "x", ""),  # cut in a header
    # Two analysis messages, a preamble to the user (commentary to no one), the answer.
    (HARMONY, "", f"{A}one<|end|><|start|>assistant{A}two<|end|>"
     "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
     f"{F}Done.", "one\n\ntwo", "Checking.\n\nDone."),
    # A message to a function: the call block the tool-call parser reads.
    (HARMONY, "", f'{A}use add<|end|>{TO_TOOL}{{"a": 1}}<|call|>', "use add",
     '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'),
    (HARMONY, "", '<|start|>assistant to=functions.add<|channel|>commentary json'
     '<|message|>{"b": 2}', "", '<tool_call>\n{"name": "add", "arguments": {"b": 2}}\n'
     "</tool_call>"),  # the recipient before the channel; cut off: closed all the same
    # A body whose <|end|> the model left out ends at the next header.
    (HARMONY, "", f"{A}think{F}answer", "think", "answer"),
]  # fmt: skip


def _split(fmt: Any, prompt: str, pieces: list[str]) -> tuple[str, str]:
    parser = fmt.parser(prompt)
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        r, c = parser.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize(("fmt", "prompt", "text", "reasoning", "content"), CASES)
def test_parser_on_whole_and_streamed_text(
    fmt: Any, prompt: str, text: str, reasoning: str, content: str
) -> None:
    assert _split(fmt, prompt, [text]) == (reasoning, content)
    assert _split(fmt, prompt, list(text)) == (reasoning, content)
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _split(fmt, prompt, pieces) == (reasoning, content), pieces


def test_a_harmony_template_gets_the_harmony_split_unasked() -> None:
    from sluice.server.reasoning import reasoning_format

    harmony = "{{- '<|start|>' + role + '<|channel|>' + channel + '<|message|>' -}}"
    chatml = "{{- '<|im_start|>' + role + '\\n' + content + '<|im_end|>' -}}"
    assert reasoning_format(None, harmony) is HARMONY
    assert reasoning_format(None, chatml) is None and reasoning_format(None, None) is None
    assert reasoning_format("qwen3", harmony) is QWEN3  # asked for: as asked


# ---- a real server -----------------------------------------------------------------------

# The constraint makes SmolLM2 think (a few words), write a call inside its thinking,
# then answer: what a reasoning model's reply looks like.
THINKING = (
    r"<think>\n[a-z]{1,8}( [a-z]{1,8}){2,5}\.\n"
    r'<tool_call>\n\{"name": "add", "arguments": \{"a": 1, "b": 2\}\}\n</tool_call>\n</think>\n\n'
    r"The answer is [a-z]{1,8}( [a-z]{1,8}){0,3}\."
)
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # Its own server: with a reasoning parser, a constraint lets the model think first,
    # which SmolLM2 (no reasoning model) may take up where the other API tests expect
    # the answer at once.
    with serve(
        "--chat-template", "hermes_tools",
        "--reasoning-parser", "qwen3",
        "--max-model-len", "1024",
        "--kv-cache-memory", "0.25",
        "--dtype", "float32",
    ) as srv:  # fmt: skip
        yield srv


def _body(**changes: Any) -> dict[str, Any]:
    body = {
        "messages": [{"role": "user", "content": "What is one plus two?"}],
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 120,
        "structured_outputs": {"regex": THINKING},
    }
    return body | changes


def test_chat_reply_splits_thinking_from_answer(server: Server) -> None:
    r = server.post("/v1/chat/completions", _body())
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    message = choice["message"]
    assert message["reasoning_content"] == message["reasoning"]
    assert message["reasoning_content"].endswith("</tool_call>")
    assert "<think>" not in message["content"] and message["content"].startswith("The answer is")
    # The call written while thinking was not made.
    assert "tool_calls" not in message and choice["finish_reason"] == "stop"
    streamed = _streamed(server)
    assert streamed == (message["reasoning_content"], message["content"])


def _streamed(server: Server, request: dict[str, Any] | None = None) -> tuple[str, str]:
    """(reasoning, content) of `request` (default `_body()`) streamed, pieces joined."""
    reasoning = content = ""
    body = json.dumps((request or _body()) | {"stream": True})
    headers = {**server.headers, "Content-Type": "application/json"}
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", content=body, headers=headers, timeout=60
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            assert "tool_calls" not in delta
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
    return reasoning, content


def test_a_reply_without_thinking_is_unchanged(server: Server) -> None:
    r = server.post("/v1/chat/completions", _body(structured_outputs=None, tools=None))
    message = r.json()["choices"][0]["message"]
    assert message["content"] and message["reasoning_content"] is None


def test_template_kwargs_pass_through_and_reserved_names_are_refused(server: Server) -> None:
    r = server.post("/v1/chat/completions", _body(chat_template_kwargs={"enable_thinking": False}))
    assert r.status_code == 200
    r = server.post("/v1/chat/completions", _body(chat_template_kwargs={"messages": []}))
    assert r.status_code == 400 and "chat_template_kwargs.messages" in r.json()["error"]["param"]


# ---- gpt-oss's harmony on a real server ----------------------------------------------------

# SmolLM2 made to reply in harmony's shape: its markers spelled in text (SmolLM2 has no
# such tokens), and one special token of SmolLM2's own (<|im_start|>, id 1) inside the
# thinking, which the reply keeps: the parser reads the markers, which in gpt-oss's
# vocabulary are special tokens, only because the reply is decoded with them. The reply
# opens with a newline (which the parser skips), which with_thinking's optional free
# thinking cannot start with, and a bias on it ("\n" is SmolLM2's token 198, allowed
# nowhere else in these grammars) takes that branch: the reply is the grammar's.
FIRST_NEWLINE = {"198": 10.0}
HARMONY_REPLY = (
    'start: "\\n<|start|>assistant<|channel|>analysis<|message|>" WORDS <[1]> "<|end|>" '
    '"<|start|>assistant<|channel|>final<|message|>The answer is " WORD "."\n'
    "WORDS: /[a-z]{1,8}( [a-z]{1,8}){2,5}\\./\n"
    "WORD: /[a-z]{1,8}/\n"
)


@pytest.fixture(scope="module")
def harmony_server() -> Iterator[Server]:
    with serve(
        "--chat-template", "hermes_tools",
        "--reasoning-parser", "openai_gptoss",
        "--max-model-len", "1024",
        "--kv-cache-memory", "0.25",
        "--dtype", "float32",
    ) as srv:  # fmt: skip
        yield srv


def test_a_harmony_reply_splits_its_channels(harmony_server: Server) -> None:
    body = _body(
        tools=None, structured_outputs={"grammar": HARMONY_REPLY}, logit_bias=FIRST_NEWLINE
    )
    r = harmony_server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    thought, answer = message["reasoning_content"], message["content"]
    assert thought.endswith(".<|im_start|>") and "<|" not in thought[: -len("<|im_start|>")]
    assert answer.startswith("The answer is ") and "<|" not in answer
    assert _streamed(harmony_server, body) == (thought, answer)


# A call in harmony: thinking, then a message to the function with its arguments.
HARMONY_CALL = (
    'start: "\\n<|start|>assistant<|channel|>analysis<|message|>" WORDS "<|end|>" '
    '"<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>" '
    '"{\\"a\\": 1, \\"b\\": 2}"\n'
    "WORDS: /[a-z]{1,8}( [a-z]{1,8}){2,5}\\./\n"
)


def test_a_harmony_call_is_a_tool_call(harmony_server: Server) -> None:
    body = _body(structured_outputs={"grammar": HARMONY_CALL}, logit_bias=FIRST_NEWLINE)
    r = harmony_server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    message = choice["message"]
    assert message["reasoning_content"] and "<|" not in message["reasoning_content"]
    assert message["content"] is None and choice["finish_reason"] == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 1, "b": 2}




def test_a_required_call_on_harmony_is_a_tool_call(harmony_server: Server) -> None:
    # tool_choice required with the harmony parser: the grammar makes SmolLM2 write the
    # call as gpt-oss does (markers spelled in text here) and the reply is a tool call
    # whose arguments hold to the function's schema.
    # A schema with no room to ramble (SmolLM2 would write digits to max_tokens).
    small = {"type": "integer", "minimum": 0, "maximum": 9}
    bounded = {"type": "object", "properties": {"a": small, "b": small},
               "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "add", "parameters": bounded}}]
    body = _body(
        structured_outputs=None,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,  # one call, then the end (<|call|> is text here)
        max_tokens=200,
    )
    r = harmony_server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls", message
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "add"
    jsonschema.validate(json.loads(call["function"]["arguments"]), bounded)


class _Outputs:
    """A finished request's outputs, piece by piece, as the engine streams them."""

    def __init__(self, pieces: list[str]) -> None:
        self.outs = []
        text = ""
        for i, piece in enumerate(pieces):
            text += piece
            last = i == len(pieces) - 1
            c = CompletionOutput(0, text, list(range(i + 1)), delta_text=piece,
                                 finish_reason="stop" if last else None, stop_reason=2)  # fmt: skip
            self.outs.append(RequestOutput("r", None, [1, 2, 3], [c], last))

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        async def gen() -> AsyncIterator[RequestOutput]:
            for out in self.outs:
                yield out

        return gen()

    def close(self) -> None:
        pass  # a finished fake request: nothing to abort


@pytest.mark.parametrize(
    ("fmt", "pieces"),
    [
        (QWEN3, ["<th", "ink>\nhm", "m, two", " and one</th", "ink>\n\nThree", "."]),
        # gpt-oss's harmony, cut inside its markers.
        (HARMONY, ["<|chan", "nel|>analysis<|mess", "age|>hmm, two", " and one<|e",
                   "nd|><|start|>assistant<|channel|>final<|message|>Three", "."]),
    ],
)  # fmt: skip
def test_messages_stream_thinking_blocks_for_the_sdk(fmt: Any, pieces: list[str]) -> None:
    ctx: Any = type("Ctx", (), {"model_name": "m"})()
    reasoning = lambda: fmt.parser("assistant\n")  # noqa: E731

    async def events() -> bytes:
        stream = messages_route._events(ctx, "msg_1", 3, _Outputs(pieces), None, reasoning)  # type: ignore[arg-type]
        return "".join([e async for e in stream]).encode()

    sse = asyncio.run(events())

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, content=sse, headers={"content-type": "text/event-stream"})

    client = anthropic.Anthropic(
        api_key=API_KEY,
        base_url="http://local",
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
    )
    with client.messages.stream(
        model="m", max_tokens=8, messages=[{"role": "user", "content": "1+2?"}]
    ) as s:
        final = s.get_final_message()
    thinking, text = final.content
    assert thinking.type == "thinking" and thinking.thinking == "hmm, two and one"
    assert text.type == "text" and text.text == "Three."
    assert final.stop_reason == "end_turn"
    # The whole reply, not streamed, has the same blocks.
    whole = messages_route._content(_Outputs(["".join(pieces)]).outs[0].outputs[0], None, reasoning)
    assert whole == [b.model_dump(exclude_none=True) for b in final.content]


# ---- a constraint holds the answer, after the thinking -------------------------------------


def _byte_tokenizer(added: list[str]) -> tokenizers.Tokenizer:
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())  # one token a byte
    backend = tokenizers.Tokenizer(
        tokenizers.models.BPE({c: i for i, c in enumerate(alphabet)}, [])
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_tokens(added)
    return backend


INT_A = {"type": "object", "properties": {"a": {"type": "integer"}}}
CONSTRAINTS = [
    (StructuredOutput(json=INT_A), '{"a": 1}'),
    (StructuredOutput(json_object=True), '{"b": 2}'),
    (StructuredOutput(regex="[0-9]+/x"), "12/x"),
    (StructuredOutput(choice=["yes", "no"]), "no"),
    (StructuredOutput(grammar='start: "ok" "!"'), "ok!"),
]  # fmt: skip


@pytest.mark.parametrize("tags_are_tokens", [True, False])
@pytest.mark.parametrize(("constraint", "answer"), CONSTRAINTS)
@pytest.mark.parametrize("opened", [False, True])
def test_a_constraint_holds_the_answer_after_the_thinking(
    constraint: StructuredOutput, answer: str, tags_are_tokens: bool, opened: bool
) -> None:
    # Qwen3's <think> and </think> are added tokens; other models spell them in text.
    backend = _byte_tokenizer(["<think>", "</think>"] if tags_are_tokens else [])
    compiler = GrammarCompiler(backend, backend.get_vocab_size(), [0])
    span = ThinkingSpan("<think>", "</think>", opened)
    matcher = compiler.matcher(dataclasses.replace(constraint, thinking=span))
    start = "" if opened else "<think>"

    def accepts(text: str) -> bool:
        m = matcher.deep_copy()
        ids = backend.encode(text, add_special_tokens=False).ids
        return bool(m.consume_tokens(ids) and m.is_accepting())

    assert accepts(f"{start}free text, with </b> and {{braces}}\n</think>\n\n{answer}")
    assert accepts(answer if not opened else f"</think>{answer}")  # no thinking, or empty
    assert not accepts(f"{start}x</think>not the answer")
    assert not accepts(f"{start}x</think>\n\n\n\n{answer}")  # no free whitespace before it


@pytest.mark.parametrize(("constraint", "answer"), CONSTRAINTS)
def test_a_constraint_holds_the_answer_after_harmony_thinking(
    constraint: StructuredOutput, answer: str
) -> None:
    """gpt-oss's analysis channel, its markers special tokens, before a constrained
    final answer: the span is the format's start and end, as with_thinking builds it."""
    backend = _byte_tokenizer(["<|channel|>", "<|message|>", "<|end|>", "<|start|>"])
    compiler = GrammarCompiler(backend, backend.get_vocab_size(), [0])
    span = ThinkingSpan(HARMONY.start, HARMONY.end, False)
    matcher = compiler.matcher(dataclasses.replace(constraint, thinking=span))

    def accepts(text: str) -> bool:
        m = matcher.deep_copy()
        ids = backend.encode(text, add_special_tokens=False).ids
        return bool(m.consume_tokens(ids) and m.is_accepting())

    assert accepts(f"{HARMONY.start}free text, with <b> and {{braces}}{HARMONY.end}{answer}")
    assert accepts(answer)
    assert not accepts(f"{HARMONY.start}x{HARMONY.end}not the answer")


def test_a_required_harmony_call_is_a_message_to_the_function() -> None:
    """tool_choice required on gpt-oss: the call in harmony's own message (commentary
    channel, to=functions.f, JSON arguments to its schema, <|call|>), after thinking
    that ends at the next message's role, or at once; never the final channel, and
    never a Hermes block (a call gpt-oss was not trained to write)."""
    markers = ["<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|call|>", "<|constrain|>"]
    backend = _byte_tokenizer(markers)
    added = {m: backend.token_to_id(m) for m in markers}
    functions = [FunctionSpec("add", ADD), FunctionSpec("neg", INT_A)]
    grammar = FORMATS["harmony"].grammar(functions, True, added)
    assert HARMONY.call_end is not None
    span = ThinkingSpan(HARMONY.start, HARMONY.call_end, False)
    compiler = GrammarCompiler(backend, backend.get_vocab_size(), [0])
    matcher = compiler.matcher(StructuredOutput(grammar=grammar, thinking=span))

    def accepts(text: str) -> bool:
        m = matcher.deep_copy()
        ids = backend.encode(text, add_special_tokens=False).ids
        return bool(m.consume_tokens(ids) and m.is_accepting())

    call = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1}<|call|>'
    neg = '<|channel|>commentary to=functions.neg <|constrain|>json<|message|>{"a": 2}<|call|>'
    thought = f"{HARMONY.start}adding, it seems{HARMONY.call_end}"
    assert accepts(call) and accepts(thought + call)
    assert accepts(f"{call}<|start|>assistant{neg}")  # parallel: the next message's role
    assert not accepts(call.replace('{"a": 1}', '{"a": "one"}'))  # the schema holds
    assert not accepts(call.replace("add", "sub"))  # only the request's functions
    assert not accepts(f"{HARMONY.start}x{HARMONY.end}{call}")  # not in the final channel
    assert not accepts('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>')
    # The served format picks it: harmony's replies, harmony's calls.
    assert call_format(cast(Any, SimpleNamespace(reasoning=HARMONY))) is FORMATS["harmony"]
    assert call_format(cast(Any, SimpleNamespace(reasoning=QWEN3))) is FORMATS["hermes"]
    assert call_format(cast(Any, SimpleNamespace(reasoning=None))) is FORMATS["hermes"]
    one = FORMATS["harmony"].grammar(functions[:1], False, added)
    single = compiler.matcher(StructuredOutput(grammar=one)).deep_copy()
    twice = f"{call}<|start|>assistant{call}"
    assert not (single.consume_tokens(backend.encode(twice).ids) and single.is_accepting())


def test_the_engine_thinks_then_answers_to_the_schema(llm_fp32: Any) -> None:
    # SmolLM2 never learned to close a thought: a bias on "</think>" makes it, and the
    # grammar (opened: the prompt starts the thinking) holds what follows to the schema.
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
    }
    prompt = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    end = llm_fp32.tokenizer.encode("</think>", add_special_tokens=False)
    constraint = StructuredOutput(json=schema, thinking=ThinkingSpan("<think>", "</think>", True))
    bias = {end[0]: 5.0, **{t: 8.0 for t in end[1:]}}
    params = SamplingParams(
        temperature=0, max_tokens=64, structured_output=constraint, logit_bias=bias
    )
    text = llm_fp32.generate(prompt, params, use_tqdm=False)[0].outputs[0].text
    reasoning, content = QWEN3.parser(prompt).feed(text, final=True)
    assert reasoning and "</think>" in text
    jsonschema.validate(json.loads(content), schema)


def test_the_server_constrains_the_answer(server: Server) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    r = server.post(
        "/v1/chat/completions", _body(tools=None, structured_outputs=None, response_format=rf)
    )
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    jsonschema.validate(json.loads(message["content"]), schema)
    gbnf = {"grammar": 'root ::= "a"'}
    r = server.post("/v1/chat/completions", _body(tools=None, structured_outputs=gbnf))
    assert r.status_code == 400 and "GBNF" in r.json()["error"]["message"]
