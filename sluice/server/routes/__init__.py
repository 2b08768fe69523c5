"""The server's endpoints, one module per group; ``app.py`` includes their routers."""

from sluice.server.routes import chat, completions, health, models, playground

ROUTERS = [
    health.router,
    models.router,
    completions.router,
    chat.router,
    playground.router,
]

__all__ = ["ROUTERS"]
