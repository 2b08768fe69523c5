"""Request bodies are untrusted input: hypothesis mutates valid bodies of every endpoint
(each known field set to arbitrary JSON, unknown fields added, whole bodies replaced)
and the app, with the bundled model's real tokenizer and chat template over a fake
engine, must answer each with a 2xx or a 4xx in its API's error shape: never a 500,
never an exception. `make fuzz` runs many more examples."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import FakeEngine

from sluice.engine.async_engine import AsyncLLM
from sluice.loader import load_tokenizer
from sluice.server.app import build_app

ASK = [{"role": "user", "content": "hi"}]
VALID: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 3},
    "/v1/chat/completions": {"messages": ASK, "max_tokens": 3},
    "/v1/messages": {"model": "m", "max_tokens": 3, "messages": ASK},
    "/v1/messages/count_tokens": {"model": "m", "messages": ASK},
    "/v1/responses": {"input": "hi", "max_output_tokens": 3},
    "/tokenize": {"prompt": "hi"},
}
# Fields each endpoint reads, to aim the mutations where the parsing is.
FIELDS = sorted(
    {
        "prompt", "max_tokens", "messages", "tools", "tool_choice", "stream", "n", "stop",
        "temperature", "top_p", "top_k", "logprobs", "top_logprobs", "logit_bias", "seed",
        "response_format", "structured_outputs", "system", "stop_sequences", "thinking",
        "output_config", "input", "instructions", "text", "previous_response_id",
        "max_output_tokens", "chat_template_kwargs", "parallel_tool_calls", "model",
        "min_tokens", "stop_token_ids", "presence_penalty", "echo", "best_of",
    }
)  # fmt: skip

# No subnormal floats: earlier tests leave the CPU flushing them to zero (torch kernels
# set FTZ/DAZ), and hypothesis refuses to draw them then.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_subnormal=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, Any]:
    path = draw(st.sampled_from(sorted(VALID)))
    if draw(st.integers(0, 9)) == 0:
        return path, draw(JSON)  # not even an object, sometimes
    body = dict(VALID[path])
    for field in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3)):
        body[field] = draw(JSON)
    return path, body


@pytest.fixture(scope="module")
def app() -> Iterator[FastAPI]:
    _, tokenizer = load_tokenizer(None)
    llm = AsyncLLM(FakeEngine(), max_waiting_requests=64)  # type: ignore[arg-type]
    try:
        yield build_app(llm, tokenizer, "m")
    finally:
        llm.shutdown()


def _send(app: FastAPI, path: str, body: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as c:
            r = await c.post(path, content=json.dumps(body))
            await r.aread()  # a stream to its end
            return r

    return asyncio.run(go())


@settings(
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(request=requests())
def test_mutated_bodies_get_a_clean_answer(app: FastAPI, request: tuple[str, Any]) -> None:
    path, body = request
    r = _send(app, path, body)
    assert r.status_code < 500, (path, body, r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()
        if path.startswith("/v1/messages"):
            assert err["type"] == "error" and err["error"]["message"], err
        else:
            assert err["error"]["message"], err
