"""The OpenAI-compatible FastAPI app over an engine client, assembled from its parts.

The endpoints live in ``routes/`` (one module per group; the chat playground's page
and assets in ``static/``), request validation in ``validation.py`` and
``messages.py``, streaming in ``streaming.py``, errors in ``errors.py`` and the API
key check in ``auth.py``; this module only puts them together.

Every request is validated before anything reaches the engine, so a bad request is a
4xx naming its field, never an exception in the engine loop; requests are submitted
before a streaming response starts, so even streamed requests get a proper status
code for bad input.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from sluice.core.choices import ReasoningParserName
from sluice.engine.async_engine import EngineClient
from sluice.loader.tokenizer import Tokenizer
from sluice.server.auth import ApiKeyMiddleware
from sluice.server.context import ServerContext
from sluice.server.errors import install_error_handlers
from sluice.server.metrics import ServerMetrics
from sluice.server.reasoning import reasoning_format
from sluice.server.routes import ROUTERS
from sluice.server.routes.playground import static_files
from sluice.server.validation import max_body_bytes


def build_app(
    llm: EngineClient,
    tokenizer: Tokenizer,
    model_name: str,
    *,
    vocab_size: int | None = None,
    api_key: str | None = None,
    metrics_without_auth: bool = False,
    reasoning_parser: ReasoningParserName | None = None,
) -> FastAPI:
    """The FastAPI app serving `llm` under the name `model_name`. With `api_key`, every
    route but /health and the static playground needs it (/metrics too unless
    `metrics_without_auth`). Its lifespan shuts the engine loop down when the server
    stops."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # Uvicorn has already waited for (or cancelled) open responses: stop the loop.
        await asyncio.to_thread(llm.shutdown)

    app = FastAPI(title="sluice", lifespan=lifespan)
    app.state.ctx = ServerContext(
        llm=llm,
        tokenizer=tokenizer,
        model_name=model_name,
        vocab_size=vocab_size or tokenizer.vocab_size,
        max_model_len=llm.max_model_len,
        max_body_bytes=max_body_bytes(llm.max_model_len),
        metrics=ServerMetrics(model_name),
        created=int(time.time()),
        reasoning=reasoning_format(reasoning_parser, tokenizer.chat_template),
    )
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, metrics_public=metrics_without_auth)
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    app.mount("/static", static_files(), name="static")
    return app
