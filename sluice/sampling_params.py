"""Public home of `SamplingParams` (`from sluice.sampling_params import SamplingParams`);
the class lives in the core layer (`sluice.core.sampling_params`)."""

from sluice.core.errors import SamplingParamsError
from sluice.core.sampling_params import SamplingParams

__all__ = ["SamplingParams", "SamplingParamsError"]
