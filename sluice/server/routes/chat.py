"""POST /v1/chat/completions: a reply to a conversation, through the chat template.

With tools, ``tools.tool_plan`` decides what the template renders and what the grammar
enforces, and ``tool_calls`` turns each choice's text into content and tool_calls;
``structured.constrained`` adds a response_format / structured_outputs constraint.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request, Response

from sluice.outputs import CompletionOutput, RequestOutput
from sluice.sampling_params import SamplingParams
from sluice.server.context import ServerContext, server_context
from sluice.server.errors import bad_request
from sluice.server.generation import collect, submit, until_disconnected, usage
from sluice.server.logprobs import chat_logprobs
from sluice.server.messages import check_chat_unsupported, render_chat
from sluice.server.protocol import ChatCompletionRequest
from sluice.server.reasoning import ReasoningSplitter
from sluice.server.streaming import streamed_response
from sluice.server.structured import constrained, with_thinking
from sluice.server.tool_calls import message_fields
from sluice.server.tools import ToolPlan, tool_plan, with_tool_constraint
from sluice.server.validation import (
    check_length,
    check_model,
    check_stream_options,
    parse,
    sampling_params,
)

router = APIRouter()


def validate_chat(
    ctx: ServerContext, req: ChatCompletionRequest
) -> tuple[SamplingParams, list[int], ToolPlan]:
    """A chat request's sampling parameters, prompt ids and tool plan, every field
    checked (the Messages and Responses APIs arrive as chat requests too; their routes
    rename the fields in errors, `errors.renamed_params`)."""
    check_model(ctx, req.model)
    check_chat_unsupported(req)
    plan = tool_plan(ctx, req)
    check_stream_options(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs", "top_logprobs requires logprobs to be true")
    # max_completion_tokens is the current name; max_tokens the deprecated one.
    max_tokens: int | None
    if req.max_completion_tokens is not None:
        max_tokens, mt_param = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, mt_param = req.max_tokens, "max_tokens"
    params = sampling_params(
        ctx,
        req,
        max_tokens=max_tokens,
        max_tokens_param=mt_param,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        logprobs_param="top_logprobs",
    )
    ids = render_chat(
        ctx, req.messages, req.add_generation_prompt, plan.tools, req.chat_template_kwargs
    )
    check_length(ctx, len(ids), params.max_tokens, "messages", mt_param)
    return params, ids, plan


async def prepare_chat(
    ctx: ServerContext, req: ChatCompletionRequest
) -> tuple[SamplingParams, list[int], ToolPlan]:
    """`validate_chat`, then the request's constraints compiled: its response_format or
    structured output, a required or named tool call, and with a reasoning parser the
    room to think before them. Every API that arrives as a chat request goes here."""
    params, ids, plan = validate_chat(ctx, req)
    if ctx.reasoning is not None and ctx.reasoning.harmony:  # its markers are special tokens
        params = params.clone(skip_special_tokens=False)
    params = await with_tool_constraint(ctx, await constrained(ctx, req, params), plan)
    return await with_thinking(ctx, params, ids, calls=plan.constraint is not None), ids, plan


def reasoning_for(ctx: ServerContext, ids: list[int]) -> Callable[[], ReasoningSplitter] | None:
    """A new reasoning parser for each output of the prompt `ids` (None: not split).
    The prompt's end says whether the template already opened the thinking."""
    if ctx.reasoning is None:
        return None
    tail = ctx.tokenizer.decode(ids[-16:], skip_special_tokens=False)
    return functools.partial(ctx.reasoning.parser, tail)


def _message(
    c: CompletionOutput, plan: ToolPlan, reasoning: Callable[[], ReasoningSplitter] | None
) -> tuple[dict[str, Any], str | None]:
    """One choice's message and finish_reason: the thinking split off first, then the
    answer parsed for tool calls (each choice on its own)."""
    text, thought = c.text, None
    if reasoning is not None:
        thought, text = reasoning().feed(c.text, final=True)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    reason: str | None = c.finish_reason
    if plan.new_parser is not None:
        message, reason = message_fields(plan.new_parser(), text, reason)
    if reasoning is not None:  # both names: vLLM's older and newer
        message["reasoning_content"] = message["reasoning"] = thought or None
    return message, reason


def _response(
    ctx: ServerContext,
    rid: str,
    ids: list[int],
    final: RequestOutput,
    params: SamplingParams,
    plan: ToolPlan,
) -> dict[str, Any]:
    choices = []
    reasoning = reasoning_for(ctx, ids)
    for c in final.outputs:
        lp_obj = None
        if params.logprobs is not None and c.logprobs is not None:
            lp_obj = chat_logprobs(ctx.tokenizer, c.token_ids, c.logprobs, params.logprobs)
        message, reason = _message(c, plan, reasoning)
        choices.append(
            {"index": c.index, "message": message, "logprobs": lp_obj, "finish_reason": reason}
        )
    body = {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": ctx.model_name,
        "choices": choices,
        "usage": usage([ids], list(final.outputs), final.num_cached_tokens),
    }
    if final.kv_transfer_params is not None:  # a prefill instance's
        body["kv_transfer_params"] = final.kv_transfer_params
    return body


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request) -> Response | dict[str, Any]:
    ctx = server_context(request)
    req = await parse(request, ChatCompletionRequest)
    params, ids, plan = await prepare_chat(ctx, req)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    tracked = await submit(
        ctx,
        [ids],
        params,
        rid,
        req.priority,
        "messages",
        streamed=bool(req.stream),
        lora=check_model(ctx, req.model),
    )
    if req.stream:
        return streamed_response(
            ctx, req, rid, params, tracked, [ids], plan.new_parser, reasoning_for(ctx, ids)
        )
    (final,) = await until_disconnected(request, collect(tracked))
    return _response(ctx, rid, ids, final, params, plan)
