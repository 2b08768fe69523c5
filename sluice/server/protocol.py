"""OpenAI request bodies (pydantic) and the OpenAI-shaped error they fail with.

Models are strict (a string is not a number, 5.0 is not an int) and ignore unknown
fields, as OpenAI does. Responses are plain dicts built in the app: streaming builds
many small chunks and pydantic would only add cost there.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields both endpoints share; None means "the default"."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions, which clients use through `extra_body`.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # Accepted only at their "off" values; anything else is a 400 that says so.
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    parallel_tool_calls: Any = None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


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
