"""uvicorn's HTTP/1.1 protocol (h11) with one change: a request whose header section
is over the limit gets 431 Request Header Fields Too Large, the status h11 itself
names for it, with a JSON error body, where uvicorn sends a bare 400 "Invalid HTTP
request". The limit is h11's buffer for an incomplete event (16 KiB by default), so a
4 MB header costs the server 16 KiB, not 4 MB (vLLM CVE-2025-48956)."""

from __future__ import annotations

import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from sluice.server.errors import error_body

HEADERS_TOO_LARGE = 431


class _Connection(h11.Connection):
    """h11's connection, keeping the protocol error it raised last."""

    last_error: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as exc:
            self.last_error = exc
            raise


class SluiceH11Protocol(H11Protocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        limit = self.config.h11_max_incomplete_event_size
        self.conn = _Connection(
            h11.SERVER, **({} if limit is None else {"max_incomplete_event_size": limit})
        )

    def send_400_response(self, msg: str) -> None:
        error = self.conn.last_error if isinstance(self.conn, _Connection) else None
        if error is None or error.error_status_hint != HEADERS_TOO_LARGE:
            super().send_400_response(msg)
            return
        body = json.dumps(
            error_body(
                "the request's headers are too large",
                "invalid_request_error",
                code="request_header_fields_too_large",
            )
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        for event in (
            h11.Response(status_code=HEADERS_TOO_LARGE, headers=headers),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self.transport.close()
