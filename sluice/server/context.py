"""What every endpoint needs from the running server, in one object on ``app.state``.

Routes are plain module-level functions; they find the engine, tokenizer and metrics
here instead of closing over ``build_app``'s locals, which is what let ``build_app``
shrink to assembling the app.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from sluice.engine.async_engine import EngineClient
from sluice.loader.tokenizer import Tokenizer
from sluice.server.metrics import ServerMetrics
from sluice.server.reasoning import ReasoningFormat
from sluice.server.responses import ResponseStore


@dataclass
class ServerContext:
    llm: EngineClient
    tokenizer: Tokenizer
    model_name: str
    vocab_size: int
    max_model_len: int
    # Larger request bodies are a 413 before they are read whole (validation.py).
    max_body_bytes: int
    metrics: ServerMetrics
    created: int
    # --reasoning-parser: how the model marks its thinking (None: not split).
    reasoning: ReasoningFormat | None = None
    # The Responses API's stored responses (previous_response_id, GET /v1/responses/{id}).
    responses: ResponseStore = field(default_factory=ResponseStore)
    # Set on SIGTERM/SIGINT: in-flight requests finish, new ones get a 503.
    draining: bool = False


def server_context(request: Request) -> ServerContext:
    ctx: ServerContext = request.app.state.ctx
    return ctx
