"""Request validation shared by the endpoints: body, model name, sampling fields, prompts.

Everything is checked here, before a request is queued, so bad input is a 4xx naming
its field and never an exception in the engine loop.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar, cast

from fastapi import Request
from pydantic import BaseModel, ValidationError

from sluice.core.lora import LoRARequest
from sluice.sampling_params import SamplingParams, SamplingParamsError
from sluice.server.context import ServerContext
from sluice.server.errors import OpenAIError, bad_request, validation_error
from sluice.server.protocol import ChatCompletionRequest, CompletionRequest

# OpenAI's own limit; larger n is a cheap way to exhaust the KV cache with one request.
MAX_N = 128

M = TypeVar("M", bound=BaseModel)


def max_body_bytes(max_model_len: int) -> int:
    """The largest request body a server takes: room for a full context of long tokens,
    tools and schemas, and never less than 16 MiB."""
    return max(16 << 20, max_model_len * 64)


def _too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(
        413,
        f"the request body is {size:,} bytes, over this server's limit of {limit:,}",
        code="request_too_large",
    )


async def _body(request: Request) -> bytes:
    """The body, refused with a 413 as soon as it is known to be over the limit (by its
    Content-Length, else while it arrives), so an oversized one is never held whole."""
    ctx = getattr(request.app.state, "ctx", None)  # the P/D proxy has no engine
    limit = ctx.max_body_bytes if ctx is not None else max_body_bytes(0)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request) -> dict[str, Any]:
    raw = await _body(request)
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


async def parse(request: Request, model: type[M]) -> M:
    data = await read_json(request)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def check_model(ctx: ServerContext, name: str | None) -> LoRARequest | None:
    """The LoRA adapter a request's `model` names, None for the base model (or no
    model given); any other name is a 404."""
    if name is None or name == ctx.model_name:
        return None
    adapters = ctx.llm.lora_adapters()
    if name in adapters:
        return adapters[name]
    served = ", ".join(f"`{n}`" for n in [ctx.model_name, *adapters])
    raise OpenAIError(
        404,
        f"The model `{name}` does not exist. This server serves {served}.",
        param="model",
        code="model_not_found",
    )


def check_token_ids(ctx: ServerContext, param: str, ids: list[int]) -> None:
    for t in ids:
        if not 0 <= t < ctx.vocab_size:
            raise bad_request(param, f"token id {t} is out of range [0, {ctx.vocab_size})")


def check_stream_options(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options", "stream_options is only allowed with stream=true")


def sampling_params(
    ctx: ServerContext,
    req: CompletionRequest | ChatCompletionRequest,
    *,
    max_tokens: int | None,
    max_tokens_param: str,
    logprobs: int | None,
    logprobs_param: str,
) -> SamplingParams:
    """The request's sampling fields as SamplingParams; errors name the endpoint's field."""
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
            # JSON keys are strings: SamplingParams converts them to int token ids (and
            # rejects any that are not), so its field holds dict[int, float] afterwards.
            logit_bias=cast("dict[int, float] | None", req.logit_bias),
            kv_transfer_params=req.kv_transfer_params,
        )
    except SamplingParamsError as exc:
        param = rename.get(exc.param, exc.param)
        raise bad_request(param, str(exc).replace(exc.param, param, 1)) from None
    if params.logit_bias:
        check_token_ids(ctx, "logit_bias", list(params.logit_bias))
    if params.stop_token_ids:
        check_token_ids(ctx, "stop_token_ids", params.stop_token_ids)
    return params


def check_length(
    ctx: ServerContext,
    n_prompt: int,
    max_tokens: int | None,
    prompt_param: str,
    max_tokens_param: str,
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


def check_text_length(ctx: ServerContext, text: str, param: str) -> None:
    """Refuse a text that is sure to exceed the context, without tokenizing all of it:
    past 16 characters a token of context (four times the usual length of a token, so
    the usual too-long prompt is counted exactly), growing prefixes are counted, 4 times
    longer each, until the text ends or a prefix alone is over the limit (a cut may split
    one token in two, hence the one spare). A 20 MB prompt once cost 15 s of
    tokenizing before its 400."""
    limit = ctx.max_model_len
    k = 16 * limit
    while k < len(text):
        if len(ctx.tokenizer.encode(text[:k], add_special_tokens=False)) > limit + 1:
            raise bad_request(
                param,
                f"This model's maximum context length is {limit} tokens, but the {param} "
                f"has more than that (counted in its first {k:,} characters of "
                f"{len(text):,}). Please shorten the {param}.",
                code="context_length_exceeded",
            )
        k *= 4


def completion_prompts(ctx: ServerContext, prompt: Any) -> list[list[int]]:
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
            check_text_length(ctx, item, "prompt")
            ids = ctx.tokenizer.encode(item)
        else:
            ids = list(item)
            check_token_ids(ctx, "prompt", ids)
        if not ids:
            raise bad_request("prompt", "prompt must not be empty")
        result.append(ids)
    return result
