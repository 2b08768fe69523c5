"""Public home of the result types of `LLM.generate` and the engine; they live in the
core layer (`sluice.core.outputs`)."""

from sluice.core.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestMetricsOut,
    RequestOutput,
)

__all__ = [
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "Logprob",
    "RequestMetricsOut",
    "RequestOutput",
]
