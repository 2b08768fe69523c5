"""An embedding request's input and output: its tokens within the model's limit, and its
pooled vector cut to the asked dimensions and normalized."""

from __future__ import annotations

import torch

from sluice.config import PoolerConfig
from sluice.core.errors import RequestError
from sluice.core.pooling_params import PoolingParams

# A text to be truncated is cut to this many characters a token of the model's limit
# before it is tokenized: a token is rarely longer, and a 20 MB input is never
# tokenized whole.
CHARS_PER_TOKEN = 64


def text_head(text: str, truncate: int | None, limit: int) -> str:
    """What of a text needs tokenizing: its head where the request truncates it to
    `truncate` tokens (and the model's `limit`), else all of it."""
    if truncate is None:
        return text
    return text[: CHARS_PER_TOKEN * min(truncate, limit)]


def embedding_input(
    ids: list[int], params: PoolingParams, pooler: PoolerConfig, end_token: int | None
) -> list[int]:
    """The input's token ids once checked against the model's limit: cut to
    truncate_prompt_tokens (and the limit) where the request asks, keeping the end
    token the tokenizer appends (BERT's [SEP]; end_token, None if it appends none), as
    sentence-transformers truncates; else a RequestError naming the input. Also checks
    `dimensions`."""
    if not ids:
        raise RequestError("input", "an input must not be empty")
    dims = params.dimensions
    if dims is not None and dims not in pooler.dimensions:
        raise RequestError(
            "dimensions",
            f"dimensions={dims} is not supported by this model; it supports "
            f"{', '.join(map(str, pooler.dimensions))}",
        )
    limit = pooler.max_tokens
    keep = params.truncate_prompt_tokens
    if keep is None:
        if len(ids) > limit:
            raise RequestError(
                "input",
                f"an input has {len(ids)} tokens; this model takes at most {limit} "
                "(set truncate_prompt_tokens to cut it)",
            )
        return ids
    keep = min(keep, limit)
    if len(ids) <= keep:
        return ids
    if end_token is not None and ids[-1] == end_token and keep > 1:
        return ids[: keep - 1] + ids[-1:]
    return ids[:keep]


def finish_vector(vector: torch.Tensor, params: PoolingParams, pooler: PoolerConfig) -> list[float]:
    """A pooled vector as the request gets it: its first `dimensions` values, scaled to
    unit length where the model (or the request) normalizes."""
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    normalize = pooler.normalize if params.normalize is None else params.normalize
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.tolist()
