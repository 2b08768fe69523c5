"""OpenAI request bodies (pydantic).

Models are strict (a string is not a number, 5.0 is not an int) and ignore unknown
fields, as OpenAI does. Responses are plain dicts built in the app: streaming builds
many small chunks and pydantic would only add cost there.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

# The error type lives in errors.py; importing it from here keeps working.
from sluice.server.errors import OpenAIError, bad_request, error_body, validation_error

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "EmbeddingRequest",
    "LoadLoRAAdapterRequest",
    "OpenAIError",
    "RerankRequest",
    "ScoreRequest",
    "StreamOptions",
    "TokenizeRequest",
    "UnloadLoRAAdapterRequest",
    "bad_request",
    "error_body",
    "validation_error",
]


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
    # Constraints on the output (sluice/server/structured.py reads and checks them).
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # Prefill/decode disaggregation, as vLLM spells it (checked by SamplingParams).
    kv_transfer_params: dict[str, Any] | None = None


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
    # Checked field by field in tools.py, so errors can name tools[0].function.name.
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # Extra variables for the chat template (vLLM's name), e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None
    # Accepted only at their "off" values; anything else is a 400 that says so.
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None


class EmbeddingRequest(_Strict):
    """OpenAI's /v1/embeddings body, with vLLM's extensions."""

    model: str | None = None
    # A string, token ids, or a list of either; checked in routes/embeddings.py so the
    # errors name the input.
    input: Any = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's: cut inputs past this many tokens instead of refusing them; normalize.
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    priority: int = 0


class ScoreRequest(_Strict):
    """vLLM's /v1/score: text_1 (one or as many as text_2) against each text_2."""

    model: str | None = None
    text_1: Any = None
    text_2: Any = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class RerankRequest(_Strict):
    """The Jina/Cohere rerank body (/v1/rerank, /rerank) that vLLM and llama.cpp accept."""

    model: str | None = None
    query: Any = None
    documents: Any = None
    top_n: int | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    priority: int = 0


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


class LoadLoRAAdapterRequest(_Strict):
    """POST /v1/load_lora_adapter, as vLLM takes it."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Strict):
    """POST /v1/unload_lora_adapter (vLLM's lora_int_id is accepted and not needed)."""

    lora_name: str
    lora_int_id: int | None = None
