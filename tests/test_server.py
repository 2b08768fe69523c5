"""The OpenAI-compatible server: one real `sluice serve` process on the bundled model,
driven by the official `openai` client (and raw httpx where the wire format matters).

A few tests at the end run AsyncLLM and the app on a fake engine, for what a real
model cannot provoke on demand (a full waiting queue, a failing step).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI
from serving import API_KEY, Server, serve, wait_idle
from starlette.routing import Mount

from sluice.engine.async_engine import AsyncLLM, EngineStepError, QueueFullError
from sluice.kernels import cpu
from sluice.outputs import CompletionOutput, RequestMetricsOut, RequestOutput
from sluice.sampling_params import SamplingParams
from sluice.server.app import build_app

MODEL = "smollm2-135m"
MAX_MODEL_LEN = 1024
# Short prompts (under one 16-token KV block) never hit the prefix cache, so a repeated
# request computes exactly what the first one did: equality checks stay exact.
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with serve(
        "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-memory", "0.25",
        # Generous: on a loaded 2-core machine the SIGTERM test's stream can take a minute.
        "--shutdown-timeout", "120",
        # fp32: a seeded request must give the same text when it is re-sent (stream vs
        # not), though the second time its prompt comes from the prefix cache and fewer
        # rows go through the matmuls. bf16 kernels round differently with the row count.
        "--dtype", "float32",
    ) as srv:  # fmt: skip
        yield srv


# ---- plain endpoints ------------------------------------------------------------------


def test_health_models_and_auth(server: Server) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    # Every route needs the key but /health (test_every_route_needs_the_key walks them).
    r = httpx.get(f"{server.url}/v1/models")
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    # These answered without a key once (only /v1 was checked).
    for path in ("/tokenize", "/detokenize"):
        r = httpx.post(f"{server.url}{path}", json={"prompt": "hi", "tokens": [1]})
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == "invalid_api_key"
    for path in ("/stats", "/metrics"):
        assert httpx.get(f"{server.url}{path}").status_code == 401, path
        assert httpx.get(f"{server.url}{path}", headers=server.headers).status_code == 200


# Routes that answer without the key: probes must not need a secret, and the
# playground's page and assets are static (the calls the page makes send the key).
OPEN_ROUTES = {"/health", "/", "/static/playground.js"}


def _flat_routes(routes: list[Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for route in routes:
        # Recent FastAPI keeps an included router as one entry; older ones copy its routes.
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _flat_routes(inner.routes, prefix + route.include_context.prefix)
        else:
            yield prefix, route


def _route_calls(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path) for every route the app registered, path parameters filled in."""
    calls = []
    for prefix, route in _flat_routes(app.routes):
        if isinstance(route, Mount):  # static files: one of them stands for all
            calls.append(("GET", f"{prefix}{route.path}/playground.js"))
            continue
        methods = getattr(route, "methods", None)
        assert methods, f"{route!r} has no methods: teach this test how to call it"
        path = prefix + re.sub(r"\{[^}]*\}", "x", route.path)
        calls.extend((method, path) for method in sorted(methods))
    return calls


async def _check_auth(
    client: httpx.AsyncClient, calls: list[tuple[str, str]], open_paths: set[str]
) -> None:
    bearer = {"Authorization": f"Bearer {API_KEY}"}
    for method, path in calls:
        # An empty JSON object: with the key, a POST route answers 400 for it, not 401.
        body = {} if method == "POST" else None
        r = await client.request(method, path, json=body)
        if path in open_paths:
            assert r.status_code != 401, (method, path)
            continue
        assert r.status_code == 401, (method, path, r.status_code)
        assert r.headers["www-authenticate"] == "Bearer"
        wrong = {"Authorization": "Bearer x" + API_KEY}
        r = await client.request(method, path, headers=wrong, json=body)
        assert r.status_code == 401, (method, path, "wrong key")
        r = await client.request(method, path, headers=bearer, json=body)
        assert r.status_code != 401, (method, path, "with the key")
        assert r.status_code < 500, (method, path, r.text)


def _fake_app(**kw: Any) -> tuple[AsyncLLM, FastAPI]:
    llm = AsyncLLM(FakeEngine(), max_waiting_requests=8)  # type: ignore[arg-type]
    return llm, build_app(llm, FakeTokenizer(), "fake", api_key=API_KEY, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("metrics_without_auth", [False, True])
def test_api_key_covers_every_route(metrics_without_auth: bool) -> None:
    async def main() -> None:
        llm, app = _fake_app(metrics_without_auth=metrics_without_auth)
        calls = _route_calls(app)
        paths = {p for _, p in calls}
        assert paths >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize",
                         "/detokenize", "/stats", "/metrics", "/health", "/"}  # fmt: skip
        open_paths = OPEN_ROUTES | ({"/metrics"} if metrics_without_auth else set())
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                await _check_auth(client, calls, open_paths)
                if metrics_without_auth:
                    assert (await client.get("/metrics")).status_code == 200
        finally:
            llm.shutdown()

    asyncio.run(main())


def test_every_route_needs_the_key(server: Server) -> None:
    # The same walk against `sluice serve --api-key`: the CLI must wire the key through.
    llm, app = _fake_app()
    llm.shutdown()

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            await _check_auth(client, _route_calls(app), OPEN_ROUTES)

    asyncio.run(main())


def test_tokenize_detokenize(server: Server) -> None:
    r = server.post("/tokenize", {"model": MODEL, "prompt": PROMPT})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == MAX_MODEL_LEN
    r = server.post("/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert r.json()["prompt"] == PROMPT
    chat = server.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > body["count"] - 5  # the template adds a system prompt
    assert server.post("/detokenize", {"tokens": [10**9]}).json()["error"]["param"] == "tokens"


# ---- generation -------------------------------------------------------------------------


def test_completion_stream_matches_non_stream(server: Server) -> None:
    client = server.client()
    kw: dict[str, Any] = {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0.8, "seed": 1234,
    }  # fmt: skip
    full = client.completions.create(**kw)
    choice = full.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert full.usage is not None
    n_prompt = server.post("/tokenize", {"prompt": PROMPT}).json()["count"]
    assert full.usage.prompt_tokens == n_prompt
    assert full.usage.total_tokens == n_prompt + full.usage.completion_tokens

    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [choice.finish_reason]
    # The usage chunk is the last one and the only one with usage.
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_usage_is_exact_with_ignore_eos(server: Server) -> None:
    r = server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=17, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 17


def test_chat_stream_matches_non_stream(server: Server) -> None:
    client = server.client()
    messages: list[Any] = [{"role": "user", "content": "Name a fruit."}]
    kw: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 20, "seed": 7}
    full = client.chat.completions.create(**kw)
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert full.usage is not None
    n_prompt = server.post("/tokenize", {"messages": messages}).json()["count"]
    assert full.usage.prompt_tokens == n_prompt

    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [full.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert usage is not None and full.usage.prompt_tokens_details is not None
    assert usage.model_dump(exclude={"prompt_tokens_details"}) == full.usage.model_dump(
        exclude={"prompt_tokens_details"}
    )
    # The second run of the same prompt reads its full blocks from the prefix cache.
    assert usage.prompt_tokens_details is not None
    assert (
        usage.prompt_tokens_details.cached_tokens > full.usage.prompt_tokens_details.cached_tokens
    )

    # max_completion_tokens is the newer name of max_tokens.
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=3, extra_body={"ignore_eos": True}
    )
    assert r.usage is not None and r.usage.completion_tokens == 3


def test_n_greater_than_one(server: Server) -> None:
    client = server.client()
    kw: dict[str, Any] = {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 12, "n": 3, "seed": 5, "temperature": 1.0,
        "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    full = client.completions.create(**kw)
    assert sorted(c.index for c in full.choices) == [0, 1, 2]
    assert full.usage is not None and full.usage.completion_tokens == 3 * 12
    assert len({c.text for c in full.choices}) > 1  # seeds differ per choice

    texts = {i: "" for i in range(3)}
    finishes: dict[int, list[str]] = {i: [] for i in range(3)}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes[c.index].append(c.finish_reason)
    assert texts == {c.index: c.text for c in full.choices}
    assert all(len(f) == 1 for f in finishes.values())

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, n=2, seed=3
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_batched_prompts(server: Server) -> None:
    # A list of prompts: choices are indexed prompt-major, prompt i's j-th at i * n + j.
    kw: dict[str, Any] = {
        "model": MODEL, "prompt": [PROMPT, "Hello"], "max_tokens": 4, "n": 2, "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    client = server.client()
    full = client.completions.create(**kw)
    assert sorted(c.index for c in full.choices) == [0, 1, 2, 3]
    assert full.usage is not None and full.usage.completion_tokens == 16
    texts = {c.index: c.text for c in full.choices}
    # Greedy forks of one prompt sample from the same logits.
    assert texts[0] == texts[1] and texts[2] == texts[3]
    finishes = {i: 0 for i in range(4)}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            finishes[c.index] += c.finish_reason is not None
    assert finishes == {i: 1 for i in range(4)}


def test_stop_strings(server: Server) -> None:
    client = server.client()
    kw: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    base = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    words = base.split()
    assert len(words) >= 4, base
    stop = words[2]
    cut = client.completions.create(**kw, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == base[: base.index(stop)]
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(**kw, stop=stop, stream=True)
    )
    assert streamed == cut.text


def test_stop_strings_spanning_tokens(server: Server) -> None:
    client = server.client()
    kw: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    base = client.completions.create(**kw, logprobs=1, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    tokens = base.choices[0].logprobs.tokens  # type: ignore[union-attr]
    assert tokens is not None and "".join(tokens) == text
    # A stop string made of the end of one token and the start of the next, first seen there.
    stop, at = "", 0
    for k in range(len(tokens) - 1):
        at += len(tokens[k])
        candidate = tokens[k][-2:] + tokens[k + 1][:2]
        if len(tokens[k]) >= 2 and len(tokens[k + 1]) >= 2 and text.find(candidate) == at - 2:
            stop = candidate
            break
    assert stop, tokens
    expected = text[: text.index(stop)]
    for extra, want in (({}, expected), ({"include_stop_str_in_output": True}, expected + stop)):
        cut = client.completions.create(**kw, stop=[stop], extra_body=extra).choices[0]
        assert (cut.text, cut.finish_reason) == (want, "stop"), (stop, extra)
        chunks = list(client.completions.create(**kw, stop=stop, stream=True, extra_body=extra))
        assert "".join(c.choices[0].text for c in chunks) == want, (stop, extra)
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_shape(server: Server) -> None:
    client = server.client()
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert lp is not None and r.usage is not None
    n = r.usage.completion_tokens
    assert lp.tokens is not None and len(lp.tokens) == n
    assert lp.token_logprobs is not None and len(lp.token_logprobs) == n
    assert lp.top_logprobs is not None and len(lp.top_logprobs) == n
    assert lp.text_offset is not None and len(lp.text_offset) == n
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0.0
        assert 3 <= len(top) <= 4 and tok in top
        # Greedy: the chosen token is the most likely one.
        assert value == pytest.approx(max(top.values()))

    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, stream=True
    )
    streamed = [t for c in stream for t in (c.choices[0].logprobs.tokens or [])]  # type: ignore[union-attr]
    assert streamed == lp.tokens

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert chat.usage is not None
    assert content is not None and len(content) == chat.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2
    # The tokens' bytes, put together, are the reply (checked on split characters below).
    assert _joined_bytes(content).decode("utf-8") == chat.choices[0].message.content


def _joined_bytes(content: list[Any]) -> bytes:
    return b"".join(bytes(item.bytes) for item in content)


# Greedy replies of the bundled model (fp32) in which Chinese characters are split across
# tokens: byte-level BPE spells most CJK characters and emoji with two or three tokens.
CJK_CHAT = [{"role": "user", "content": "Write 'hello' in Chinese characters."}]
CJK_PROMPT = "中文：你好，世界。中文："


def _has_cjk(text: str) -> bool:
    return any("\u4e00" <= ch <= "\u9fff" for ch in text)


def test_multibyte_text_split_across_tokens(server: Server) -> None:
    client = server.client()
    kw: dict[str, Any] = {"model": MODEL, "messages": CJK_CHAT, "max_tokens": 40, "temperature": 0}
    full = client.chat.completions.create(**kw, logprobs=True)
    text = full.choices[0].message.content
    assert text and _has_cjk(text) and "\ufffd" not in text, text
    content = full.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    # The reply ends with the end-of-turn token: logprobs list it, the text skips it.
    assert full.choices[0].finish_reason == "stop" and content[-1].token == "<|im_end|>"
    content = content[:-1]
    # Some token holds only part of a character (so this test tests what it says) ...
    partial = []
    for item in content:
        try:
            bytes(item.bytes).decode("utf-8")
        except UnicodeDecodeError:
            partial.append(item)
    assert partial, [item.token for item in content]
    # ... and the tokens' bytes are the tokenizer's own: together they decode to the reply.
    assert _joined_bytes(content).decode("utf-8") == text
    ids = server.post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert server.post("/detokenize", {"tokens": ids}).json()["prompt"] == text

    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
    )
    assert streamed == text

    ckw: dict[str, Any] = {"model": MODEL, "prompt": CJK_PROMPT, "max_tokens": 30, "temperature": 0}
    whole = client.completions.create(**ckw).choices[0].text
    assert _has_cjk(whole) and "\ufffd" not in whole, whole
    deltas = [c.choices[0].text for c in client.completions.create(**ckw, stream=True)]
    assert "".join(deltas) == whole
    assert all("\ufffd" not in d for d in deltas)


def test_unknown_fields_are_ignored(server: Server) -> None:
    r = server.post(
        "/v1/completions",
        {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "frobnicate": True, "user": "u1"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2


# ---- bad input ---------------------------------------------------------------------------

C, CHAT = "/v1/completions", "/v1/chat/completions"
_LONG = "hello " * (MAX_MODEL_LEN + 50)
_MSG = [{"role": "user", "content": "hi"}]

BAD_REQUESTS: list[tuple[str, str, Any, int, str | None]] = [
    # (id, path, body (bytes: sent raw), status, param)
    ("invalid-json", C, b'{"prompt": "x",', 400, None),
    ("not-an-object", C, b"[1, 2]", 400, None),
    ("invalid-utf8", C, b'{"model": "smollm2-135m", "prompt": "\xff\xfe"}', 400, None),
    ("lone-surrogate", C, b'{"prompt": "\\ud800"}', 400, None),
    ("missing-prompt", C, {"model": MODEL}, 400, "prompt"),
    ("prompt-wrong-type", C, {"prompt": 5}, 400, "prompt"),
    ("max-tokens-string", C, {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("max-tokens-float", C, {"prompt": "x", "max_tokens": 5.5}, 400, "max_tokens"),
    ("max-tokens-negative", C, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("max-tokens-zero", C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-huge", C, {"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    ("temperature-negative", C, {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("temperature-string", C, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("top-p-zero", C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top-p-above-one", C, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("n-zero", C, {"prompt": "x", "n": 0}, 400, "n"),
    ("n-huge", C, {"prompt": "x", "n": 100000}, 400, "n"),
    ("stop-wrong-type", C, {"prompt": "x", "stop": 5}, 400, "stop"),
    ("stop-too-many", C, {"prompt": "x", "stop": ["a"] * 129}, 400, "stop"),
    ("stop-too-long", C, {"prompt": "x", "stop": ["a" * 4097]}, 400, "stop"),
    ("stop-ids-too-many", C, {"prompt": "x", "stop_token_ids": [1] * 1025}, 400,
     "stop_token_ids"),
    ("stream-wrong-type", C, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("seed-wrong-type", C, {"prompt": "x", "seed": "x"}, 400, "seed"),
    ("presence-penalty", C, {"prompt": "x", "presence_penalty": 5}, 400, "presence_penalty"),
    ("logprobs-too-many", C, {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("logit-bias-id", C, {"prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("logit-bias-key", C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("empty-prompt", C, {"prompt": ""}, 400, "prompt"),
    ("empty-prompt-list", C, {"prompt": []}, 400, "prompt"),
    ("prompt-token-out-of-range", C, {"prompt": [1, 99999999]}, 400, "prompt"),
    ("prompt-too-long", C, {"prompt": _LONG}, 400, "prompt"),
    ("prompt-far-too-long", C, {"prompt": _LONG * 20}, 400, "prompt"),
    ("chat-far-too-long", CHAT, {"messages": [{"role": "user", "content": _LONG * 20}]}, 400,
     "messages"),
    ("unknown-model", C, {"model": "gpt-4o", "prompt": "x"}, 404, "model"),
    ("echo-unsupported", C, {"prompt": "x", "echo": True}, 400, "echo"),
    ("stream-options-no-stream", C, {"prompt": "x", "stream_options": {}}, 400, "stream_options"),
    ("chat-missing-messages", CHAT, {"model": MODEL}, 400, "messages"),
    ("chat-messages-string", CHAT, {"messages": "hi"}, 400, "messages"),
    ("chat-messages-empty", CHAT, {"messages": []}, 400, "messages"),
    ("chat-message-not-object", CHAT, {"messages": ["hi"]}, 400, "messages[0]"),
    ("chat-missing-role", CHAT, {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ("chat-unknown-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ("chat-tool-without-id", CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400,
     "messages[0].tool_call_id"),
    ("chat-missing-content", CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("chat-content-number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ("chat-image-part", CHAT,
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages[0].content[0].type"),
    ("chat-too-long", CHAT, {"messages": [{"role": "user", "content": _LONG}]}, 400, "messages"),
    ("chat-max-completion-tokens", CHAT, {"messages": _MSG, "max_completion_tokens": -5}, 400,
     "max_completion_tokens"),
    ("chat-max-tokens-over-context", CHAT, {"messages": _MSG, "max_tokens": MAX_MODEL_LEN}, 400,
     "max_tokens"),
    ("chat-top-logprobs-range", CHAT, {"messages": _MSG, "logprobs": True, "top_logprobs": 30},
     400, "top_logprobs"),
    ("chat-top-logprobs-alone", CHAT, {"messages": _MSG, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("chat-tools", CHAT, {"messages": _MSG, "tools": [{"type": "function"}]}, 400,
     "tools[0].function"),
    ("chat-unknown-model", CHAT, {"model": "nope", "messages": _MSG}, 404, "model"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [pytest.param(*case[1:], id=case[0]) for case in BAD_REQUESTS],
)
def test_bad_request(server: Server, path: str, body: Any, status: int, param: str | None) -> None:
    r = server.post(path, content=body) if isinstance(body, bytes) else server.post(path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert err["message"]


def test_bad_requests_leave_the_server_clean(server: Server) -> None:
    r = server.post(C, {"prompt": _LONG})
    msg = r.json()["error"]["message"]
    assert str(MAX_MODEL_LEN) in msg  # says the limit ...
    n = server.post("/tokenize", {"prompt": _LONG}).json()["count"]
    assert str(n) in msg  # ... and the length
    # The openai client raises the matching exception with the parsed body.
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(model=MODEL, prompt="x", temperature=-1)
    assert info.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="gpt-4o", prompt="x")
    stats = wait_idle(server)
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]
    assert stats["engine_alive"] and stats["num_step_errors"] == 0


def test_oversized_bodies_are_413_before_they_are_read(server: Server) -> None:
    # 17 MB: over the 16 MiB floor (a test server's context is small). Refused by its
    # Content-Length, then with the length unknown (chunked), while it arrives.
    body = json.dumps({"model": MODEL, "prompt": "x" * (17 << 20)}).encode()
    r = server.post(C, content=body)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"
    chunks = (body[i : i + (1 << 20)] for i in range(0, len(body), 1 << 20))
    headers = {**server.headers, "Content-Type": "application/json"}
    r = httpx.post(f"{server.url}{C}", content=chunks, headers=headers, timeout=60)
    assert r.status_code == 413, r.text
    # A far too long prompt under the limit is refused without tokenizing all of it.
    r = server.post(C, {"model": MODEL, "prompt": "hello " * 2_000_000})
    assert r.status_code == 400 and "has more than that" in r.json()["error"]["message"]
    stats = wait_idle(server)
    assert stats["engine_alive"] and stats["kv_free_blocks"] == stats["kv_total_blocks"]


def test_oversized_headers_are_431(server: Server) -> None:
    """A request whose headers run past h11's 16 KiB buffer gets a 431 with a JSON error
    (uvicorn alone sends a bare 400); the server reads no more of it and keeps serving."""
    address = ("127.0.0.1", int(server.url.rsplit(":", 1)[1]))
    with socket.create_connection(address, timeout=30) as sock:
        # 32 KiB: past the limit, and all of it read by the server before it answers
        # (a client still sending when the server closes gets a reset instead).
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (32 << 10))
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), head
    assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    # A malformed request line is still uvicorn's 400.
    with socket.create_connection(address, timeout=30) as sock:
        sock.sendall(b"NOT HTTP\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 400 ")


# ---- concurrency and disconnects ----------------------------------------------------------


def test_concurrent_streams_with_cancellations(server: Server) -> None:
    before = server.metrics()
    max_tokens = 16

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await client.completions.create(
            model=MODEL,
            prompt=f"Story number {i}: once upon a time",
            max_tokens=max_tokens,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        cancel = i % 3 == 0
        finishes, usage, seen = [], None, 0
        async for chunk in stream:
            if chunk.choices:
                seen += 1
                if chunk.choices[0].finish_reason:
                    finishes.append(chunk.choices[0].finish_reason)
            usage = chunk.usage or usage
            if cancel and seen == 2:
                await stream.close()  # hang up mid-stream
                return "cancelled", seen
        assert finishes == ["length"], finishes
        assert usage is not None and usage.completion_tokens == max_tokens
        return "done", seen

    async def main() -> list[tuple[str, int]]:
        client = server.async_client()
        try:
            return await asyncio.gather(*(one(client, i) for i in range(32)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert sum(r == "cancelled" for r, _ in results) == 11
    assert sum(r == "done" for r, _ in results) == 21

    stats = wait_idle(server)
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"], stats
    after = server.metrics()
    assert after["sluice_kv_cache_free_blocks"] == after["sluice_kv_cache_total_blocks"]
    assert after["sluice_kv_cache_local_total_blocks"] == 0  # one pool: no windowed layers
    assert after["sluice_num_requests_running"] == 0
    assert after["sluice_num_requests_waiting"] == 0
    aborted = "sluice_request_success_total{finished_reason=abort}"
    assert after.get(aborted, 0) - before.get(aborted, 0) == 11
    length = "sluice_request_success_total{finished_reason=length}"
    assert after[length] - before.get(length, 0) >= 21


def test_non_streaming_disconnect_aborts(server: Server) -> None:
    # A client that gives up on a long non-streamed request must not leave it running.
    aborted = "sluice_request_success_total{finished_reason=abort}"
    before = server.metrics().get(aborted, 0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.url}{C}",
            json={"prompt": "Count:", "max_tokens": 1000, "extra": 1, "ignore_eos": True},
            headers=server.headers,
            timeout=httpx.Timeout(10, read=1.0),
        )
    stats = wait_idle(server, timeout=10)  # 1000 tokens would take far longer
    assert stats["num_requests"] == 0
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]
    assert server.metrics()[aborted] == before + 1


# ---- metrics ---------------------------------------------------------------------------


def test_metrics_parse_and_move(server: Server) -> None:
    before = server.metrics()
    server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, extra_body={"ignore_eos": True}
    )
    after = server.metrics()
    for name in (
        "sluice_time_to_first_token_seconds_count",
        "sluice_time_per_output_token_seconds_count",
        "sluice_e2e_request_latency_seconds_count",
    ):
        assert after[name] == before.get(name, 0) + 1, name
    assert after["sluice_generation_tokens_total"] - before["sluice_generation_tokens_total"] == 5
    assert after["sluice_prompt_tokens_total"] > before["sluice_prompt_tokens_total"]
    length = "sluice_request_success_total{finished_reason=length}"
    assert after[length] == before.get(length, 0) + 1
    for gauge in (
        "sluice_num_requests_running",
        "sluice_num_requests_waiting",
        "sluice_kv_cache_usage_perc",
        "sluice_prefix_cache_hit_rate",
    ):
        assert gauge in after
    # Which kernel level served: the one this CPU (or SLUICE_CPU_ISA) selects.
    stats = httpx.get(f"{server.url}/stats", headers=server.headers, timeout=10).json()
    info = [k for k in after if k.startswith("sluice_engine_info{")]
    assert info == [
        f"sluice_engine_info{{cpu_kernels={cpu.level()},dtype={stats['dtype']},"
        f"kv_cache_dtype={stats['dtype']},quantization={stats['quantization']}}}"
    ]
    assert stats["cpu_kernels"] == cpu.level()


# ---- a full queue ------------------------------------------------------------------------


def test_queue_full_is_503_on_streaming_and_chat_requests() -> None:
    # One seat and one waiting place: with one request running and one waiting, every
    # new request, streamed or not, completion or chat, finds the queue full.
    # Long enough that it cannot finish while the refused requests are sent (400 tokens
    # took ~3 s on the GGUF path's decode stack: once, the seat freed mid-test).
    long = {"prompt": PROMPT, "max_tokens": 1800, "ignore_eos": True, "stream": True}
    refused = [
        (C, {"prompt": PROMPT, "max_tokens": 2, "stream": True}),
        (CHAT, {"messages": _MSG, "max_tokens": 2, "stream": True}),
        (CHAT, {"messages": _MSG, "max_tokens": 2}),
    ]
    args = ("--max-num-seqs", "1", "--max-waiting-requests", "1", "--max-model-len", "2048",
            "--kv-cache-memory", "0.1")  # fmt: skip
    with serve(*args) as srv, httpx.Client(headers=srv.headers, timeout=60) as http:
        with http.stream("POST", f"{srv.url}{C}", json=long) as running:
            assert running.status_code == 200
            # It has started. The line iterator must outlive this line: dropping it
            # closes the response, the server aborts the request as disconnected, the
            # waiting one takes the seat, and a refused request found room (1 run in 4).
            lines = running.iter_lines()
            next(lines)
            with http.stream("POST", f"{srv.url}{C}", json=long) as waiting:
                assert waiting.status_code == 200  # accepted: it waits for the seat
                for path, body in refused:
                    r = http.post(f"{srv.url}{path}", json=body)
                    assert r.status_code == 503, (path, body, r.text)
                    assert r.headers["retry-after"] == "1"
                    assert r.json()["error"]["code"] == "queue_full"
        # Hanging up aborted both; the server takes requests again.
        stats = wait_idle(srv)
        assert stats["num_requests"] == 0, stats
        r = srv.post(C, {"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200, r.text


# ---- shutdown (last: it stops the module's server) -------------------------------------


def test_zz_sigterm_finishes_inflight_and_exits_cleanly(server: Server) -> None:
    max_tokens = 100  # long enough to still be streaming while the drain is checked
    chunks: list[Any] = []
    error: list[BaseException] = []
    started = threading.Event()

    def consume() -> None:
        try:
            stream = server.client().completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=max_tokens, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )  # fmt: skip
            for chunk in stream:
                chunks.append(chunk)
                started.set()
        except BaseException as exc:
            error.append(exc)
            started.set()

    t = threading.Thread(target=consume)
    t.start()
    assert started.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    # Draining: /health says so, and new requests get a 503 with Retry-After ...
    deadline = time.monotonic() + 30
    while (health := httpx.get(f"{server.url}/health", timeout=10)).status_code == 200:
        assert time.monotonic() < deadline, "the server never started draining"
        time.sleep(0.05)
    assert health.status_code == 503 and health.json()["status"] == "draining"
    for path, body in ((C, {"prompt": PROMPT, "max_tokens": 2}),
                       (CHAT, {"messages": _MSG, "max_tokens": 2, "stream": True})):  # fmt: skip
        r = server.post(path, body)
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "5"
        assert r.json()["error"]["code"] == "unavailable"
    # ... while the stream that was running when the signal came goes on.
    seen_during_drain = len(chunks)
    t.join(150)
    assert not error, error
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == max_tokens
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length"
    assert 0 < seen_during_drain < len(finishes), (seen_during_drain, len(finishes))
    assert server.proc.wait(timeout=60) == 0, server.log.read_text()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=2)


# ---- AsyncLLM on a fake engine --------------------------------------------------------


class FakeEngine:
    """Emits one token "x" per step per request; finishes after max_tokens. `fail_steps`
    makes that many steps raise first."""

    max_model_len = 64

    def __init__(self, fail_steps: int = 0, step_delay: float = 0.0) -> None:
        self.reqs: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.fail_steps = fail_steps
        self.step_delay = step_delay
        self.aborted: list[str] = []

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: Any = None,
    ) -> None:
        assert isinstance(prompt, list) and params is not None
        self.reqs[request_id] = (prompt, params, [])

    def abort_request(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return self.reqs.pop(request_id, None) is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_delay)
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("boom")
        outs = []
        for rid, (prompt, params, toks) in list(self.reqs.items()):
            toks.append(7)
            done = len(toks) >= (params.max_tokens or 1)
            outs.append(
                RequestOutput(
                    rid,
                    None,
                    prompt,
                    [
                        CompletionOutput(
                            0,
                            "x" * len(toks),
                            list(toks),
                            finish_reason="length" if done else None,
                            delta_text="x",
                            delta_token_ids=[7],
                        )
                    ],
                    done,
                    metrics=RequestMetricsOut(0.0, 0.0, 0.0, 1.0 if done else None),
                )
            )
            if done:
                del self.reqs[rid]
        return outs

    def stats(self) -> dict[str, Any]:
        # Everything not yet finished counts as waiting, to fill the queue on demand.
        return {"num_running": 0, "num_waiting": len(self.reqs), "num_requests": len(self.reqs)}


class FakeTokenizer:
    vocab_size = 100
    chat_template = None  # build_app reads it (a harmony template gets its parser)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 100 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "x" * len(ids)


def test_async_llm_streams_and_aborts() -> None:
    async def main() -> None:
        llm = AsyncLLM(FakeEngine(step_delay=0.01), max_waiting_requests=8)  # type: ignore[arg-type]
        try:
            stream = await llm.generate([1, 2], SamplingParams(max_tokens=3))
            outs = [o async for o in stream]
            assert [o.outputs[0].delta_text for o in outs] == ["x", "x", "x"]
            assert outs[-1].finished
            # Cancelling a consumer aborts its request.
            long = await llm.generate([1], SamplingParams(max_tokens=10**6), request_id="long")

            async def consume() -> None:
                async for _ in long:
                    pass  # drain: the test cancels this consumer

            task = asyncio.ensure_future(consume())
            await asyncio.sleep(0.05)
            task.cancel()
            await asyncio.sleep(0.1)
            assert "long" in llm.engine.aborted  # type: ignore[attr-defined]
            # So does dropping a stream half-way.
            other = await llm.generate([1], SamplingParams(max_tokens=10**6), request_id="other")
            await other.__anext__()
            del other
            await asyncio.sleep(0.1)
            assert "other" in llm.engine.aborted  # type: ignore[attr-defined]
            assert not llm.engine.has_unfinished_requests()
        finally:
            llm.shutdown()
        assert not llm.is_running

    asyncio.run(main())


def test_engine_is_built_on_the_loop_thread() -> None:
    # All OpenMP regions must start from one thread (see AsyncLLM's docstring), so the
    # engine, model load included, is built by the thread that will step it.
    built_on: list[str] = []

    def make() -> FakeEngine:
        built_on.append(threading.current_thread().name)
        return FakeEngine()

    llm = AsyncLLM(make)  # type: ignore[arg-type]
    try:
        assert built_on == ["sluice-engine"]
        assert isinstance(llm.engine, FakeEngine) and llm.max_model_len == FakeEngine.max_model_len
    finally:
        llm.shutdown()

    def broken() -> FakeEngine:
        raise ValueError("kv_cache_memory=0.0001 GiB holds fewer than 2 blocks")

    with pytest.raises(ValueError, match="kv_cache_memory"):
        AsyncLLM(broken)  # type: ignore[arg-type]


def test_queue_full_is_503_with_retry_after() -> None:
    async def main() -> None:
        engine = FakeEngine(step_delay=0.01)
        llm = AsyncLLM(engine, max_waiting_requests=2)  # type: ignore[arg-type]
        app = build_app(llm, FakeTokenizer(), "fake")  # type: ignore[arg-type]
        held = [await llm.generate([1], SamplingParams(max_tokens=10**6)) for _ in range(2)]
        try:
            with pytest.raises(QueueFullError):
                await llm.generate([1], SamplingParams(max_tokens=1))
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                r = await client.post(C, json={"prompt": "hi", "max_tokens": 1})
            assert r.status_code == 503
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
        finally:
            for s in held:
                s.abort()
            llm.shutdown()

    asyncio.run(main())


def test_step_error_fails_requests_and_keeps_serving() -> None:
    async def main() -> None:
        llm = AsyncLLM(FakeEngine(fail_steps=1), max_waiting_requests=8)  # type: ignore[arg-type]
        app = build_app(llm, FakeTokenizer(), "fake")  # type: ignore[arg-type]
        try:
            stream = await llm.generate([1], SamplingParams(max_tokens=2))
            with pytest.raises(EngineStepError):
                async for _ in stream:
                    pass  # drain until the failed step surfaces
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                r = await client.post(C, json={"prompt": "hi", "max_tokens": 2})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == "xx"
                stats = (await client.get("/stats")).json()
            assert stats["num_step_errors"] == 1 and stats["engine_alive"]
        finally:
            llm.shutdown()

    asyncio.run(main())
