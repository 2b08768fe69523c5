"""Public home of `SamplingParams` and `PoolingParams` (`from sluice.sampling_params
import SamplingParams`); the classes live in the core layer."""

from sluice.core.errors import SamplingParamsError
from sluice.core.pooling_params import PoolingParams
from sluice.core.sampling_params import SamplingParams

__all__ = ["PoolingParams", "SamplingParams", "SamplingParamsError"]
