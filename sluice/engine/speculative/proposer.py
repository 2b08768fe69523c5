"""What a proposer is: it reads requests and returns draft tokens to verify.

A proposer never touches the target's KV cache, the scheduler or the sampler: it only
guesses the next tokens of each sequence. The engine verifies them in the next forward
pass (see sluice/runner/spec_verify.py), so a bad guess costs a few query tokens and
never changes the output. It hears when a request has verified its drafts
(`verified`: a draft model rolls its own KV back to the accepted prefix), when a
request's target KV is dropped to be recomputed later (`release`: preemption; a draft
model frees its KV too) and when a request finishes (`finish`), so it can drop what it
kept for it, or learn from it (the suffix proposer stores finished requests' text).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from sluice.core.request import Request


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        """Draft tokens to follow each request's all_token_ids: at most num_tokens[i]
        for requests[i], possibly none."""
        ...

    def verified(self, req: Request) -> None:
        """The request has verified its drafts: the accepted ones and the token after
        them are in its all_token_ids now, the rejected ones are gone."""
        ...

    def release(self, req: Request) -> None:
        """The request was preempted or requeued: its target KV is gone and will be
        recomputed; it may draft again later."""
        ...

    def reset(self) -> None:
        """Forget everything learnt from earlier requests."""
        ...

    def finish(self, req: Request) -> None:
        """The request finished (stopped, hit a limit or was aborted); called once."""
        ...


@runtime_checkable
class FeatureProposer(Proposer, Protocol):
    """A proposer that drafts from the target's hidden states (a method registered with
    needs_features: the target's runner returns them every step)."""

    def take_features(
        self, scheduled: Sequence[tuple[Request, int]], features: dict[Request, torch.Tensor]
    ) -> None:
        """The target computed `n` tokens of each scheduled request (from its
        num_computed_tokens on, not yet advanced); these are their features."""
        ...
