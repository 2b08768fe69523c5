"""The OpenAI-compatible FastAPI app over an AsyncLLM.

Every request is parsed and validated by hand before anything reaches the engine, so a
bad request is a 4xx naming its field, never an exception in the engine loop. Requests
are submitted (and so validated by the engine too) before a streaming response starts,
so even streamed requests get a proper status code for bad input.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from sluice.engine.async_engine import (
    AsyncLLM,
    EngineShutdownError,
    EngineStepError,
    QueueFullError,
    RequestStream,
)
from sluice.engine.engine import RequestError
from sluice.loader.tokenizer import Tokenizer
from sluice.outputs import CompletionOutput, Logprob, RequestOutput
from sluice.sampling_params import SamplingParams, SamplingParamsError
from sluice.server.metrics import CONTENT_TYPE, ServerMetrics
from sluice.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
    bad_request,
    error_body,
    validation_error,
)

logger = logging.getLogger("sluice.server")

# OpenAI's own limit; larger n is a cheap way to exhaust the KV cache with one request.
MAX_N = 128
# JSON has no -inf; OpenAI clients expect a number, so clamp like vLLM does.
_MIN_LOGPROB = -9999.0
_CHAT_ROLES = {"system", "developer", "user", "assistant"}
_SSE_DONE = "data: [DONE]\n\n"

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


@dataclass
class _Ctx:
    llm: AsyncLLM
    tokenizer: Tokenizer
    model_name: str
    vocab_size: int
    max_model_len: int
    metrics: ServerMetrics
    created: int


# ---- parsing and validation ----------------------------------------------------------


async def _read_json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(
            None, f"the request body is not valid UTF-8 (bad byte at offset {exc.start})"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad_request(
            None,
            f"the request body is not valid JSON: {exc.msg} (line {exc.lineno}, "
            f"column {exc.colno})",
        ) from None
    except RecursionError:
        raise bad_request(None, "the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise bad_request(None, "the request body must be a JSON object")
    try:
        # "\ud800" is valid JSON but not text: the tokenizer could not encode it.
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(
            None, "the request body contains invalid UTF-8 (an unpaired surrogate escape)"
        ) from None
    return data


async def _parse(request: Request, model: type[M]) -> M:
    data = await _read_json(request)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _check_model(ctx: _Ctx, name: str | None) -> None:
    if name is not None and name != ctx.model_name:
        raise OpenAIError(
            404,
            f"The model `{name}` does not exist. This server serves `{ctx.model_name}`.",
            param="model",
            code="model_not_found",
        )


def _unsupported(param: str, what: str) -> OpenAIError:
    return bad_request(param, f"{what} is not supported by sluice", code="unsupported_parameter")


def _check_token_ids(ctx: _Ctx, param: str, ids: list[int]) -> None:
    for t in ids:
        if not 0 <= t < ctx.vocab_size:
            raise bad_request(param, f"token id {t} is out of range [0, {ctx.vocab_size})")


def _sampling_params(
    ctx: _Ctx,
    req: CompletionRequest | ChatCompletionRequest,
    *,
    max_tokens: int | None,
    max_tokens_param: str,
    logprobs: int | None,
    logprobs_param: str,
) -> SamplingParams:
    if req.n > MAX_N:
        raise bad_request("n", f"n must be <= {MAX_N}, got {req.n}")
    rename = {"max_tokens": max_tokens_param, "logprobs": logprobs_param}
    try:
        params = SamplingParams(
            n=req.n,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logit_bias=req.logit_bias,
        )
    except SamplingParamsError as exc:
        param = rename.get(exc.param, exc.param)
        raise bad_request(param, str(exc).replace(exc.param, param, 1)) from None
    if params.logit_bias:
        _check_token_ids(ctx, "logit_bias", list(params.logit_bias))
    if params.stop_token_ids:
        _check_token_ids(ctx, "stop_token_ids", params.stop_token_ids)
    return params


def _check_length(
    ctx: _Ctx, n_prompt: int, max_tokens: int | None, prompt_param: str, max_tokens_param: str
) -> None:
    limit = ctx.max_model_len
    if n_prompt >= limit:
        raise bad_request(
            prompt_param,
            f"This model's maximum context length is {limit} tokens, but the {prompt_param} "
            f"has {n_prompt} tokens (at least one token must be left for the output). "
            f"Please shorten the {prompt_param}.",
            code="context_length_exceeded",
        )
    if max_tokens is not None and n_prompt + max_tokens > limit:
        raise bad_request(
            max_tokens_param,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{n_prompt + max_tokens} tokens ({n_prompt} in the {prompt_param}, {max_tokens} "
            f"for the completion). Please reduce the {prompt_param} or {max_tokens_param}.",
            code="context_length_exceeded",
        )


def _completion_prompts(ctx: _Ctx, prompt: Any) -> list[list[int]]:
    """The prompt field as token ids: a string, token ids, or a batch of either."""
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise bad_request("prompt", "prompt must not be empty")
    result: list[list[int]] = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise bad_request("prompt", "prompt must not be empty")
            ids = ctx.tokenizer.encode(item)
        else:
            ids = list(item)
            _check_token_ids(ctx, "prompt", ids)
        if not ids:
            raise bad_request("prompt", "prompt must not be empty")
        result.append(ids)
    return result


def _message_text(index: int, role: str, content: Any) -> str:
    where = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if content is None:
        if role == "assistant":
            return ""
        raise bad_request(where, f"{where} is required for role '{role}'")
    if not isinstance(content, list):
        raise bad_request(
            where, f"{where} must be a string or a list of content parts, got {_kind(content)}"
        )
    texts = []
    for j, part in enumerate(content):
        p = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise bad_request(p, f"{p} must be an object, got {_kind(part)}")
        kind = part.get("type")
        if kind != "text":
            if isinstance(kind, str) and kind:
                raise _unsupported(f"{p}.type", f"content part type {kind!r} (only 'text')")
            raise bad_request(f"{p}.type", f"{p}.type must be 'text'")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{p}.text", f"{p}.text must be a string, got {_kind(text)}")
        texts.append(text)
    return "\n".join(texts)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _render_chat(
    ctx: _Ctx, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> list[int]:
    if not messages:
        raise bad_request("messages", "messages must be a non-empty list")
    conv: list[dict[str, str]] = []
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if not isinstance(role, str):
            raise bad_request(
                f"messages[{i}].role", f"messages[{i}].role must be a string, got {_kind(role)}"
            )
        if role not in _CHAT_ROLES:
            raise bad_request(
                f"messages[{i}].role",
                f"unsupported role {role!r} in messages[{i}]; sluice supports "
                f"{', '.join(sorted(_CHAT_ROLES))}",
            )
        if msg.get("tool_calls"):
            raise _unsupported(f"messages[{i}].tool_calls", "tool calling")
        text = _message_text(i, role, msg.get("content"))
        # Chat templates know "system"; "developer" is OpenAI's newer name for it.
        conv.append({"role": "system" if role == "developer" else role, "content": text})
    try:
        rendered = ctx.tokenizer.apply_chat_template(
            conv, add_generation_prompt=add_generation_prompt
        )
    except Exception as exc:  # the template's own raise_exception() or a Jinja error
        raise bad_request("messages", f"the chat template rejected the messages: {exc}") from None
    ids = ctx.tokenizer.encode(rendered, add_special_tokens=False)
    if not ids:
        raise bad_request("messages", "the messages render to an empty prompt")
    return ids


def _check_chat_unsupported(req: ChatCompletionRequest) -> None:
    if req.tools:
        raise _unsupported("tools", "tool calling")
    if req.functions:
        raise _unsupported("functions", "function calling")
    if req.tool_choice not in (None, "none"):
        raise _unsupported("tool_choice", "tool calling")
    if req.function_call not in (None, "none"):
        raise _unsupported("function_call", "function calling")
    if req.response_format is not None and req.response_format != {"type": "text"}:
        raise _unsupported("response_format", "a response_format other than {'type': 'text'}")
    if req.audio is not None:
        raise _unsupported("audio", "audio output")
    if req.modalities is not None and req.modalities != ["text"]:
        raise _unsupported("modalities", "an output modality other than text")
    if req.prediction is not None:
        raise _unsupported("prediction", "predicted outputs")


# ---- submitting and following requests ----------------------------------------------


@contextmanager
def _engine_errors(prompt_param: str) -> Iterator[None]:
    """Engine-side exceptions as OpenAI errors."""
    try:
        yield
    except QueueFullError as exc:
        raise OpenAIError(
            503, str(exc), type="server_overloaded", code="queue_full", headers={"Retry-After": "1"}
        ) from None
    except EngineShutdownError as exc:
        raise OpenAIError(
            503, str(exc), type="server_error", code="unavailable", headers={"Retry-After": "5"}
        ) from None
    except (RequestError, SamplingParamsError) as exc:
        param = prompt_param if exc.param == "prompt" else exc.param
        raise bad_request(param, str(exc)) from None
    except EngineStepError as exc:
        raise OpenAIError(500, str(exc), type="server_error", code="engine_error") from None


class _Tracked:
    """One request's stream that also feeds the metrics; ``close()`` aborts it if unfinished."""

    def __init__(self, stream: RequestStream, metrics: ServerMetrics, n: int) -> None:
        self.stream = stream
        self.metrics = metrics
        self.n = n
        self.final: RequestOutput | None = None
        self._first_seen = False
        self._closed = False

    def __aiter__(self) -> _Tracked:
        return self

    async def __anext__(self) -> RequestOutput:
        out = await self.stream.__anext__()
        m = self.metrics
        new_tokens = sum(len(c.delta_token_ids) for c in out.outputs)
        if new_tokens:
            m.generation_tokens.inc(new_tokens)
            if not self._first_seen:
                self._first_seen = True
                m.observe_first_token(out)
        if out.finished:
            self.final = out
            for c in out.outputs:
                m.finished(c.finish_reason or "stop")
            m.observe_finished(out)
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.final is None:
            self.metrics.finished("abort", self.n)
        self.stream.abort()


async def _merge(tracked: list[_Tracked]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's index."""
    if len(tracked) == 1:
        async for out in tracked[0]:
            yield 0, out
        return
    q: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, t: _Tracked) -> None:
        try:
            async for out in t:
                q.put_nowait((i, out))
            q.put_nowait((i, None))
        except Exception as exc:
            q.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, t)) for i, t in enumerate(tracked)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def _until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work` unless the client hangs up first (then cancel it, which aborts it)."""

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        # 499 as nginx logs it; the client is gone and never sees it.
        raise OpenAIError(499, "the client closed the request", type="client_closed")
    return task.result()


def _lp_value(value: float) -> float:
    return value if math.isfinite(value) else _MIN_LOGPROB


def _token_text(ctx: _Ctx, token_id: int, lp: Logprob) -> str:
    if lp.decoded_token is not None:
        return lp.decoded_token
    return ctx.tokenizer.decode([token_id], skip_special_tokens=False)


def _ranked(entry: dict[int, Logprob], top_n: int) -> list[tuple[int, Logprob]]:
    return sorted(
        ((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= top_n),
        key=lambda item: item[1].rank or 0,
    )


def _chat_logprobs(
    ctx: _Ctx, token_ids: list[int], entries: list[dict[int, Logprob]], top_n: int
) -> dict[str, Any]:
    content = []
    for tok, entry in zip(token_ids, entries, strict=False):
        chosen = entry.get(tok)
        if chosen is None:
            continue
        text = _token_text(ctx, tok, chosen)
        content.append(
            {
                "token": text,
                "logprob": _lp_value(chosen.logprob),
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": (t_text := _token_text(ctx, t, lp)),
                        "logprob": _lp_value(lp.logprob),
                        "bytes": list(t_text.encode("utf-8")),
                    }
                    for t, lp in _ranked(entry, top_n)
                ],
            }
        )
    return {"content": content, "refusal": None}


def _completion_logprobs(
    ctx: _Ctx,
    token_ids: list[int],
    entries: list[dict[int, Logprob]],
    top_n: int,
    offset: int,
) -> tuple[dict[str, Any], int]:
    """OpenAI's legacy logprobs object, and the text offset after these tokens."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top: list[dict[str, float]] = []
    offsets: list[int] = []
    for tok, entry in zip(token_ids, entries, strict=False):
        chosen = entry.get(tok)
        if chosen is None:
            continue
        text = _token_text(ctx, tok, chosen)
        tokens.append(text)
        token_logprobs.append(_lp_value(chosen.logprob))
        alts = {_token_text(ctx, t, lp): _lp_value(lp.logprob) for t, lp in _ranked(entry, top_n)}
        alts.setdefault(text, _lp_value(chosen.logprob))
        top.append(alts)
        offsets.append(offset)
        offset += len(text)
    obj = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }
    return obj, offset


# ---- the app -----------------------------------------------------------------------


class _ApiKeyMiddleware:
    """401 for /v1 requests without `Authorization: Bearer <key>` (pure ASGI, so it does
    not get in the way of streaming or disconnect detection)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            auth = b""
            for name, value in scope["headers"]:
                if name == b"authorization":
                    auth = value
            if not hmac.compare_digest(auth, self.expected):
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
                return
        await self.app(scope, receive, send)


def _error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def build_app(
    llm: AsyncLLM,
    tokenizer: Tokenizer,
    model_name: str,
    *,
    vocab_size: int | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """The FastAPI app serving `llm` under the name `model_name`. Its lifespan shuts the
    engine loop down when the server stops."""
    ctx = _Ctx(
        llm=llm,
        tokenizer=tokenizer,
        model_name=model_name,
        vocab_size=vocab_size or tokenizer.vocab_size,
        max_model_len=llm.max_model_len,
        metrics=ServerMetrics(model_name),
        created=int(time.time()),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # Uvicorn has already waited for (or cancelled) open responses: stop the loop.
        await asyncio.to_thread(llm.shutdown)

    app = FastAPI(title="sluice", lifespan=lifespan)
    app.state.ctx = ctx
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(str(exc.detail), _error_type(exc.status_code)),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        loc = errors[0].get("loc", ()) if errors else ()
        param = str(loc[-1]) if loc else None
        return JSONResponse(
            error_body(
                str(errors[0].get("msg")) if errors else "invalid request",
                "invalid_request_error",
                param,
            ),
            status_code=400,
        )

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s", request.url.path)
        return JSONResponse(
            error_body(f"internal server error: {type(exc).__name__}", "server_error"),
            status_code=500,
        )

    # -- plain endpoints ---------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        if not llm.is_running:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return llm.stats()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(llm.stats()), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": ctx.created,
                    "owned_by": "sluice",
                    "root": model_name,
                    "max_model_len": ctx.max_model_len,
                }
            ],
        }

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = await _parse(request, TokenizeRequest)
        _check_model(ctx, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("prompt", "give exactly one of 'prompt' or 'messages'")
        if req.messages is not None:
            ids = _render_chat(ctx, req.messages, req.add_generation_prompt)
        else:
            ids = tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        body: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": ctx.max_model_len,
            "tokens": ids,
        }
        if req.return_token_strs:
            body["token_strs"] = [tokenizer.id_to_token(i) for i in ids]
        return body

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await _parse(request, DetokenizeRequest)
        _check_model(ctx, req.model)
        _check_token_ids(ctx, "tokens", req.tokens)
        return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}

    # -- generation ----------------------------------------------------------------------

    async def submit(
        prompts: list[list[int]],
        params: SamplingParams,
        base_id: str,
        priority: int,
        prompt_param: str,
    ) -> list[_Tracked]:
        arrival = time.monotonic()
        tracked: list[_Tracked] = []
        try:
            with _engine_errors(prompt_param):
                for i, ids in enumerate(prompts):
                    rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                    stream = await llm.generate(ids, params, rid, priority, arrival)
                    tracked.append(_Tracked(stream, ctx.metrics, params.n))
        except BaseException:
            # All or nothing: a batch with one bad prompt runs none of them.
            for t in tracked:
                t.stream.abort()
            raise
        ctx.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        return tracked

    async def collect(tracked: list[_Tracked]) -> list[RequestOutput]:
        async def one(t: _Tracked) -> RequestOutput:
            async for _ in t:  # drain: only the final output matters here
                continue
            if t.final is None:
                raise OpenAIError(500, "the request ended without output", type="server_error")
            return t.final

        try:
            with _engine_errors("prompt"):
                return list(await asyncio.gather(*(one(t) for t in tracked)))
        finally:
            for t in tracked:
                t.close()

    def usage(prompts: list[list[int]], outputs: list[CompletionOutput]) -> dict[str, int]:
        p = sum(len(ids) for ids in prompts)
        c = sum(len(o.token_ids) for o in outputs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def sse(obj: dict[str, Any]) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"

    async def stream_events(
        tracked: list[_Tracked],
        prompts: list[list[int]],
        *,
        chat: bool,
        rid: str,
        n: int,
        include_usage: bool,
        top_n: int | None,
    ) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        n_choices = len(tracked) * n
        done = [False] * n_choices
        lp_sent = [0] * n_choices
        offsets = [0] * n_choices
        finals: list[CompletionOutput | None] = [None] * n_choices

        def chunk(choice: dict[str, Any]) -> str:
            body: dict[str, Any] = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model_name,
                "choices": [choice],
            }
            if include_usage:
                body["usage"] = None
            return sse(body)

        merged = _merge(tracked)
        try:
            if chat:
                for i in range(n_choices):
                    yield chunk(
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    )
            async for pi, out in merged:
                for c in out.outputs:
                    idx = pi * n + c.index
                    if done[idx]:
                        continue
                    n_tok = len(c.token_ids)
                    new_ids = c.token_ids[lp_sent[idx] : n_tok]
                    entries = (
                        c.logprobs[lp_sent[idx] : n_tok]
                        if top_n is not None and c.logprobs is not None
                        else None
                    )
                    lp_sent[idx] = n_tok
                    if not c.delta_text and c.finish_reason is None and not entries:
                        continue
                    lp_obj: dict[str, Any] | None = None
                    if entries is not None and top_n is not None:
                        if chat:
                            lp_obj = _chat_logprobs(ctx, new_ids, entries, top_n)
                        else:
                            lp_obj, offsets[idx] = _completion_logprobs(
                                ctx, new_ids, entries, top_n, offsets[idx]
                            )
                    choice: dict[str, Any] = {"index": idx}
                    if chat:
                        choice["delta"] = {"content": c.delta_text} if c.delta_text else {}
                    else:
                        choice["text"] = c.delta_text
                    choice["logprobs"] = lp_obj
                    choice["finish_reason"] = c.finish_reason
                    if c.finish_reason is not None:
                        done[idx] = True
                        finals[idx] = c
                    yield chunk(choice)
            if include_usage:
                outs = [f for f in finals if f is not None]
                yield sse(
                    {
                        "id": rid,
                        "object": obj,
                        "created": created,
                        "model": model_name,
                        "choices": [],
                        "usage": usage(prompts, outs),
                    }
                )
            yield _SSE_DONE
        except (EngineStepError, EngineShutdownError) as exc:
            # Headers are out: all we can do is say so in the stream, as vLLM does.
            yield sse(error_body(str(exc), "server_error", None, "engine_error"))
            yield _SSE_DONE
        finally:
            await merged.aclose()
            for t in tracked:
                t.close()

    def streaming(events: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response | dict[str, Any]:
        req = await _parse(request, CompletionRequest)
        _check_model(ctx, req.model)
        if req.echo:
            raise _unsupported("echo", "echo")
        if req.suffix:
            raise _unsupported("suffix", "suffix (insertion)")
        if req.best_of is not None and req.best_of != req.n:
            raise _unsupported("best_of", "best_of other than n")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options", "stream_options is only allowed with stream=true")
        params = _sampling_params(
            ctx,
            req,
            max_tokens=req.max_tokens,
            max_tokens_param="max_tokens",
            logprobs=req.logprobs,
            logprobs_param="logprobs",
        )
        prompts = _completion_prompts(ctx, req.prompt)
        explicit = "max_tokens" in req.model_fields_set
        for ids in prompts:
            # The default max_tokens (16) is capped by the engine, not an error.
            _check_length(
                ctx, len(ids), params.max_tokens if explicit else None, "prompt", "max_tokens"
            )
        rid = f"cmpl-{uuid.uuid4().hex}"
        tracked = await submit(prompts, params, rid, req.priority, "prompt")
        top_n = params.logprobs
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return streaming(
                stream_events(
                    tracked,
                    prompts,
                    chat=False,
                    rid=rid,
                    n=params.n,
                    include_usage=include_usage,
                    top_n=top_n,
                )
            )
        finals = await _until_disconnected(request, collect(tracked))
        choices = []
        outs: list[CompletionOutput] = []
        for pi, out in enumerate(finals):
            for c in out.outputs:
                lp_obj = None
                if top_n is not None and c.logprobs is not None:
                    lp_obj, _ = _completion_logprobs(ctx, c.token_ids, c.logprobs, top_n, 0)
                choices.append(
                    {
                        "index": pi * params.n + c.index,
                        "text": c.text,
                        "logprobs": lp_obj,
                        "finish_reason": c.finish_reason,
                    }
                )
                outs.append(c)
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": usage(prompts, outs),
        }

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response | dict[str, Any]:
        req = await _parse(request, ChatCompletionRequest)
        _check_model(ctx, req.model)
        _check_chat_unsupported(req)
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options", "stream_options is only allowed with stream=true")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs", "top_logprobs requires logprobs to be true")
        # max_completion_tokens is the current name; max_tokens the deprecated one.
        if req.max_completion_tokens is not None:
            max_tokens, mt_param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, mt_param = req.max_tokens, "max_tokens"
        params = _sampling_params(
            ctx,
            req,
            max_tokens=max_tokens,
            max_tokens_param=mt_param,
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            logprobs_param="top_logprobs",
        )
        ids = _render_chat(ctx, req.messages, req.add_generation_prompt)
        _check_length(ctx, len(ids), params.max_tokens, "messages", mt_param)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        tracked = await submit([ids], params, rid, req.priority, "messages")
        top_n = params.logprobs
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return streaming(
                stream_events(
                    tracked,
                    [ids],
                    chat=True,
                    rid=rid,
                    n=params.n,
                    include_usage=include_usage,
                    top_n=top_n,
                )
            )
        (final,) = await _until_disconnected(request, collect(tracked))
        choices = []
        for c in final.outputs:
            lp_obj = None
            if top_n is not None and c.logprobs is not None:
                lp_obj = _chat_logprobs(ctx, c.token_ids, c.logprobs, top_n)
            choices.append(
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": lp_obj,
                    "finish_reason": c.finish_reason,
                }
            )
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": usage([ids], list(final.outputs)),
        }

    return app
