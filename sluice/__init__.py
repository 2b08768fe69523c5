"""sluice: a small, fast LLM inference and serving engine on PyTorch."""

from sluice.llm import LLM
from sluice.outputs import CompletionOutput, Logprob, RequestOutput
from sluice.sampling_params import SamplingParams, SamplingParamsError

__all__ = [
    "LLM",
    "CompletionOutput",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "SamplingParamsError",
]
__version__ = "0.1.0"
