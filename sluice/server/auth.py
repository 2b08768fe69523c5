"""The API key check: /v1 requests need ``Authorization: Bearer <key>``.

Pure ASGI, so it does not get in the way of streaming or disconnect detection.
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from sluice.server.errors import error_body


class ApiKeyMiddleware:
    """401 for /v1 requests without the right bearer key."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        auth = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                auth = value
        # Constant-time: the comparison must not leak how much of the key matched.
        if hmac.compare_digest(auth, self.expected):
            await self.app(scope, receive, send)
            return
        response = JSONResponse(
            error_body(
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                "invalid_request_error",
                None,
                "invalid_api_key",
            ),
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)
