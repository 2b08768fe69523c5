"""The server's endpoints, one module per group; ``app.py`` includes their routers."""

from sluice.server.routes import (
    chat,
    completions,
    embeddings,
    health,
    lora,
    messages,
    models,
    playground,
    responses,
)

ROUTERS = [
    health.router,
    models.router,
    completions.router,
    chat.router,
    embeddings.router,
    lora.router,
    messages.router,
    responses.router,
    playground.router,
]

__all__ = ["ROUTERS"]
