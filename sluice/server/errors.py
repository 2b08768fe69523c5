"""Every failure the server answers, in OpenAI's error shape, or Anthropic's on the
Messages API's paths.

One place decides how an error looks on the wire (``{"error": {"message", "type",
"param", "code"}}``, or ``{"type": "error", "error": {"type", "message"}}`` under
``/v1/messages``) and which status an engine exception becomes, so endpoints only
raise; they never build error responses themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from sluice.core.errors import EngineShutdownError, EngineStepError, QueueFullError, RequestError
from sluice.sampling_params import SamplingParamsError

logger = logging.getLogger("sluice.server")


class OpenAIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(param: str | None, message: str, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def unsupported(param: str, what: str) -> OpenAIError:
    return bad_request(param, f"{what} is not supported by sluice", code="unsupported_parameter")


def json_kind(value: Any) -> str:
    """A value's JSON-ish type name for error messages ("null" for None)."""
    return "null" if value is None else type(value).__name__


def require_type(where: str, obj: dict[str, Any], expected: str, what: str) -> None:
    """`obj["type"]` must be `expected`; another known-looking type is unsupported (it
    names `what`), anything else a bad request."""
    kind = obj.get("type")
    if kind == expected:
        return
    if isinstance(kind, str) and kind:
        raise unsupported(f"{where}.type", f"{what} {kind!r} (only {expected!r})")
    raise bad_request(f"{where}.type", f"{where}.type must be {expected!r}")


def shutting_down(message: str = "the server is shutting down") -> OpenAIError:
    # Retry-After: another replica (or this one, restarted) can take it shortly.
    return OpenAIError(
        503, message, type="server_error", code="unavailable", headers={"Retry-After": "5"}
    )


def validation_error(exc: ValidationError) -> OpenAIError:
    """The first pydantic error as a 400 naming the field (``messages[2]``, ``stop``...)."""
    err = exc.errors(include_url=False)[0]
    loc = err.get("loc", ())
    param = None
    if loc:
        param = str(loc[0])
        if len(loc) > 1 and isinstance(loc[1], int):
            param += f"[{loc[1]}]"
    kind = err.get("type", "")
    if kind == "missing":
        message = f"'{param}' is a required field"
    else:
        got = err.get("input")
        shown = repr(got) if len(repr(got)) <= 60 else f"a {type(got).__name__}"
        message = f"invalid value for '{param}': {err.get('msg', 'invalid')} (got {shown})"
    return bad_request(param, message)


@contextmanager
def renamed_params(names: dict[str, str]) -> Iterator[None]:
    """Errors raised inside, naming another API's fields: each key of `names` (a field or
    a prefix of one, first match wins) becomes its value, in the param and the message.
    The Messages and Responses APIs are validated as chat requests."""
    try:
        yield
    except OpenAIError as exc:
        for old, new in names.items():
            if exc.param is not None and (exc.param + ".").startswith(old + "."):
                exc.message = exc.message.replace(old, new)
                exc.param = new + exc.param[len(old) :]
                break
        raise


@contextmanager
def engine_errors(prompt_param: str) -> Iterator[None]:
    """Engine-side exceptions as OpenAI errors."""
    try:
        yield
    except QueueFullError as exc:
        raise OpenAIError(
            503, str(exc), type="server_overloaded", code="queue_full", headers={"Retry-After": "1"}
        ) from None
    except EngineShutdownError as exc:
        raise shutting_down(str(exc)) from None
    except (RequestError, SamplingParamsError) as exc:
        param = prompt_param if exc.param == "prompt" else exc.param
        raise bad_request(param, str(exc)) from None
    except EngineStepError as exc:
        raise OpenAIError(500, str(exc), type="server_error", code="engine_error") from None


# Anthropic's error type for each status (its API reference, "Errors").
ANTHROPIC_PREFIX = "/v1/messages"
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _response(
    request: Request,
    status: int,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """`body` (OpenAI's shape) as the response, in Anthropic's shape on its paths."""
    if is_anthropic(request.url.path):
        body = anthropic_error_body(status, body["error"]["message"])
    return JSONResponse(body, status_code=status, headers=headers)


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


async def _openai_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return _response(request, exc.status, exc.body(), exc.headers)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    body = error_body(str(exc.detail), error_type(exc.status_code))
    return _response(request, exc.status_code, body, getattr(exc, "headers", None))


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    loc = errors[0].get("loc", ()) if errors else ()
    param = str(loc[-1]) if loc else None
    message = str(errors[0].get("msg")) if errors else "invalid request"
    return _response(request, 400, error_body(message, "invalid_request_error", param))


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error in %s", request.url.path)
    body = error_body(f"internal server error: {type(exc).__name__}", "server_error")
    return _response(request, 500, body)


def install_error_handlers(app: FastAPI) -> None:
    """Every error, FastAPI's own included, leaves the app in OpenAI's shape."""
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _internal_error)
