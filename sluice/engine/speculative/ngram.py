"""N-gram (prompt lookup) drafts: text that repeated before tends to repeat again.

The last n tokens of a sequence (n from `max_n` down to `min_n`) are looked up among
its earlier tokens, the prompt and the output so far; the tokens that followed the
most recent earlier occurrence are the draft. This wins where the output copies its
input (edits of a given file, quoting, extraction) or repeats itself, and costs no
model. Each sequence keeps an index from every n-gram to the position after its most
recent occurrence, extended by the tokens added since the last call, so a lookup
costs O(max_n) however long the sequence is.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from sluice.core.request import Request

DEFAULT_MIN_N = 2
DEFAULT_MAX_N = 4


class NgramIndex:
    """n-gram -> the position right after its most recent occurrence, for one sequence."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.num_indexed = 0

    def update(self, tokens: Sequence[int]) -> None:
        """Index the n-grams that gained a following token since the last update."""
        for j in range(max(self.num_indexed, self.min_n), len(tokens)):
            for n, positions in self.maps.items():
                if j >= n:
                    positions[tuple(tokens[j - n : j])] = j
        self.num_indexed = len(tokens)

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        """The k tokens after the most recent earlier occurrence of the longest matching
        suffix. A match closer to the end than k tokens continues periodically: the
        draft is read from tokens + the draft so far."""
        end = len(tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            j = self.maps[n].get(tuple(tokens[end - n :]))
            if j is not None:
                out: list[int] = []
                for i in range(j, j + k):
                    out.append(tokens[i] if i < end else out[i - end])
                return out
        return []


class NgramProposer:
    """Prompt-lookup drafts for each request, from an index kept per sequence (dropped
    with the request)."""

    def __init__(self, min_n: int = DEFAULT_MIN_N, max_n: int = DEFAULT_MAX_N) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._index: weakref.WeakKeyDictionary[Request, NgramIndex] = weakref.WeakKeyDictionary()

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        out = []
        for req, k in zip(requests, num_tokens, strict=True):
            index = self._index.get(req)
            if index is None:
                index = self._index[req] = NgramIndex(self.min_n, self.max_n)
            tokens = req.all_token_ids
            index.update(tokens)
            out.append(index.draft(tokens, k) if k > 0 else [])
        return out

    def reset(self) -> None:
        self._index.clear()

    def finish(self, req: Request) -> None:
        self._index.pop(req, None)

    def verified(self, req: Request) -> None:
        """Nothing to do: the index catches up with new tokens at the next lookup."""

    def release(self, req: Request) -> None:
        """Nothing to do: the request's tokens, and so its index, stay."""
