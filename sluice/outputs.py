"""Public home of the result types of `LLM.generate` and the engine; they live in the
core layer (`sluice.core.outputs`)."""

from sluice.core.outputs import CompletionOutput, Logprob, RequestMetricsOut, RequestOutput

__all__ = ["CompletionOutput", "Logprob", "RequestMetricsOut", "RequestOutput"]
