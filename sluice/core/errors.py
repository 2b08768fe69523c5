"""The errors sluice raises on purpose, importable from every layer.

Every one derives from `SluiceError`, so a caller can catch all of them at once, and
also from the builtin a caller would catch without knowing sluice (`ValueError` for
bad input, `RuntimeError` for a state the engine is in), so existing `except
ValueError` clauses keep working.
"""

from __future__ import annotations


class SluiceError(Exception):
    """Base of every error sluice raises on purpose."""


class InvalidValueError(SluiceError, ValueError):
    """A value that is not allowed; `param` names the field, option or variable."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type[InvalidValueError], tuple[str, str]]:
        # Picklable with its param: a replica process sends its request errors back.
        return type(self), (self.param, str(self))


class SamplingParamsError(InvalidValueError):
    """An invalid sampling option; ``param`` names the offending field."""


class RequestError(InvalidValueError):
    """A request the engine cannot take; `param` names the offending field."""


class ConfigError(InvalidValueError):
    """An invalid engine option; `param` names the option (an EngineConfig field)."""


class SettingsError(InvalidValueError):
    """A `SLUICE_*` environment variable with a value it cannot take; `param` names it."""


class ModelNotFoundError(SluiceError, ValueError):
    """The model is not installed or the name/path does not point at a model."""


class ModelTooLargeError(SluiceError, ValueError):
    """The model cannot fit this machine's memory (told before anything is downloaded)."""


class ModelFileError(SluiceError, ValueError):
    """A model file (GGUF, safetensors, tokenizer, adapter) that is malformed: the message
    names the file and its defect."""

    def __init__(self, path: str, defect: str) -> None:
        super().__init__(f"{path}: {defect}")
        self.path = path
        self.defect = defect

    def __reduce__(self) -> tuple[type[ModelFileError], tuple[str, str]]:
        return type(self), (self.path, self.defect)


class QueueFullError(SluiceError, RuntimeError):
    """Too many requests are waiting; the caller should retry later (HTTP 503)."""

    def __init__(self, num_waiting: int, limit: int) -> None:
        super().__init__(
            f"the server is overloaded: {num_waiting} requests are waiting "
            f"(limit {limit}); retry later"
        )
        self.num_waiting = num_waiting
        self.limit = limit

    def __reduce__(self) -> tuple[type[QueueFullError], tuple[int, int]]:
        return type(self), (self.num_waiting, self.limit)


class EngineShutdownError(SluiceError, RuntimeError):
    """The engine is shutting down (or its loop died) and takes no new requests."""


class EngineStepError(SluiceError, RuntimeError):
    """An engine step failed; the requests that were in flight are failed with this."""


class TensorParallelError(SluiceError, RuntimeError):
    """A tensor-parallel rank died, failed, or did not reach a collective in time: the
    group cannot compute another step."""


__all__ = [
    "ConfigError",
    "EngineShutdownError",
    "EngineStepError",
    "InvalidValueError",
    "ModelFileError",
    "ModelNotFoundError",
    "ModelTooLargeError",
    "QueueFullError",
    "RequestError",
    "SamplingParamsError",
    "SettingsError",
    "SluiceError",
    "TensorParallelError",
]
