"""The API key check, in front of every route.

Deny by default: a request needs ``Authorization: Bearer <key>`` (or ``x-api-key:
<key>``, which Anthropic's clients send) unless its path is on
a short public list (``/health``, the static playground page and its assets, and
``/metrics`` only when the operator asks for it). A route added later is therefore
protected without anyone remembering to protect it. Pure ASGI, so it does not get in
the way of streaming or disconnect detection.
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from sluice.server.errors import anthropic_error_body, error_body, is_anthropic

# Probes must work without a secret; the playground page is static and holds no data
# (every API call it makes sends the key the user typed).
PUBLIC_PATHS = frozenset({"/health", "/"})
PUBLIC_PREFIXES = ("/static/",)
METRICS_PATH = "/metrics"


def is_public(path: str, *, metrics_public: bool = False) -> bool:
    if path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES):
        return True
    return metrics_public and path == METRICS_PATH


class ApiKeyMiddleware:
    """401 for every non-public request without the right bearer key."""

    def __init__(self, app: ASGIApp, api_key: str, metrics_public: bool = False) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.expected_key = api_key.encode()
        self.metrics_public = metrics_public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_public(scope["path"], metrics_public=self.metrics_public):
            await self.app(scope, receive, send)
            return
        auth = key = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                auth = value
            elif name == b"x-api-key":
                key = value
        # Constant-time: the comparison must not leak how much of the key matched.
        if hmac.compare_digest(auth, self.expected) or hmac.compare_digest(key, self.expected_key):
            await self.app(scope, receive, send)
            return
        message = "missing or invalid API key: send 'Authorization: Bearer <key>' or 'x-api-key'"
        body = (
            anthropic_error_body(401, message)
            if is_anthropic(scope["path"])
            else error_body(message, "invalid_request_error", None, "invalid_api_key")
        )
        response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
