"""What the draft model and the self-drafting head share: a shadow sequence per target
request in a KV pool of their own, freed with the request, and drafting as one catch-up
pass then one batched pass per further draft position, each pick greedy."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

import torch

from sluice.core.request import Request
from sluice.engine.kv_cache import KVCacheManager
from sluice.runner.model_runner import ModelOutput, ModelRunner


class _Shadow(Protocol):
    seq: Request  # the proposer's own sequence for a target request


class _Row(Protocol):
    index: int  # where its drafts go
    num_drafts: int  # how many it wants

    @property
    def shadow(self) -> _Shadow: ...


S = TypeVar("S", bound=_Shadow)
R = TypeVar("R", bound=_Row)


class ShadowProposer(abc.ABC, Generic[S, R]):
    """Subclasses give `_catch_up` (one pass over what each drafting request's shadow
    has not computed; the rows that got a first draft) and `_draft` (one pass feeding
    each row its last draft, appending the next)."""

    runner: ModelRunner
    kv: KVCacheManager
    vocab_size: int  # drafts are ids below it
    output_ids: torch.Tensor | None  # the ids the logits are for, where restricted
    num_forwards: int
    _shadows: dict[Request, S]

    @property
    def num_tracked(self) -> int:
        """Requests whose proposer state (KV, features) is held."""
        return len(self._shadows)

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        rows = self._catch_up(requests, num_tokens, drafts)
        for j in range(1, max((r.num_drafts for r in rows), default=0)):
            rows = self._decode_step([r for r in rows if r.num_drafts > j], drafts)
            if not rows:
                break
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

    @abc.abstractmethod
    def _catch_up(
        self, requests: Sequence[Request], num_tokens: Sequence[int], drafts: list[list[int]]
    ) -> list[R]: ...

    @abc.abstractmethod
    def _draft(self, rows: list[R], drafts: list[list[int]]) -> None: ...

    def _decode_step(self, rows: list[R], drafts: list[list[int]]) -> list[R]:
        """Feed each row its latest draft and draft the next token, one forward for
        all; the rows the pool had a slot for."""
        kept: list[R] = []
        for row in rows:
            seq = row.shadow.seq
            seq.append_token(drafts[row.index][-1])
            if not self.kv.allocate_slots(seq, 1):
                seq.all_token_ids.pop()
                continue
            kept.append(row)
        if kept:
            self._draft(kept, drafts)
        return kept

    def _forward(
        self,
        batch: list[tuple[Request, int]],
        features: dict[Request, torch.Tensor] | None = None,
    ) -> tuple[ModelOutput, dict[Request, int]]:
        """Run the batch; the output and the greedy next token of each shadow that
        caught up with its tokens."""
        out = self.runner.execute(batch, features)
        self.num_forwards += 1
        for seq, n in batch:
            seq.num_computed_tokens += n
        if self.output_ids is None:
            ids = out.logits[:, : self.vocab_size].argmax(dim=-1).tolist()
        else:
            ids = self.output_ids[out.logits.argmax(dim=-1).cpu()].tolist()
        return out, dict(zip(out.sampling_requests, ids, strict=True))
