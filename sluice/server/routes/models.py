"""GET /v1/models (and /v1/models/{id}), POST /tokenize and /detokenize: what is
served and how it tokenizes."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from sluice.core.lora import LoRARequest
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


def _adapter_card(ctx: ServerContext, adapter: LoRARequest) -> dict[str, Any]:
    """A LoRA adapter's card, as vLLM lists one: its files as root, the base as parent."""
    return {
        **_card(ctx),
        "id": adapter.lora_name,
        "root": adapter.lora_path,
        "parent": ctx.model_name,
    }


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    ctx = server_context(request)
    adapters = [_adapter_card(ctx, a) for a in ctx.llm.lora_adapters().values()]
    return {"object": "list", "data": [_card(ctx), *adapters]}


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str) -> dict[str, Any]:
    """One model's card; ids may hold a slash (org/name), hence the path converter."""
    ctx = server_context(request)
    adapter = check_model(ctx, model_id)
    return _card(ctx) if adapter is None else _adapter_card(ctx, adapter)


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
