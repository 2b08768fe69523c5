"""A request's state as the scheduler, the KV cache manager and the runner see it.

It lives in the core layer because every layer below the engine reads it too (the
runner batches requests, the sampler reads their sampling params and seeds).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sluice.core.choices import FinishReason
from sluice.core.lora import LoRAAdapter
from sluice.core.outputs import Logprob
from sluice.core.pooling_params import PoolingParams
from sluice.core.sampling_params import SamplingParams

# What a request asks for: text (sampling options) or, from an embedding model, its
# prompt's vector (pooling options). Every layer that passes requests on takes either.
RequestParams = SamplingParams | PoolingParams


class RequestStatus(enum.Enum):
    # A finished status's value is its finish reason.
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


class OutputState(Protocol):
    """What the engine keeps per sequence for its text and stop rules
    (`sluice.engine.output.SequenceOutputState`); a protocol here so that the core
    layer does not import the engine."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    stop_reason: str | int | None

    def append(self, token_id: int, max_tokens: int) -> bool: ...

    def take_delta(self) -> str: ...

    def finish_complete(self) -> bool: ...


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Speculative decoding: draft tokens this sequence verified, and those accepted.
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    `all_token_ids` is prompt + output; the KV cache holds the first
    `num_computed_tokens` of them. Each step the scheduler grants it some number of
    new tokens to compute; when the cache catches up with all known tokens, the
    model's last logits give the next token.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # For n > 1: the id of the user's request this sequence belongs to, and its index.
    group_id: str = ""
    index: int = 0
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    seed: int | None = None
    # An embedding request: computes its prompt once and pools it, samples nothing.
    pooling: PoolingParams | None = None
    # The LoRA adapter it runs with (the runner gives it a slot), None for the base
    # model. Held here, so unloading the adapter lets running requests finish with it.
    lora: LoRAAdapter | None = None

    all_token_ids: list[int] = field(init=False)
    status: RequestStatus = field(init=False, default=RequestStatus.WAITING)
    num_computed_tokens: int = field(init=False, default=0)
    block_ids: list[int] = field(init=False, default_factory=list)
    # A split KV cache's second table: the windowed layers' blocks (NO_BLOCK behind the
    # window), as long as block_ids; empty with one pool (engine/kv_cache.py).
    local_block_ids: list[int] = field(init=False, default_factory=list)
    # Hash chain of this request's full blocks (filled lazily by the prefix cache).
    block_hashes: list[int] = field(init=False, default_factory=list)
    num_named_blocks: int = field(init=False, default=0)  # full blocks entered in the cache
    num_cached_tokens: int = field(init=False, default=-1)
    num_preemptions: int = field(init=False, default=0)
    # Other sequences of an n > 1 request that fork from this one once its prompt is in.
    pending_forks: list[Request] = field(init=False, default_factory=list)
    output: OutputState | None = field(init=False, default=None)
    # The grammar matcher of a constrained request (an llguidance LLMatcher, owned by
    # sluice.structured); None when unconstrained.
    grammar: Any = field(init=False, default=None)
    # Speculative decoding: tokens proposed to follow all_token_ids, verified this step
    # (the scheduler grants 1 + len(spec_token_ids) tokens and trims what it cannot
    # grant); never part of all_token_ids until accepted.
    spec_token_ids: list[int] = field(init=False, default_factory=list)
    # Per output token: the sampled token's and the top-N tokens' logprobs (when asked).
    logprobs: list[dict[int, Logprob]] | None = field(init=False, default=None)
    cumulative_logprob: float = field(init=False, default=0.0)
    # Per prompt position (None for the first, which nothing predicts).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = field(init=False, default=None)
    metrics: RequestMetrics = field(init=False)
    # An embedding request's vector, once its prompt is computed.
    embedding: list[float] | None = field(init=False, default=None)
    # An embedding request on a decoder, computed in chunks: what its chunks so far
    # pooled (the runner's running sum for mean pooling, a tensor), reset at its start.
    pool_state: Any = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.group_id = self.group_id or self.request_id
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)


class SamplingRow(Protocol):
    """What the sampler reads of one row of logits: a request, or a request as it would
    stand after some of its draft tokens (`DraftRow`)."""

    @property
    def sampling_params(self) -> SamplingParams: ...

    @property
    def seed(self) -> int | None: ...

    @property
    def grammar(self) -> Any: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def num_output_tokens(self) -> int: ...


@dataclass(frozen=True, eq=False)
class DraftRow:
    """A verifying request's row after its first len(drafts) draft tokens: sampled as if
    those tokens had been decoded one by one (penalties see them, min_tokens counts
    them, a seed draws for this output position). A constrained request's draft rows
    share its matcher: the step's masks advance it by the drafts and roll it back
    (sluice/structured/constraints.py)."""

    request: Request
    drafts: Sequence[int]

    @property
    def sampling_params(self) -> SamplingParams:
        return self.request.sampling_params

    @property
    def seed(self) -> int | None:
        return self.request.seed

    @property
    def grammar(self) -> Any:
        return self.request.grammar

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + list(self.drafts)

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.drafts)
