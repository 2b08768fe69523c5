"""Suffix drafts: continue the longest earlier match, in this request or in earlier ones.

In the spirit of suffix decoding (Arctic Inference, vLLM's "suffix" method): like the
n-gram proposer it matches the end of a request's tokens against its own prompt and
output, but with matches up to `max_match` (24) tokens, and also against a bounded
store of earlier requests' prompts and outputs (`SuffixStore`), so a workload that
repeats itself (agents re-sending a file, a tool's output, a fixed answer format)
drafts whole spans it saw before. A request adds its tokens to the store when it
finishes (`finish`, called by the speculator from the engine).

The index (`AnchorIndex`) is a hash of the last n tokens, for a few fixed n, to the
positions that followed, at most `cap` per anchor, newest first; a suffix tree or
automaton was the other choice, and why anchors won is in anchor_index.py. A lookup
tries each source's (own text, store) longest anchor first; each candidate's match is
measured token by token (at most `max_match`), so a lookup costs O(cap x match length)
and never depends on the size of the store. Memory: the request's own index lives as
long as the request; the store holds at most `store_tokens` tokens (LRU by request),
about 130 bytes a token and anchor length.

The draft is the most likely path among the longest matches: keep the candidates whose
match is longest, take the token most of them continue with (ties: own text first,
then the newest), keep only those that agree, and go on. Its length follows the
evidence: at most one draft token per matched token (and k), and it stops once the
agreeing share, multiplied along the path, falls below `min_confidence`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sluice.core.request import Request
from sluice.engine.speculative.anchor_index import AnchorIndex, unpack
from sluice.engine.speculative.suffix_store import SuffixStore

MAX_MATCH = 24
OWN_ANCHORS = (2, 4, 8, 16)
STORE_ANCHORS = (4, 16)  # the store skips 2-3 token matches: too common to say much
CAP = 16
DEFAULT_STORE_TOKENS = 1 << 18  # ~256k tokens: ~70 MB with two anchor lengths
MIN_CONFIDENCE = 0.3
OWN = 0  # the segment id of the request's own tokens (the store's start at 1)


@dataclass(frozen=True)
class Match:
    """An earlier occurrence of the context's end: its tokens continue at `pos`."""

    tokens: Sequence[int]
    pos: int
    segment: int  # OWN, or the store's segment id


@dataclass
class _Own:
    """A running request's index and how many of its tokens it covers."""

    index: AnchorIndex
    num_indexed: int = 0


def match_length(context: Sequence[int], tokens: Sequence[int], pos: int, limit: int) -> int:
    """How many tokens before `pos` in `tokens` equal the end of `context` (<= limit)."""
    end = len(context)
    n = 0
    top = min(limit, pos, end)
    while n < top and tokens[pos - n - 1] == context[end - n - 1]:
        n += 1
    return n


def _longest(
    context: Sequence[int], lengths: Sequence[int], find: Callable[[int], list[Match]], limit: int
) -> tuple[int, list[Match]]:
    """In one source: the longest match (<= limit) and the candidates that reach it,
    trying its anchor lengths longest first; (0, []) when none matches."""
    for n in lengths:
        scored = [(match_length(context, m.tokens, m.pos, limit), m) for m in find(n)]
        best = max((length for length, _ in scored), default=0)
        if best >= n:  # below n: only hash collisions
            return best, [m for length, m in scored if length == best]
    return 0, []


def longest_matches(
    context: Sequence[int], own: AnchorIndex | None, store: SuffixStore | None, limit: int
) -> tuple[int, list[Match]]:
    """The longest match length (<= limit) over the request's own text and the store,
    and every candidate that reaches it, own text first, each source's newest first."""
    best = 0
    matches: list[Match] = []
    if own is not None:

        def in_own(n: int) -> list[Match]:
            return [Match(context, p, OWN) for p in own.lookup(context, n)]

        best, matches = _longest(context, own.lengths, in_own, limit)
    if store is not None:

        def in_store(n: int) -> list[Match]:
            found: list[Match] = []
            for packed in store.index.lookup(context, n):
                sid, offset = unpack(packed)
                tokens = store.segments.get(sid)
                if tokens is not None:
                    found.append(Match(tokens, offset, sid))
            return found

        length, found = _longest(context, store.index.lengths, in_store, limit)
        if length > best:
            best, matches = length, found
        elif length == best:
            matches += found
    return best, matches


def _token_at(m: Match, i: int, context: Sequence[int], draft: list[int]) -> int | None:
    """The i-th token after match m; own text past its end reads the draft so far
    (a match near the end continues periodically)."""
    q = m.pos + i
    if m.segment == OWN:
        return context[q] if q < len(context) else draft[q - len(context)]
    return m.tokens[q] if q < len(m.tokens) else None


def most_likely_path(
    context: Sequence[int], matches: list[Match], limit: int, min_confidence: float
) -> tuple[list[int], list[Match]]:
    """At most `limit` tokens, each the one most of the still-agreeing matches continue
    with, while the product of the agreeing shares stays >= min_confidence; also the
    matches that agree with the whole draft."""
    draft: list[int] = []
    alive = matches
    confidence = 1.0
    for i in range(limit):
        counts: dict[int, int] = {}
        nexts: list[tuple[Match, int]] = []
        for m in alive:
            tok = _token_at(m, i, context, draft)
            if tok is not None:
                counts[tok] = counts.get(tok, 0) + 1
                nexts.append((m, tok))
        if not counts:
            break
        best = max(counts, key=counts.__getitem__)  # ties: the first seen
        confidence *= counts[best] / len(nexts)
        if confidence < min_confidence:
            break
        draft.append(best)
        alive = [m for m, tok in nexts if tok == best]
    return draft, alive


class SuffixProposer:
    """Drafts from the request's own tokens and from the store of finished requests."""

    def __init__(
        self,
        store_tokens: int = DEFAULT_STORE_TOKENS,
        *,
        max_match: int = MAX_MATCH,
        min_confidence: float = MIN_CONFIDENCE,
        cap: int = CAP,
    ) -> None:
        if max_match < max(OWN_ANCHORS) or not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"bad max_match {max_match} or min_confidence {min_confidence}")
        self.store = SuffixStore(store_tokens, STORE_ANCHORS, cap)
        self.max_match = max_match
        self.min_confidence = min_confidence
        self.cap = cap
        self._own: weakref.WeakKeyDictionary[Request, _Own] = weakref.WeakKeyDictionary()

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        return [
            self.draft(req.all_token_ids, self._own_index(req), k) if k > 0 else []
            for req, k in zip(requests, num_tokens, strict=True)
        ]

    def draft(self, context: Sequence[int], own: AnchorIndex | None, k: int) -> list[int]:
        """At most k tokens to follow `context`, from its own index and the store."""
        length, matches = longest_matches(context, own, self.store, self.max_match)
        if not matches:
            return []
        draft, agreeing = most_likely_path(context, matches, min(k, length), self.min_confidence)
        if draft:
            for sid in {m.segment for m in agreeing if m.segment != OWN}:
                self.store.touch(sid)
        return draft

    def finish(self, req: Request) -> None:
        """The request is done: its own index goes, its tokens join the store. A fork
        of an n > 1 request (index > 0) adds its output and only the prompt's last
        max_match tokens: the first sequence stored the prompt already."""
        self._own.pop(req, None)
        tokens = req.all_token_ids
        if req.index > 0:
            tokens = tokens[max(0, req.num_prompt_tokens - self.max_match) :]
        self.store.add(tokens)

    def reset(self) -> None:
        """Forget every request: the store starts empty (benchmarks' rounds)."""
        self._own.clear()
        self.store = SuffixStore(self.store.max_tokens, STORE_ANCHORS, self.cap)

    def verified(self, req: Request) -> None:
        """Nothing to do: the own index catches up at the next lookup."""

    def release(self, req: Request) -> None:
        """Nothing to do: the request's tokens, and so its own index, stay."""

    def _own_index(self, req: Request) -> AnchorIndex:
        """The request's index, extended by the tokens added since the last step."""
        own = self._own.get(req)
        if own is None:
            own = self._own[req] = _Own(AnchorIndex(OWN_ANCHORS, self.cap))
        tokens = req.all_token_ids
        own.index.add(tokens, own.num_indexed, len(tokens))
        own.num_indexed = len(tokens)
        return own.index
