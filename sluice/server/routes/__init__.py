"""The server's endpoints, one module per group; ``app.py`` includes their routers."""

from sluice.server.routes import chat, completions, health, models

ROUTERS = [
    health.router,
    models.router,
    completions.router,
    chat.router,
]

__all__ = ["ROUTERS"]
