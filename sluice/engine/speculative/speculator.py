"""When to speculate and how far: never slower than plain decoding, by a measured cost model.

Each step, before scheduling, the speculator gives some running decode requests draft
tokens (`Request.spec_token_ids`); the scheduler grants them 1 + k tokens from what
the step's budget leaves, and after verification `observe` records what was accepted.

The cost model is the step-cost table measured on this machine at start-up
(step_costs.py): a step in which m of the step's B decode rows verify k drafts is
taken to cost 1 + (m / B) (cost(B, k) - 1) plain steps. A request whose drafts are
each accepted with probability a yields a + a^2 + ... + a^k extra tokens from them.
Each step the speculator picks the k and the m rows of highest acceptance that
maximise tokens per unit of step time, and drafts nothing when no choice beats a plain
step (B tokens per step): in particular never with more decode rows than the table
measured (compute-bound batches), nor where drafts cost what they could yield. k is
capped by num_speculative_tokens and by each request's max_tokens.

A draft model's drafts cost its forward passes on top (k passes over the m drafting
rows, the first also catching up on the tokens the target added): the same table holds
them, measured with both models (StepCosts.draft_cost), so a slow or weak draft model
is simply not used.

a is the request's running acceptance: accepted drafts over drafts tested (up to the
first rejection of each step), in counts that decay each step, plus a prior of 0.8
worth one trial. A request whose drafts keep failing stops drafting; as its counts
decay it tries one draft again now and then (every ~20 steps once it has failed a few
times: about 1% of its time, the price of noticing when its text starts to repeat).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sluice.core.request import Request
from sluice.engine.speculative.proposer import FeatureProposer, Proposer
from sluice.engine.speculative.step_costs import StepCosts
from sluice.structured import valid_drafts

# Acceptance counts decay by this factor at each step a request could draft; the prior
# (0.8, worth one trial) is added when the rate is read.
_DECAY = 0.98
_PRIOR_RATE = 0.8
_PRIOR_TRIALS = 1.0


def extra_tokens(acceptance: float, k: int) -> float:
    """Expected accepted drafts out of k, each accepted with probability `acceptance`
    given the ones before it."""
    total, term = 0.0, 1.0
    for _ in range(k):
        term *= acceptance
        total += term
    return total


def plan_drafts(rates: Sequence[float], room: Sequence[int], costs: StepCosts) -> list[int]:
    """Drafts per decode row (rates: each row's acceptance; room: the most it may draft)
    that maximise tokens per unit of step time; all zeros when nothing beats a plain
    step."""
    rows = len(rates)
    plan = [0] * rows
    if rows == 0 or rows > costs.max_rows:
        return plan
    order = sorted(range(rows), key=lambda i: -rates[i])
    best = float(rows)  # a plain step: one token per row, in one unit of time
    for k in range(1, max(room) + 1):
        extra_time = costs.cost(rows, k) - 1.0
        gain = 0.0
        for m, i in enumerate(order, 1):
            gain += extra_tokens(rates[i], min(k, room[i]))
            step_time = 1.0 + extra_time * m / rows + costs.draft_cost(rows, m, k)
            value = (rows + gain) / step_time
            if value > best:
                best = value
                plan = [0] * rows
                for j in order[:m]:
                    plan[j] = min(k, room[j])
    return plan


def best_num_drafts(acceptance: float, k_max: int, costs: StepCosts) -> int:
    """The k in 0..k_max that maximises one decode row's tokens per unit of time."""
    return plan_drafts([acceptance], [k_max], costs)[0]


@dataclass
class _Acceptance:
    """Decaying counts of accepted drafts and of drafts tested (those up to and
    including the first rejection of each step)."""

    accepted: float = 0.0
    trials: float = 0.0

    @property
    def rate(self) -> float:
        return (self.accepted + _PRIOR_RATE * _PRIOR_TRIALS) / (self.trials + _PRIOR_TRIALS)


class Speculator:
    def __init__(
        self, proposer: Proposer, num_speculative_tokens: int, max_model_len: int, costs: StepCosts
    ) -> None:
        """proposer: the draft source (methods.py builds it from the method's name)."""
        self.proposer = proposer
        # Checked once here: a runtime Protocol check inspects every member, too
        # slow for each step.
        self._feature_sink = proposer if isinstance(proposer, FeatureProposer) else None
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        self.costs = costs
        self._acceptance: weakref.WeakKeyDictionary[Request, _Acceptance] = (
            weakref.WeakKeyDictionary()
        )
        self.num_drafted_tokens = 0
        self.num_accepted_tokens = 0
        # Tokens the verifying rows emitted (accepted drafts, the target's own token,
        # fewer where a stop ended the run) and how many verifications there were.
        self.num_emitted_tokens = 0
        self.num_verify_steps = 0

    def reset(self) -> None:
        """Forget what was learnt from earlier requests (acceptance, the proposer's
        memory), as if just started; the cost table stays."""
        self._acceptance.clear()
        self.proposer.reset()

    def propose(self, running: Sequence[Request]) -> None:
        """Set this step's draft tokens on the running requests (none on most)."""
        for req in running:
            if req.spec_token_ids:
                req.spec_token_ids = []
        decode = [r for r in running if r.num_computed_tokens == r.num_tokens - 1]
        if not decode or len(decode) > self.costs.max_rows:
            return
        rates, rooms = zip(*(self._rate_and_room(r) for r in decode), strict=True)
        plan = plan_drafts(rates, rooms, self.costs)
        rows = [r for r, k in zip(decode, plan, strict=True) if k > 0]
        if rows:
            ks = [k for k in plan if k > 0]
            for req, drafts in zip(rows, self.proposer.propose(rows, ks), strict=True):
                req.spec_token_ids = valid_drafts(req, drafts)

    def take_features(
        self, scheduled: Sequence[tuple[Request, int]], features: dict[Request, torch.Tensor]
    ) -> None:
        """This step's hidden states of the target, for a proposer that drafts from them."""
        assert self._feature_sink is not None, "features go to a FeatureProposer"
        self._feature_sink.take_features(scheduled, features)

    def observe(self, req: Request, num_drafts: int, num_accepted: int, num_emitted: int) -> None:
        """A request verified `num_drafts` drafts, accepted the first `num_accepted` and
        emitted `num_emitted` tokens from the step."""
        self.num_drafted_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_emitted
        self.num_verify_steps += 1
        acc = self._acceptance.get(req)
        if acc is not None:
            acc.accepted += num_accepted
            acc.trials += num_accepted + int(num_accepted < num_drafts)
        self.proposer.verified(req)

    def release(self, req: Request) -> None:
        """The request was preempted or requeued (its KV is to be recomputed): the
        proposer drops its per-request state (a draft model's KV); its acceptance
        counts stay."""
        self.proposer.release(req)

    def finish(self, req: Request) -> None:
        """The engine retired the request: the proposer may learn from its tokens."""
        self._acceptance.pop(req, None)
        self.proposer.finish(req)

    def _rate_and_room(self, req: Request) -> tuple[float, int]:
        """The request's running acceptance (its counts decayed by a step) and how many
        drafts it may verify now."""
        # Not a request whose forks still wait for its first token (they would all
        # need the drafts' KV). A constrained request drafts too: its drafts are cut
        # at the first token its grammar rejects, after proposing.
        if req.pending_forks:
            return 0.0, 0
        room = min(self.num_speculative_tokens, self._tokens_left(req) - 1)  # + its own
        if room <= 0:
            return 0.0, 0
        acc = self._acceptance.get(req)
        if acc is None:
            acc = self._acceptance[req] = _Acceptance()
        acc.accepted *= _DECAY
        acc.trials *= _DECAY
        return acc.rate, room

    def _tokens_left(self, req: Request) -> int:
        """Output tokens the request may still produce (max_tokens, the context)."""
        limit = self.max_model_len - req.num_prompt_tokens
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens)
        return limit - req.num_output_tokens
