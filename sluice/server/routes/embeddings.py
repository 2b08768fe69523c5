"""POST /v1/embeddings (OpenAI's), and bi-encoder scoring on top of it: /v1/score
(vLLM's) and /v1/rerank, /rerank (the Jina/Cohere shape vLLM and llama.cpp accept).

Every input is one embedding request to the engine, which batches them with whatever
else it runs. Scores are cosine similarities of the two texts' vectors, each embedded
on its own (a bi-encoder, not a cross-encoder reading the pair together).
"""

from __future__ import annotations

import base64
import uuid
from typing import Any

import numpy as np
import torch
from fastapi import APIRouter, Request

from sluice.core.errors import RequestError
from sluice.engine.pooling import text_head
from sluice.outputs import RequestOutput
from sluice.sampling_params import PoolingParams
from sluice.server.context import ServerContext, server_context
from sluice.server.errors import bad_request
from sluice.server.generation import collect, submit, until_disconnected
from sluice.server.protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from sluice.server.validation import check_model, check_text_length, check_token_ids, parse

router = APIRouter()

# Inputs one request may hold (OpenAI's limit for /v1/embeddings).
MAX_INPUTS = 2048
_ENCODINGS = ("float", "base64")


def _items(value: Any, param: str) -> list[str | list[int]]:
    """A string, token ids, or a non-empty list of either, as a list of inputs."""
    if isinstance(value, str) or (
        isinstance(value, list) and value and all(isinstance(t, int) for t in value)
    ):
        items: list[Any] = [value]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise bad_request(
            param, f"{param} must be a string, token ids, or a non-empty list of them"
        )
    if len(items) > MAX_INPUTS:
        raise bad_request(param, f"{param} has {len(items)} inputs; at most {MAX_INPUTS} a request")
    for item in items:
        ok_ids = isinstance(item, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in item
        )
        if not (isinstance(item, str) or ok_ids) or not item:
            raise bad_request(param, f"each {param} must be a non-empty string or token id list")
    return items


def input_ids(ctx: ServerContext, value: Any, param: str, truncate: int | None) -> list[list[int]]:
    """Every input of `value` as token ids; a text too long for the model is refused
    here unless the request truncates (then only its head is tokenized)."""
    result = []
    for item in _items(value, param):
        if isinstance(item, str):
            if truncate is None:
                check_text_length(ctx, item, param)
            else:
                item = text_head(item, truncate, ctx.max_model_len)
            result.append(ctx.tokenizer.encode(item))
        else:
            check_token_ids(ctx, param, item)
            result.append(item)
    return result


def _params(**fields: Any) -> PoolingParams:
    try:
        return PoolingParams(**fields)
    except RequestError as exc:
        raise bad_request(exc.param, str(exc)) from None


def _base_model(ctx: ServerContext, name: str | None) -> None:
    """Embeddings run the base model: a LoRA adapter's name is refused."""
    if check_model(ctx, name) is not None:
        raise bad_request("model", f"embeddings through a LoRA adapter ({name}) are not supported")


async def _embed(
    ctx: ServerContext,
    request: Request,
    inputs: list[list[int]],
    params: PoolingParams,
    priority: int,
    param: str,
) -> list[RequestOutput]:
    rid = f"embd-{uuid.uuid4().hex}"
    tracked = await submit(ctx, inputs, params, rid, priority, param, streamed=False)
    return await until_disconnected(request, collect(tracked))


def _usage(outputs: list[RequestOutput]) -> dict[str, int]:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def _vector(out: RequestOutput, encoding: str) -> list[float] | str:
    assert out.embedding is not None, "a finished embedding request carries its vector"
    if encoding == "base64":  # little-endian float32, as OpenAI's clients decode it
        return base64.b64encode(np.asarray(out.embedding, dtype="<f4").tobytes()).decode()
    return out.embedding


@router.post("/v1/embeddings")
async def embeddings(request: Request) -> dict[str, Any]:
    ctx = server_context(request)
    req = await parse(request, EmbeddingRequest)
    _base_model(ctx, req.model)
    if req.encoding_format not in _ENCODINGS:
        raise bad_request("encoding_format", f"encoding_format must be one of {_ENCODINGS}")
    params = _params(
        dimensions=req.dimensions,
        normalize=req.normalize,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
    )
    inputs = input_ids(ctx, req.input, "input", req.truncate_prompt_tokens)
    outputs = await _embed(ctx, request, inputs, params, req.priority, "input")
    data = [
        {"object": "embedding", "index": i, "embedding": _vector(o, req.encoding_format)}
        for i, o in enumerate(outputs)
    ]
    return {"object": "list", "data": data, "model": ctx.model_name, "usage": _usage(outputs)}


async def _cosines(
    ctx: ServerContext,
    request: Request,
    queries: list[list[int]],
    documents: list[list[int]],
    truncate: int | None,
    priority: int,
) -> tuple[list[float], list[RequestOutput]]:
    """Cosine of each query (one, or one per document) with each document."""
    params = _params(normalize=True, truncate_prompt_tokens=truncate)
    outputs = await _embed(ctx, request, queries + documents, params, priority, "input")
    vectors = torch.tensor([o.embedding for o in outputs])
    q, d = vectors[: len(queries)], vectors[len(queries) :]
    return (q * d).sum(-1).tolist(), outputs


@router.post("/v1/score")
@router.post("/score")
async def score(request: Request) -> dict[str, Any]:
    ctx = server_context(request)
    req = await parse(request, ScoreRequest)
    _base_model(ctx, req.model)
    first = input_ids(ctx, req.text_1, "text_1", req.truncate_prompt_tokens)
    second = input_ids(ctx, req.text_2, "text_2", req.truncate_prompt_tokens)
    if len(first) not in (1, len(second)):
        raise bad_request("text_1", "text_1 must be one text or as many as text_2")
    scores, outputs = await _cosines(
        ctx, request, first, second, req.truncate_prompt_tokens, req.priority
    )
    data = [{"object": "score", "index": i, "score": s} for i, s in enumerate(scores)]
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "model": ctx.model_name,
        "data": data,
        "usage": _usage(outputs),
    }


@router.post("/v1/rerank")
@router.post("/rerank")
async def rerank(request: Request) -> dict[str, Any]:
    ctx = server_context(request)
    req = await parse(request, RerankRequest)
    _base_model(ctx, req.model)
    if not isinstance(req.query, str) or not req.query:
        raise bad_request("query", "query must be a non-empty string")
    documents = _items(req.documents, "documents")
    if req.top_n is not None and req.top_n < 1:
        raise bad_request("top_n", f"top_n must be a positive integer, got {req.top_n}")
    truncate = req.truncate_prompt_tokens
    query = input_ids(ctx, req.query, "query", truncate)
    docs = input_ids(ctx, documents, "documents", truncate)
    scores, outputs = await _cosines(ctx, request, query, docs, truncate, req.priority)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents and isinstance(documents[i], str):
            result["document"] = {"text": documents[i]}
        results.append(result)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": ctx.model_name,
        "results": results,
        "usage": {"total_tokens": _usage(outputs)["total_tokens"]},
    }
