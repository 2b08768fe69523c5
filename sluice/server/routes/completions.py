"""POST /v1/completions: text completion of a prompt (or a batch of prompts)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request, Response

from sluice.outputs import CompletionOutput, RequestOutput
from sluice.sampling_params import SamplingParams
from sluice.server.context import ServerContext, server_context
from sluice.server.errors import unsupported
from sluice.server.generation import collect, submit, until_disconnected, usage
from sluice.server.logprobs import completion_logprobs
from sluice.server.protocol import CompletionRequest
from sluice.server.streaming import streamed_response
from sluice.server.structured import constrained
from sluice.server.validation import (
    check_length,
    check_model,
    check_stream_options,
    completion_prompts,
    parse,
    sampling_params,
)

router = APIRouter()


def _check_unsupported(req: CompletionRequest) -> None:
    if req.echo:
        raise unsupported("echo", "echo")
    if req.suffix:
        raise unsupported("suffix", "suffix (insertion)")
    if req.best_of is not None and req.best_of != req.n:
        raise unsupported("best_of", "best_of other than n")


def _validate(ctx: ServerContext, req: CompletionRequest) -> tuple[SamplingParams, list[list[int]]]:
    check_model(ctx, req.model)
    _check_unsupported(req)
    check_stream_options(req)
    params = sampling_params(
        ctx,
        req,
        max_tokens=req.max_tokens,
        max_tokens_param="max_tokens",
        logprobs=req.logprobs,
        logprobs_param="logprobs",
    )
    prompts = completion_prompts(ctx, req.prompt)
    # The default max_tokens (16) is capped by the engine, not an error.
    explicit = params.max_tokens if "max_tokens" in req.model_fields_set else None
    for ids in prompts:
        check_length(ctx, len(ids), explicit, "prompt", "max_tokens")
    return params, prompts


def _response(
    ctx: ServerContext,
    rid: str,
    prompts: list[list[int]],
    finals: list[RequestOutput],
    params: SamplingParams,
) -> dict[str, Any]:
    choices = []
    outs: list[CompletionOutput] = []
    top_n = params.logprobs
    for pi, out in enumerate(finals):
        for c in out.outputs:
            lp_obj = None
            if top_n is not None and c.logprobs is not None:
                lp_obj, _ = completion_logprobs(ctx.tokenizer, c.token_ids, c.logprobs, top_n, 0)
            index = pi * params.n + c.index
            choices.append(
                {
                    "index": index,
                    "text": c.text,
                    "logprobs": lp_obj,
                    "finish_reason": c.finish_reason,
                }
            )
            outs.append(c)
    body = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": ctx.model_name,
        "choices": choices,
        "usage": usage(prompts, outs, sum(f.num_cached_tokens for f in finals)),
    }
    if finals and finals[0].kv_transfer_params is not None:  # a prefill instance's
        body["kv_transfer_params"] = finals[0].kv_transfer_params
    return body


@router.post("/v1/completions", response_model=None)
async def completions(request: Request) -> Response | dict[str, Any]:
    ctx = server_context(request)
    req = await parse(request, CompletionRequest)
    params, prompts = _validate(ctx, req)
    params = await constrained(ctx, req, params)
    rid = f"cmpl-{uuid.uuid4().hex}"
    tracked = await submit(
        ctx,
        prompts,
        params,
        rid,
        req.priority,
        "prompt",
        streamed=bool(req.stream),
        lora=check_model(ctx, req.model),
    )
    if req.stream:
        return streamed_response(ctx, req, rid, params, tracked, prompts)
    finals = await until_disconnected(request, collect(tracked))
    return _response(ctx, rid, prompts, finals, params)
