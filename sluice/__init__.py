"""sluice: a small, fast LLM inference and serving engine on PyTorch."""

from sluice.core.lora import LoRARequest
from sluice.llm import LLM
from sluice.outputs import CompletionOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from sluice.sampling_params import PoolingParams, SamplingParams, SamplingParamsError

__all__ = [
    "LLM",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "LoRARequest",
    "Logprob",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "SamplingParamsError",
]
__version__ = "0.1.0"
