"""The proxy in front of a prefill and a decode instance (`sluice serve --role proxy`).

For each completion or chat request it asks the prefill instance for one token with
`kv_transfer_params={"do_remote_decode": true}` (it computes the prompt and holds the
prompt's KV blocks), then sends the client's own request to the decode instance with
the transfer params the prefill instance returned (it pulls the blocks, computes at
most the last partial block and generates), and relays that answer, streamed or not.
The proxy holds no model and no state: it is an HTTP client (httpx) of the two.

Errors reach the client as OpenAI-style JSON: an error status from either instance is
passed through as it is (a bad field is a 400 naming it, from the prefill instance's
validation); an instance that cannot be reached, or fails mid-answer, is a 502 naming
which one. A prefill response without transfer params (the prefill instance had no
room to hold the blocks) still gets an answer: the decode instance then computes the
whole prompt. A batch of prompts skips the prefill instance for the same reason.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from sluice.server.errors import OpenAIError, error_body, install_error_handlers
from sluice.server.http_protocol import SluiceH11Protocol
from sluice.server.validation import read_json

logger = logging.getLogger("sluice.server")

# Fields that ask for more than the prefill instance's one token; the decode instance
# gets the client's request as it came.
_PREFILL_DROPS = frozenset(
    ("stream", "stream_options", "max_completion_tokens", "min_tokens", "best_of", "n")
) | {"logprobs", "top_logprobs"}


def _unreachable(role: str, url: str, exc: Exception) -> OpenAIError:
    return OpenAIError(
        502,
        f"the {role} instance at {url} did not answer: {exc or type(exc).__name__}",
        type="server_error",
        code=f"{role}_unavailable",
    )


def _forward_headers(request: Request) -> dict[str, str]:
    auth = request.headers.get("authorization")
    return {"Authorization": auth} if auth else {}


def _relay(resp: httpx.Response) -> JSONResponse:
    """An instance's answer as the proxy's, status and all (errors keep their shape)."""
    try:
        body = resp.json()
    except ValueError:
        body = error_body(resp.text[:500] or resp.reason_phrase, "server_error")
    return JSONResponse(body, status_code=resp.status_code)


def _one_prompt(body: dict[str, Any]) -> bool:
    prompt = body.get("prompt")
    return not (isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list))


class Proxy:
    """The two instances' URLs and the HTTP client to them."""

    def __init__(self, prefill_url: str, decode_url: str, client: httpx.AsyncClient) -> None:
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")
        self.client = client

    async def prefill(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        """The transfer params for `body`'s prompt, or a JSONResponse with the prefill
        instance's error."""
        ask = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
        ask |= {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        try:
            resp = await self.client.post(self.prefill_url + path, json=ask, headers=headers)
        except httpx.HTTPError as exc:
            raise _unreachable("prefill", self.prefill_url, exc) from exc
        if resp.status_code != 200:
            return _relay(resp)
        return resp.json().get("kv_transfer_params")

    async def decode(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        url = self.decode_url + path
        if not body.get("stream"):
            try:
                return _relay(await self.client.post(url, json=body, headers=headers))
            except httpx.HTTPError as exc:
                raise _unreachable("decode", self.decode_url, exc) from exc
        try:
            resp = await self.client.send(
                self.client.build_request("POST", url, json=body, headers=headers), stream=True
            )
        except httpx.HTTPError as exc:
            raise _unreachable("decode", self.decode_url, exc) from exc
        if resp.status_code != 200:
            await resp.aread()
            await resp.aclose()
            return _relay(resp)
        return StreamingResponse(self._events(resp), media_type="text/event-stream")

    async def _events(self, resp: httpx.Response) -> AsyncIterator[bytes]:
        """The decode instance's events as they come; if it fails mid-stream, an
        error event and [DONE], as the server itself ends a stream that failed."""
        try:
            async for chunk in resp.aiter_bytes():
                yield chunk
        except httpx.HTTPError as exc:
            err = _unreachable("decode", self.decode_url, exc)
            yield f"data: {json.dumps(err.body())}\n\ndata: [DONE]\n\n".encode()
        finally:
            await resp.aclose()

    async def handle(self, request: Request, path: str) -> Response:
        body = await read_json(request)
        headers = _forward_headers(request)
        if _one_prompt(body):
            params = await self.prefill(path, body, headers)
            if isinstance(params, Response):
                return params
            if params is not None:
                body = {**body, "kv_transfer_params": params}
        return await self.decode(path, body, headers)


def build_proxy_app(
    prefill_url: str, decode_url: str, transport: httpx.AsyncBaseTransport | None = None
) -> FastAPI:
    """The proxy's app; `transport` lets tests reach in-process instances."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # No read timeout: a long generation streams for as long as it takes.
        timeout = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None)
        async with httpx.AsyncClient(timeout=timeout, transport=transport) as client:
            app.state.proxy = Proxy(prefill_url, decode_url, client)
            yield

    app = FastAPI(title="sluice proxy", lifespan=lifespan)
    install_error_handlers(app)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        proxy: Proxy = request.app.state.proxy
        return await proxy.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        proxy: Proxy = request.app.state.proxy
        return await proxy.handle(request, "/v1/chat/completions")

    @app.get("/health", response_model=None)
    async def health(request: Request) -> Response:
        proxy: Proxy = request.app.state.proxy
        for role, url in (("prefill", proxy.prefill_url), ("decode", proxy.decode_url)):
            try:
                resp = await proxy.client.get(url + "/health")
            except httpx.HTTPError as exc:
                raise _unreachable(role, url, exc) from exc
            if resp.status_code != 200:
                return _relay(resp)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models", response_model=None)
    async def models(request: Request) -> Response:
        proxy: Proxy = request.app.state.proxy
        try:
            url = proxy.decode_url + "/v1/models"
            return _relay(await proxy.client.get(url, headers=_forward_headers(request)))
        except httpx.HTTPError as exc:
            raise _unreachable("decode", proxy.decode_url, exc) from exc

    return app


def run_proxy(
    prefill_url: str, decode_url: str, *, host: str, port: int, log_level: str = "info"
) -> int:
    """Serve the proxy until SIGINT/SIGTERM (it holds nothing to drain)."""
    logger.info(
        "sluice proxy at http://%s:%d: prefill %s, decode %s", host, port, prefill_url, decode_url
    )
    app = build_proxy_app(prefill_url, decode_url)
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        http=SluiceH11Protocol,
    )
    return 0
