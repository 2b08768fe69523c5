"""The server's endpoints, one module per group; ``app.py`` includes their routers."""

from sluice.server.routes import chat, completions, health, messages, models, playground

ROUTERS = [
    health.router,
    models.router,
    completions.router,
    chat.router,
    messages.router,
    playground.router,
]

__all__ = ["ROUTERS"]
