"""Draft tokens from a self-drafting head (EAGLE-style) on the target's hidden states.

The head (sluice/models/eagle.py) is one decoder layer that turns the target's feature
at position p (its final-normed hidden state) and the token at p + 1 into a guess of
the feature at p + 1, whose logits under the target's (restricted) head give the draft
at p + 2. It runs on a ModelRunner and a paged KV pool of its own, like a draft
model, but it needs the target's features, so the target's runner returns them every
step and the engine hands them over (`take_features`) before the tokens are verified.

Per request the head keeps a shadow sequence whose row j is position start + j: its
token is the target's token at start + j + 1 and its feature the target's at start +
j. Rows computed from the target's features stay in the head's KV ("real" rows);
drafting adds rows fed with the head's own guesses, which every sync rolls back: once
the target has verified, the accepted positions get their true features and are
computed again from them (what EAGLE does). So each call:

1. catches every drafting request up on its real rows (the whole prompt the first
   time, under a token budget; afterwards the one to k + 1 positions the last step
   accepted), as one ragged batch; a request caught up gets its first draft and the
   guessed feature that goes with it;
2. runs the remaining draft positions one batched forward each, each row fed its last
   draft and its last guessed feature.

Drafts are greedy, so the proposal is one-hot and the engine's verification is exact
rejection sampling (see draft_model.py): output follows the target's distribution, and
greedy and seeded requests give the same tokens as without speculation.

A prefix-cache hit or a preemption leaves positions the target did not compute in this
pass: the shadow then starts at the first position whose feature arrived (RoPE makes
attention depend on relative positions only, so the head's positions may start at 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sluice.core.request import Request
from sluice.core.sampling_params import SamplingParams
from sluice.engine.kv_cache import KVCacheManager
from sluice.engine.speculative.shadow import ShadowProposer
from sluice.runner.model_runner import ModelOutput, ModelRunner

_SHADOW_PARAMS = SamplingParams(temperature=0)
# Features held for a request whose head has not caught up (a request in a batch too
# large to speculate): past this many the oldest go and its shadow starts later.
_MAX_PENDING = 1024


@dataclass(eq=False)
class _Shadow:
    """The head's view of one target request."""

    seq: Request  # row j: the target's token at start + j + 1 (then the drafts fed)
    start: int  # the target position of row 0
    num_real: int = 0  # rows whose KV was computed from the target's features
    # The target's features of positions start + num_real, ..., in arrival order.
    pending: list[torch.Tensor] = field(default_factory=list)
    num_pending: int = 0

    @property
    def end(self) -> int:
        """The first position with no feature yet."""
        return self.start + self.num_real + self.num_pending

    def keep_features(self, end: int) -> None:
        """Forget the features of positions from `end` on (rejected drafts')."""
        n = end - self.start - self.num_real
        if n < self.num_pending:
            self.pending = [torch.cat(self.pending)[:n]] if n > 0 else []
            self.num_pending = max(n, 0)

    def take_features(self, n: int) -> torch.Tensor:
        """The first n pending features, removed."""
        feats = torch.cat(self.pending)
        self.pending = [feats[n:]] if n < len(feats) else []
        self.num_pending -= n
        return feats[:n]


@dataclass(eq=False)
class _Row:
    """A request drafting this call."""

    index: int
    shadow: _Shadow
    num_drafts: int
    guess: torch.Tensor | None = None  # the head's last guessed feature [1, hidden]


class EagleProposer(ShadowProposer[_Shadow, _Row]):
    def __init__(
        self,
        runner: ModelRunner,
        kv: KVCacheManager,
        *,
        vocab_size: int,
        max_chunk_tokens: int,
        output_ids: torch.Tensor | None = None,
    ) -> None:
        """runner: the head's (built with return_features); vocab_size: the target's
        vocabulary (drafts are ids below it); max_chunk_tokens: the rows a call may
        catch up on; output_ids: the ids the head's logits are for, where restricted."""
        self.runner = runner
        self.kv = kv
        self.vocab_size = vocab_size
        self.output_ids = output_ids
        self.max_chunk_tokens = max_chunk_tokens
        self._shadows: dict[Request, _Shadow] = {}
        self.num_forwards = 0

    # ---- the target's features ---------------------------------------------------

    def take_features(
        self, scheduled: Sequence[tuple[Request, int]], features: dict[Request, torch.Tensor]
    ) -> None:
        """The target computed `n` tokens of each request from its num_computed_tokens
        on (not yet advanced) and these are their features. Rows past what the target
        keeps (rejected drafts') are dropped at the next arrival or proposal."""
        for req, n in scheduled:
            pos = req.num_computed_tokens
            shadow = self._shadows.get(req)
            if shadow is not None:
                shadow.keep_features(pos)
                if shadow.end != pos or shadow.num_pending + n > _MAX_PENDING:
                    self.release(req)  # a gap (prefix-cache hit, recompute): start anew
                    shadow = None
            if shadow is None:
                first = req.all_token_ids[pos + 1 : pos + 2] or [0]
                seq = Request(req.request_id, first, _SHADOW_PARAMS)
                shadow = self._shadows[req] = _Shadow(seq, pos)
            shadow.pending.append(features[req].detach())
            shadow.num_pending += n

    # ---- the Proposer protocol ---------------------------------------------------

    def verified(self, req: Request) -> None:
        """Nothing to do now: the next features or proposal syncs the shadow."""

    # ---- the head's forward passes -------------------------------------------------

    def _catch_up(
        self, requests: Sequence[Request], num_tokens: Sequence[int], drafts: list[list[int]]
    ) -> list[_Row]:
        """One forward over every drafting request's real rows not computed yet (within
        the budget); the first draft and guess of each that caught up."""
        budget = self.max_chunk_tokens
        batch: list[tuple[Request, int]] = []
        feats: dict[Request, torch.Tensor] = {}
        rows: list[_Row] = []
        for i, (req, k) in enumerate(zip(requests, num_tokens, strict=True)):
            shadow = self._sync(req) if k > 0 and budget > 0 else None
            if shadow is None:
                continue
            seq = shadow.seq
            n = min(seq.num_tokens - shadow.num_real, budget)
            if n <= 0 or not self.kv.allocate_slots(seq, n):
                continue
            batch.append((seq, n))
            feats[seq] = shadow.take_features(n)
            shadow.num_real += n
            budget -= n
            if shadow.num_real == seq.num_tokens:
                rows.append(_Row(i, shadow, k))
        if not batch:
            return []
        self._take(self._forward(batch, feats), rows, drafts)
        return rows

    def _draft(self, rows: list[_Row], drafts: list[list[int]]) -> None:
        """Each row fed its last draft and guessed feature."""
        feats: dict[Request, torch.Tensor] = {}
        for row in rows:
            assert row.guess is not None, "a drafting row has its first guess"
            feats[row.shadow.seq] = row.guess
        self._take(self._forward([(row.shadow.seq, 1) for row in rows], feats), rows, drafts)

    def _take(
        self,
        result: tuple[ModelOutput, dict[Request, int]],
        rows: list[_Row],
        drafts: list[list[int]],
    ) -> None:
        """Each row's greedy draft and guessed feature from the head's pass."""
        out, picked = result
        assert out.features is not None, "the head's runner returns its features"
        for row in rows:
            seq = row.shadow.seq
            drafts[row.index].append(picked[seq])
            row.guess = out.features[seq][-1:]

    # ---- shadows -----------------------------------------------------------------

    def _sync(self, req: Request) -> _Shadow | None:
        """The request's shadow with the head's guessed rows rolled back and its rows
        the target's tokens up to the last; None where its features do not reach the
        target's last computed position (nothing to draft from yet)."""
        shadow = self._shadows.get(req)
        if shadow is None:
            return None
        computed = req.num_computed_tokens  # == num_tokens - 1 for a decode row
        shadow.keep_features(computed)
        if shadow.end != computed:
            return None
        seq = shadow.seq
        self.kv.rollback(seq, seq.num_computed_tokens - shadow.num_real)
        seq.all_token_ids[:] = req.all_token_ids[shadow.start + 1 : computed + 1]
        return shadow
