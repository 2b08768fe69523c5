"""When to speculate and how far: never slower than plain decoding, by a simple cost model.

Each step, before scheduling, the speculator gives some running decode requests draft
tokens (`Request.spec_token_ids`); the scheduler grants them 1 + k tokens from what
the step's budget leaves, and after verification `observe` records what was accepted.

The cost model, from benchmarks/spec_cost.py on this project's 2-core AVX-512 CPU with
the default weights (bfloat16, the bundled GGUF's blocks; docs/architecture.md,
"Speculative decoding", has the tables):

- Only decode rows speculate, and only while the step has at most `MAX_DECODE_ROWS`
  of them. With two or three rows a draft token already cost 0.8-0.9 of a decode step
  there (the rows leave the 3-row decode stack, and the block kernels' work grows with
  the rows), which only near-certain drafts would repay; speculation is off for the
  whole step.
- At one row, a step with k drafts takes `STEP_COST[k]` decode steps. A request whose
  drafts are each accepted with probability a expects E(k) = 1 + a + ... + a^k tokens
  from it, so it drafts the k that maximises E(k) / STEP_COST[k] (0 if none beats a
  plain step), at most num_speculative_tokens and never past its max_tokens. a is its
  running acceptance: accepted drafts over drafts tested (up to the first rejection of
  each step), in counts that decay each step, plus a prior of 0.8 worth one trial. A
  request whose drafts keep failing stops drafting; as its counts decay it tries one
  draft again now and then (every ~20 steps once it has failed a few times: about 1%
  of its time, the price of noticing when its text starts to repeat).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from sluice.core.choices import SpeculativeMethod
from sluice.core.request import Request
from sluice.engine.speculative.ngram import NgramProposer
from sluice.engine.speculative.proposer import Proposer

MAX_DECODE_ROWS = 1
# Step time with k = 0, 1, ... drafts at one decode row, in decode steps (measured up to
# k = 4 and at 6 and 8, interpolated between; extrapolated by the last slope beyond).
STEP_COST: tuple[float, ...] = (1.0, 1.25, 1.55, 2.6, 3.4, 3.8, 4.15, 4.6, 5.0)
# Acceptance counts decay by this factor at each step a request could draft; the prior
# (0.8, worth one trial) is added when the rate is read.
_DECAY = 0.98
_PRIOR_RATE = 0.8
_PRIOR_TRIALS = 1.0
_RATE_STEPS = 20  # the rate is read to the nearest 1/20 for the table of best k


def make_proposer(method: SpeculativeMethod) -> Proposer:
    if method == "ngram":
        return NgramProposer()
    raise ValueError(f"unknown speculative method {method!r}")


def step_cost(k: int, table: Sequence[float] = STEP_COST) -> float:
    """A step with k drafts, in plain decode steps (`table`, extended by its last slope)."""
    if k < len(table):
        return table[k]
    return table[-1] + (k - len(table) + 1) * (table[-1] - table[-2])


def best_num_drafts(acceptance: float, k_max: int, table: Sequence[float] = STEP_COST) -> int:
    """The k in 0..k_max that maximises expected tokens per unit of step time."""
    best, best_value = 0, 1.0
    expected, term = 1.0, 1.0
    for k in range(1, k_max + 1):
        term *= acceptance
        expected += term
        value = expected / step_cost(k, table)
        if value > best_value:
            best, best_value = k, value
    return best


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
        self,
        method: SpeculativeMethod,
        num_speculative_tokens: int,
        max_model_len: int,
        *,
        max_decode_rows: int = MAX_DECODE_ROWS,
        step_costs: Sequence[float] = STEP_COST,
    ) -> None:
        self.proposer = make_proposer(method)
        self.max_model_len = max_model_len
        self.max_decode_rows = max_decode_rows
        self._best_k = [
            best_num_drafts(i / _RATE_STEPS, num_speculative_tokens, step_costs)
            for i in range(_RATE_STEPS + 1)
        ]
        self._acceptance: weakref.WeakKeyDictionary[Request, _Acceptance] = (
            weakref.WeakKeyDictionary()
        )
        self.num_drafted_tokens = 0
        self.num_accepted_tokens = 0

    def propose(self, running: Sequence[Request]) -> None:
        """Set this step's draft tokens on the running requests (none on most)."""
        for req in running:
            if req.spec_token_ids:
                req.spec_token_ids = []
        decode = [r for r in running if r.num_computed_tokens == r.num_tokens - 1]
        if not decode or len(decode) > self.max_decode_rows:
            return
        rows: list[Request] = []
        ks: list[int] = []
        for req in decode:
            k = self._num_drafts(req)
            if k > 0:
                rows.append(req)
                ks.append(k)
        if rows:
            for req, drafts in zip(rows, self.proposer.propose(rows, ks), strict=True):
                req.spec_token_ids = drafts

    def observe(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """A request verified `num_drafts` drafts and accepted the first `num_accepted`."""
        self.num_drafted_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        acc = self._acceptance.get(req)
        if acc is not None:
            acc.accepted += num_accepted
            acc.trials += num_accepted + int(num_accepted < num_drafts)

    def _num_drafts(self, req: Request) -> int:
        # Constrained requests are not speculated (their grammar would have to check
        # each draft), nor a request whose forks still wait for its first token.
        if req.grammar is not None or req.pending_forks:
            return 0
        room = self._tokens_left(req) - 1  # the step's own token comes on top
        if room <= 0:
            return 0
        acc = self._acceptance.get(req)
        if acc is None:
            acc = self._acceptance[req] = _Acceptance()
        acc.accepted *= _DECAY
        acc.trials *= _DECAY
        return min(room, self._best_k[round(acc.rate * _RATE_STEPS)])

    def _tokens_left(self, req: Request) -> int:
        """Output tokens the request may still produce (max_tokens, the context)."""
        limit = self.max_model_len - req.num_prompt_tokens
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens)
        return limit - req.num_output_tokens
