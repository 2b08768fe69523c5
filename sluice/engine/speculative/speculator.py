"""When to speculate and how far: never slower than plain decoding, by a simple cost model.

Each step, before scheduling, the speculator gives some running decode requests draft
tokens (`Request.spec_token_ids`); the scheduler grants them 1 + k tokens from what
the step's budget leaves, and after verification `observe` records what was accepted.

The cost model (docs/architecture.md, "Speculative decoding", has the measurements):

- Only decode rows speculate, and only while the batch has at most
  `MAX_DECODE_ROWS` of them. Past that a step is no longer bound by reading the
  weights, so each draft token costs nearly as much as a decoded one; speculation is
  off for the whole step.
- Below it, one more query token costs `TOKEN_COST` of a decode step. A request whose
  drafts are each accepted with probability a expects E(k) = 1 + a + ... + a^k tokens
  from a step with k drafts, which costs 1 + TOKEN_COST * k decode steps; k is the
  value that maximises E(k) / (1 + TOKEN_COST * k), at most num_speculative_tokens and
  never past the request's max_tokens. a is the request's running acceptance (a
  geometric estimate over decaying counts, starting from a prior of 1/2): a request
  whose drafts keep failing drafts less or not at all, and as its counts decay it tries
  again.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from sluice.core.choices import SpeculativeMethod
from sluice.core.request import Request
from sluice.engine.speculative.ngram import NgramProposer
from sluice.engine.speculative.proposer import Proposer

# Measured on this project's 2-core CPU (docs/architecture.md): see the module docstring.
MAX_DECODE_ROWS = 4
TOKEN_COST = 0.1
# Acceptance counts decay by this factor at each step a request could draft; the prior
# (1 accepted in 2 trials) is added when the rate is read.
_DECAY = 0.9
_PRIOR_ACCEPTED = 1.0
_PRIOR_TRIALS = 2.0
_RATE_STEPS = 20  # the rate is read to the nearest 1/20 for the table of best k


def make_proposer(method: SpeculativeMethod) -> Proposer:
    if method == "ngram":
        return NgramProposer()
    raise ValueError(f"unknown speculative method {method!r}")


def best_num_drafts(acceptance: float, k_max: int, token_cost: float) -> int:
    """The k in 0..k_max that maximises expected tokens per unit of step time."""
    best, best_value = 0, 1.0
    expected, term = 1.0, 1.0
    for k in range(1, k_max + 1):
        term *= acceptance
        expected += term
        value = expected / (1.0 + token_cost * k)
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
        return (self.accepted + _PRIOR_ACCEPTED) / (self.trials + _PRIOR_TRIALS)


class Speculator:
    def __init__(
        self,
        method: SpeculativeMethod,
        num_speculative_tokens: int,
        max_model_len: int,
        *,
        max_decode_rows: int = MAX_DECODE_ROWS,
        token_cost: float = TOKEN_COST,
    ) -> None:
        self.proposer = make_proposer(method)
        self.max_model_len = max_model_len
        self.max_decode_rows = max_decode_rows
        self._best_k = [
            best_num_drafts(i / _RATE_STEPS, num_speculative_tokens, token_cost)
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
