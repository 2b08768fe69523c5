"""GET /v1/models (and /v1/models/{id}), POST /tokenize and /detokenize: what is
served and how it tokenizes."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from sluice.server.context import ServerContext, server_context
from sluice.server.errors import bad_request
from sluice.server.messages import render_chat
from sluice.server.protocol import DetokenizeRequest, TokenizeRequest
from sluice.server.validation import check_model, check_token_ids, parse

router = APIRouter()


def _card(ctx: ServerContext) -> dict[str, Any]:
    return {
        "id": ctx.model_name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "sluice",
        "root": ctx.model_name,
        "max_model_len": ctx.max_model_len,
    }


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_card(server_context(request))]}


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str) -> dict[str, Any]:
    """One model's card; ids may hold a slash (org/name), hence the path converter."""
    ctx = server_context(request)
    check_model(ctx, model_id)
    return _card(ctx)


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    ctx = server_context(request)
    req = await parse(request, TokenizeRequest)
    check_model(ctx, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("prompt", "give exactly one of 'prompt' or 'messages'")
    if req.messages is not None:
        ids = render_chat(ctx, req.messages, req.add_generation_prompt)
    else:
        ids = ctx.tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
    body: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = [ctx.tokenizer.id_to_token(i) for i in ids]
    return body


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    ctx = server_context(request)
    req = await parse(request, DetokenizeRequest)
    check_model(ctx, req.model)
    check_token_ids(ctx, "tokens", req.tokens)
    return {"prompt": ctx.tokenizer.decode(req.tokens, skip_special_tokens=False)}
