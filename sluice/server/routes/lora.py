"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters added and
removed while the server runs, as vLLM names the endpoints (behind the API key, like
every non-public route). An unloaded adapter's running requests finish; new requests
naming it get a 404."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from sluice.core.errors import InvalidValueError, ModelFileError
from sluice.core.lora import LoRARequest
from sluice.server.context import server_context
from sluice.server.errors import OpenAIError, bad_request
from sluice.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from sluice.server.validation import parse

router = APIRouter()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    ctx = server_context(request)
    req = await parse(request, LoadLoRAAdapterRequest)
    if req.lora_name == ctx.model_name:
        raise bad_request("lora_name", f"{req.lora_name!r} is the base model's name")
    served = ctx.llm.lora_adapters()
    next_id = max((a.lora_int_id for a in served.values()), default=0) + 1
    try:
        await ctx.llm.load_lora_adapter(LoRARequest(req.lora_name, next_id, req.lora_path))
    except ModelFileError as exc:  # the adapter's files: a defect names the adapter
        raise bad_request("lora_path", str(exc)) from None
    except InvalidValueError as exc:
        raise bad_request(exc.param, str(exc)) from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    ctx = server_context(request)
    req = await parse(request, UnloadLoRAAdapterRequest)
    try:
        removed = await ctx.llm.unload_lora_adapter(req.lora_name)
    except InvalidValueError as exc:
        raise bad_request(exc.param, str(exc)) from None
    if not removed:
        raise OpenAIError(
            404,
            f"The LoRA adapter `{req.lora_name}` is not loaded.",
            param="lora_name",
            code="model_not_found",
        )
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
