"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the
official `anthropic` SDK against a real `sluice serve` of the bundled SmolLM2 with the
shipped Hermes tool template: text, streaming, forced tool calls whose input validates,
a tool-result turn, stop sequences, count_tokens, and errors in Anthropic's shape."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from serving import API_KEY, Server, wait_idle

MODEL = "smollm2-135m"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TOOLS: Any = [
    {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}
]
# The current SDK (2.x) has no sampling arguments; older clients send them, and so do
# these tests, as extra fields.
GREEDY = {"temperature": 0}
ASK: Any = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server(hermes_server: Server) -> Server:
    return hermes_server  # conftest.py: one server for the API tests


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    # The SDK sends the key as x-api-key.
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)


def test_text_reply_and_usage(client: anthropic.Anthropic) -> None:
    system = "You are a terse assistant."
    msg = client.messages.create(
        model=MODEL, max_tokens=24, system=system, messages=ASK, extra_body=GREEDY
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.model == MODEL
    ((block),) = msg.content
    assert block.type == "text" and block.text.strip()
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert 0 < msg.usage.output_tokens <= 24
    count = client.messages.count_tokens(model=MODEL, system=system, messages=ASK)
    cached = msg.usage.cache_read_input_tokens or 0
    assert count.input_tokens == msg.usage.input_tokens + cached > 10


def test_streamed_text_equals_the_whole_reply(client: anthropic.Anthropic) -> None:
    kwargs: Any = {"model": MODEL, "max_tokens": 32, "messages": ASK, "extra_body": GREEDY}
    whole = client.messages.create(**kwargs)
    kinds: list[str] = []
    pieces: list[str] = []
    with client.messages.stream(**kwargs) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                pieces.append(event.delta.text)
        final = stream.get_final_message()
    assert "".join(pieces) == final.content[0].text == whole.content[0].text  # type: ignore[union-attr]
    assert len(pieces) > 1
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    # Anthropic's event order: message_start, one block's start/deltas/stop, the
    # message_delta with the stop reason, message_stop.
    assert kinds[0] == "message_start"
    assert kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in kinds and "content_block_stop" in kinds


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_call_validates(client: anthropic.Anthropic, stream: bool) -> None:
    kwargs: Any = {
        "model": MODEL, "max_tokens": 64, "messages": ASK, "tools": TOOLS,
        "tool_choice": {"type": "tool", "name": "get_weather"}, "extra_body": GREEDY,
    }  # fmt: skip
    if stream:
        with client.messages.stream(**kwargs) as s:
            deltas = [e.delta.type for e in s if e.type == "content_block_delta"]
            msg = s.get_final_message()
        assert "input_json_delta" in deltas
    else:
        msg = client.messages.create(**kwargs)
    assert msg.stop_reason == "tool_use"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER)


def test_tool_result_turn(client: anthropic.Anthropic, server: Server) -> None:
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
            "input": {"city": "Paris", "unit": "celsius"}}  # fmt: skip
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 degrees, sunny"}
    messages: Any = [
        *ASK,
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, call]},
        {"role": "user", "content": [result, {"type": "text", "text": "And tomorrow?"}]},
    ]
    msg = client.messages.create(
        model=MODEL, max_tokens=16, messages=messages, tools=TOOLS, extra_body=GREEDY
    )
    assert msg.content and msg.usage.output_tokens > 0
    # The call and its result reached the template (the Hermes template renders both).
    plain = client.messages.count_tokens(model=MODEL, messages=ASK, tools=TOOLS)
    turn = client.messages.count_tokens(model=MODEL, messages=messages, tools=TOOLS)
    assert turn.input_tokens > plain.input_tokens + 20


def test_stop_sequence(client: anthropic.Anthropic) -> None:
    kwargs: Any = {"model": MODEL, "max_tokens": 32, "messages": ASK, "extra_body": GREEDY}
    text = client.messages.create(**kwargs).content[0].text  # type: ignore[union-attr]
    word = text.split()[2]  # a word the greedy reply writes
    msg = client.messages.create(**kwargs, stop_sequences=["never written", word])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == word
    assert word not in msg.content[0].text  # type: ignore[union-attr]


BAD: list[tuple[dict[str, Any], str]] = [
    ({"max_tokens": 8, "messages": []}, "messages"),
    ({"messages": ASK}, "max_tokens"),
    ({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    ]}]}, "image"),
    ({"max_tokens": 8, "messages": ASK,
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
    ({"max_tokens": 8, "messages": ASK, "tools": TOOLS,
      "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ({"max_tokens": 8, "messages": ASK, "stop_sequences": [""]}, "stop_sequences"),
    ({"max_tokens": 100_000, "messages": ASK}, "max_tokens"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "named"), BAD)
def test_bad_requests_are_anthropic_errors(
    server: Server, body: dict[str, Any], named: str
) -> None:
    # Sent raw: the SDK refuses some of these itself (a missing max_tokens, one too
    # large for a non-streamed request) before they reach the server.
    r = httpx.post(
        f"{server.url}/v1/messages", json={"model": MODEL, **body}, headers={"x-api-key": API_KEY}
    )
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error"
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and named in error["message"], error


def test_the_sdk_raises_its_bad_request_error(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=8, messages=BAD[3][0]["messages"])
    assert "image" in info.value.body["error"]["message"]  # type: ignore[index]


def test_auth_model_and_metadata(server: Server) -> None:
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        bad.messages.create(model=MODEL, max_tokens=4, messages=ASK)
    assert info.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    client = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=4, messages=ASK)
    # Fields that only mean something on Anthropic's service are accepted and ignored.
    body = {"model": MODEL, "max_tokens": 4, "messages": ASK, "metadata": {"user_id": "u"},
            "service_tier": "auto", "system": [{"type": "text", "text": "Hi.",
            "cache_control": {"type": "ephemeral"}}]}  # fmt: skip
    r = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": API_KEY})
    assert r.status_code == 200, r.text
    stats = wait_idle(server)
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]


def test_prompt_cache_hits_are_reported(client: anthropic.Anthropic, server: Server) -> None:
    # The same long prompt twice: the second reads its full blocks from the prefix cache,
    # which usage says in both APIs (clients show and price prompt caching by it).
    long_ask: Any = [{"role": "user", "content": "Tell me about rivers. " * 40}]
    first = client.messages.create(model=MODEL, max_tokens=2, messages=long_ask)
    again = client.messages.create(model=MODEL, max_tokens=2, messages=long_ask)
    assert (first.usage.cache_read_input_tokens or 0) < (again.usage.cache_read_input_tokens or 0)
    total = again.usage.input_tokens + (again.usage.cache_read_input_tokens or 0)
    assert total == first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    chat = server.client().chat.completions.create(model=MODEL, messages=long_ask, max_tokens=2)
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
    assert chat.usage.prompt_tokens_details.cached_tokens == again.usage.cache_read_input_tokens


def test_one_model_card(server: Server) -> None:
    card = server.client().models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra and card.model_extra["max_model_len"] == 1024
    r = httpx.get(f"{server.url}/v1/models/org/other", headers=server.headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_structured_output_format(client: anthropic.Anthropic, server: Server) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    msg = client.messages.create(
        model=MODEL, max_tokens=48, messages=ASK, extra_body={**GREEDY,
        "output_config": {"format": {"type": "json_schema", "schema": schema}}},
    )  # fmt: skip
    jsonschema.validate(json.loads(msg.content[0].text), schema)  # type: ignore[union-attr]
    bad = {"model": MODEL, "max_tokens": 8, "messages": ASK,
           "output_config": {"format": {"type": "json_schema", "schema": 3}}}  # fmt: skip
    r = httpx.post(f"{server.url}/v1/messages", json=bad, headers={"x-api-key": API_KEY})
    assert r.status_code == 400 and "output_config.format" in r.json()["error"]["message"]
