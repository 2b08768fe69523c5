"""Structured output through the OpenAI API: `response_format` on both endpoints and the
`structured_outputs` extra (and its `guided_*` spellings), driven by the official
`openai` client against a real `sluice serve` on the bundled model."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from serving import Server, serve, wait_idle

MODEL = "smollm2-135m"
YES_NO = r"(yes|no), because [a-z ]{1,20}\."
ANSWER_GBNF = 'root ::= "The answer is " [A-D] "."'
BAD = {"name": "x", "schema": {"type": "nope"}}


class Person(BaseModel):
    name: str
    age: int


class City(BaseModel):
    name: str
    country: str
    # Bounded, as a real schema would be: with an unbounded integer, greedy decoding in
    # fp32 (the dtype on AVX2-only CPUs) writes "1111..." until max_tokens on this model.
    population: int = Field(ge=0, le=100_000_000)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with serve("--max-model-len", "1024", "--kv-cache-memory", "0.25") as srv:
        yield srv


def _chat(content: str) -> list[Any]:
    return [{"role": "user", "content": content}]


def test_parse_returns_a_pydantic_object(server: Server) -> None:
    completion = server.client().chat.completions.parse(
        model=MODEL,
        messages=_chat("Describe Paris as JSON with its name, country and population."),
        response_format=City,
        temperature=0,
        max_tokens=200,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City)
    assert completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_json_object_parses(server: Server, endpoint: str) -> None:
    """Every output ends on its own (max_tokens is generous for this prompt) and is a JSON
    object."""
    client = server.client()
    for temperature, seed in ((0.0, 0), (0.8, 1), (0.8, 2)):
        kwargs: dict[str, Any] = {
            "model": MODEL,
            "temperature": temperature,
            "seed": seed,
            "max_tokens": 160,
            "extra_body": {"response_format": {"type": "json_object"}},
        }
        if endpoint == "chat":
            r = client.chat.completions.create(
                messages=_chat("Give me a JSON object with the name and age of a person."),
                **kwargs,
            )
            text, reason = r.choices[0].message.content or "", r.choices[0].finish_reason
        else:
            r2 = client.completions.create(
                prompt="A person's name and age as a JSON object:", **kwargs
            )
            text, reason = r2.choices[0].text, r2.choices[0].finish_reason
        assert reason == "stop", text
        assert isinstance(json.loads(text), dict), text


def test_json_schema_stream_concatenates_to_valid_json(server: Server) -> None:
    # A prompt whose answer is short: a bf16 run's greedy text depends on what the
    # prefix cache holds, and a long rambling object could reach max_tokens.
    schema = Person.model_json_schema()
    stream = server.client().chat.completions.create(
        model=MODEL,
        messages=_chat("Give me a JSON object with the name and age of a person."),
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema, "strict": True},
        },
        temperature=0,
        max_tokens=200,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}}, r"[0-9]{3}-[0-9]{4}"),
        ({"guided_regex": YES_NO}, YES_NO),
        ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, r"red|green|blue"),
        ({"guided_choice": ["Paris", "London"]}, r"Paris|London"),
        ({"structured_outputs": {"grammar": ANSWER_GBNF}}, r"The answer is [A-D]\."),
    ],
)  # fmt: skip
def test_regex_choice_and_grammar_hold(server: Server, extra: dict[str, Any], check: str) -> None:
    for seed in range(2):
        r = server.client().chat.completions.create(
            model=MODEL,
            messages=_chat("Answer the question: what is the capital of France?"),
            temperature=1.0,
            seed=seed,
            max_tokens=40,
            extra_body=extra,
        )
        text = r.choices[0].message.content or ""
        assert re.fullmatch(check, text), text
        assert r.choices[0].finish_reason == "stop"


def _post(
    server: Server, body: dict[str, Any], path: str = "/v1/chat/completions"
) -> httpx.Response:
    base = {"model": MODEL, "max_tokens": 8}
    if path.endswith("chat/completions"):
        base["messages"] = _chat("hi")
    else:
        base["prompt"] = "hi"
    return server.post(path, {**base, **body})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": BAD}}, "response_format"),
        ({"response_format": "json"}, "response_format"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"pattern": "a"}}, "structured_outputs.pattern"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400s_naming_the_field(
    server: Server, body: dict[str, Any], param: str
) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = _post(server, body, path)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param, err
        assert err["type"] == "invalid_request_error"


def test_server_keeps_serving_after_bad_constraints(server: Server) -> None:
    for _ in range(3):
        assert _post(server, {"structured_outputs": {"regex": "(("}}).status_code == 400
    r = _post(server, {"structured_outputs": {"choice": ["ok"]}})
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "ok"
    stats = wait_idle(server)
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]


def test_text_response_format_is_unconstrained(server: Server) -> None:
    # A prompt under one KV block: the second request does not hit the prefix cache, so
    # it computes exactly what the first did.
    body = {"prompt": "The three primary colors are", "temperature": 0, "max_tokens": 12}
    plain = _post(server, body, "/v1/completions").json()
    text = _post(server, {**body, "response_format": {"type": "text"}}, "/v1/completions").json()
    assert plain["choices"][0]["text"] == text["choices"][0]["text"]


def test_n_choices_each_follow_the_schema(server: Server) -> None:
    schema = Person.model_json_schema()
    r = server.client().chat.completions.create(
        model=MODEL,
        messages=_chat("Give me a JSON object with the name and age of a person."),
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        n=3,
        temperature=0.8,
        seed=7,
        max_tokens=200,
    )
    assert len(r.choices) == 3
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content or ""), schema)


def test_logprobs_with_a_constraint(server: Server) -> None:
    r = server.client().chat.completions.create(
        model=MODEL,
        messages=_chat("Pick a color."),
        extra_body={"structured_outputs": {"choice": ["red", "green"]}},
        temperature=0,
        max_tokens=10,
        logprobs=True,
        top_logprobs=2,
    )
    c = r.choices[0]
    assert c.message.content in ("red", "green")
    assert c.logprobs is not None and c.logprobs.content
    assert "".join(t.token for t in c.logprobs.content) == c.message.content


def test_openai_errors_surface_in_the_client(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(
            model=MODEL,
            messages=_chat("hi"),
            response_format={"type": "json_schema", "json_schema": BAD},
        )
    assert info.value.status_code == 400


def test_metrics_count_forced_tokens_and_grammars(server: Server) -> None:
    before = server.metrics()
    r = _post(server, {"structured_outputs": {"choice": ["forty-two is the answer"]}})
    assert r.json()["choices"][0]["message"]["content"] == "forty-two is the answer"
    after = server.metrics()
    assert after["sluice_structured_forced_tokens"] > before["sluice_structured_forced_tokens"]
    assert after["sluice_structured_grammars_compiled"] >= 1
