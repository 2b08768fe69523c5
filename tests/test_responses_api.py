"""OpenAI's Responses API (/v1/responses) through the official `openai` SDK against a
real `sluice serve` of the bundled SmolLM2 with the shipped Hermes tool template: plain
and streamed replies (the same), a forced function call and its output in the next
turn through previous_response_id, a JSON-schema text.format that validates, the
stored responses (GET, DELETE), and errors naming this API's fields."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from serving import Server, wait_idle

MODEL = "smollm2-135m"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS: Any = [{"type": "function", "name": "get_weather", "description": "The weather",
               "parameters": WEATHER}]  # fmt: skip
ASK = "What is the weather like in Paris today?"


@pytest.fixture(scope="module")
def server(hermes_server: Server) -> Server:
    return hermes_server  # conftest.py: one server for the API tests


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client()


def test_plain_and_streamed_replies_agree(client: openai.OpenAI) -> None:
    kwargs: Any = {"model": MODEL, "input": ASK, "instructions": "Be brief.",
                   "temperature": 0, "max_output_tokens": 24}  # fmt: skip
    r = client.responses.create(**kwargs)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status in ("completed", "incomplete") and r.output_text.strip()
    assert r.usage is not None and 0 < r.usage.output_tokens <= 24
    if r.status == "incomplete":
        assert r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens"
    deltas: list[str] = []
    with client.responses.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == r.output_text
    assert final.status == r.status and len(deltas) > 1


def test_function_call_and_its_output_next_turn(client: openai.OpenAI, server: Server) -> None:
    first = client.responses.create(
        model=MODEL, input=ASK, tools=TOOLS, temperature=0, max_output_tokens=48,
        tool_choice={"type": "function", "name": "get_weather"},
    )  # fmt: skip
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    # The next turn sends only the call's output; the server keeps the rest.
    output: Any = [{"type": "function_call_output", "call_id": call.call_id,
                    "output": "18 degrees and sunny"}]  # fmt: skip
    second = client.responses.create(
        model=MODEL, input=output, previous_response_id=first.id, tools=TOOLS,
        temperature=0, max_output_tokens=16,
    )  # fmt: skip
    assert second.previous_response_id == first.id and second.output_text
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # Streamed, the call arrives as argument deltas that add up to the call.
    with client.responses.stream(
        model=MODEL, input=ASK, tools=TOOLS, tool_choice="required", temperature=0,
        max_output_tokens=48, parallel_tool_calls=False,
    ) as stream:  # fmt: skip
        pieces = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    (streamed,) = [item for item in final.output if item.type == "function_call"]
    assert "".join(pieces) == streamed.arguments == call.arguments


def test_json_schema_format_validates(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
              "age": {"type": "integer"}}, "required": ["name", "age"]}  # fmt: skip
    r = client.responses.create(
        model=MODEL, input="Invent a person.", max_output_tokens=64, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema}},
    )  # fmt: skip
    jsonschema.validate(json.loads(r.output_text), schema)


def test_stored_responses(client: openai.OpenAI, server: Server) -> None:
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="And?", previous_response_id=unstored.id)


BAD: list[tuple[dict[str, Any], str]] = [
    ({"input": []}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"type": "message", "role": "user",
                 "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}},
     "text.format"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param"), BAD)
def test_bad_requests_name_the_field(server: Server, body: dict[str, Any], param: str) -> None:
    r = server.post("/v1/responses", {"model": MODEL, **body})
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"].startswith(param), r.json()
    r = httpx.get(f"{server.url}/v1/responses/resp_nope", headers=server.headers)
    assert r.status_code == 404
    stats = wait_idle(server)
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]
