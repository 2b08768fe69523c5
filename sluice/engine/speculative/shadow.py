"""What the draft model and the self-drafting head share: a shadow sequence per target
request in a KV pool of their own, freed with the request, and drafting as one catch-up
pass then one batched pass per further draft position."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

from sluice.core.request import Request
from sluice.engine.kv_cache import KVCacheManager


class _HasSeq(Protocol):
    seq: Request


class _HasDrafts(Protocol):
    num_drafts: int


S = TypeVar("S", bound=_HasSeq)
R = TypeVar("R", bound=_HasDrafts)


class ShadowProposer(Generic[S, R]):
    """Subclasses give `_catch_up` (first drafts, the rows that drafted) and
    `_decode_step` (one more draft for each row, the rows that still draft)."""

    kv: KVCacheManager
    _shadows: dict[Request, S]

    @property
    def num_tracked(self) -> int:
        """Requests whose proposer state (KV, features) is held."""
        return len(self._shadows)

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        rows = self._catch_up(requests, num_tokens, drafts)
        for j in range(1, max((r.num_drafts for r in rows), default=0)):
            rows = [r for r in rows if r.num_drafts > j]
            if not rows:
                break
            rows = self._decode_step(rows, drafts)
        return drafts

    def release(self, req: Request) -> None:
        """The request's shadow KV goes back to the pool (preempted: it is computed
        again when the request next drafts)."""
        shadow = self._shadows.pop(req, None)
        if shadow is not None:
            self.kv.free(shadow.seq)

    def finish(self, req: Request) -> None:
        self.release(req)

    def reset(self) -> None:
        for req in list(self._shadows):
            self.release(req)

    def _catch_up(
        self, requests: Sequence[Request], num_tokens: Sequence[int], drafts: list[list[int]]
    ) -> list[R]:
        raise NotImplementedError

    def _decode_step(self, rows: list[R], drafts: list[list[int]]) -> list[R]:
        raise NotImplementedError
