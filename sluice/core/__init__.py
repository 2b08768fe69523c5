"""The bottom layer: types every other layer may use, importing nothing else of sluice.

- `choices`: every closed list of choices (dtypes, quantization methods,
  architectures, scheduling policies, devices, finish reasons, CPU ISA levels) as a
  `Literal` and a tuple of its values.
- `errors`: the errors sluice raises on purpose.
- `sampling_params`: `SamplingParams`, validated once at the API boundary.
- `outputs`: what generation returns (`RequestOutput`, `CompletionOutput`, `Logprob`).
- `request`: `Request`, one sequence as the scheduler, KV cache and runner see it.

See docs/architecture.md ("Layers and the direction of imports") for which package may import which.
"""

from sluice.core.errors import (
    ConfigError,
    InvalidValueError,
    ModelNotFoundError,
    RequestError,
    SamplingParamsError,
    SettingsError,
    SluiceError,
)
from sluice.core.outputs import CompletionOutput, Logprob, RequestMetricsOut, RequestOutput
from sluice.core.request import Request, RequestMetrics, RequestStatus
from sluice.core.sampling_params import SamplingParams

__all__ = [
    "CompletionOutput",
    "ConfigError",
    "InvalidValueError",
    "Logprob",
    "ModelNotFoundError",
    "Request",
    "RequestError",
    "RequestMetrics",
    "RequestMetricsOut",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "SamplingParamsError",
    "SettingsError",
    "SluiceError",
]
