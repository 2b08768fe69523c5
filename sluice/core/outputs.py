"""What generation returns: the public result types of LLM.generate and the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice.core.choices import FinishReason


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that matched
    # What is new since the previous output of this request (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetricsOut:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    # Speculative decoding, over the request's sequences: draft tokens verified, and
    # those accepted (0 without speculation).
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetricsOut | None = None
    # What a KV connector tells the client about the finished request: a prefill
    # instance's transfer address and id, for the decode instance (kv_transfer.py).
    kv_transfer_params: dict[str, Any] | None = None
    # An embedding request's vector (its `outputs` is empty): set when it finishes.
    embedding: list[float] | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns per input, as vLLM spells it (`out.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
