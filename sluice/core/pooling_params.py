"""Per-request options of an embedding request, validated once at the API boundary
(the counterpart of SamplingParams for requests that pool instead of generating)."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.core.errors import RequestError


def _positive(name: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(name, f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class PoolingParams:
    """How one input becomes its vector."""

    dimensions: int | None = None
    """Cut the vector to its first `dimensions` values (a Matryoshka model's sizes
    only), renormalized where the model normalizes; None: the model's full size."""
    normalize: bool | None = None
    """Scale the vector to unit length; None: as the model's configuration says."""
    truncate_prompt_tokens: int | None = None
    """Keep at most this many tokens of the input (the first ones, its end token
    kept), and the model's limit at most; None: an input past the limit is refused."""

    def __post_init__(self) -> None:
        _positive("dimensions", self.dimensions)
        _positive("truncate_prompt_tokens", self.truncate_prompt_tokens)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise RequestError("normalize", f"normalize must be a boolean, got {self.normalize!r}")
