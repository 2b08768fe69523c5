"""Draft tokens from a smaller model with the target's tokenizer.

The draft model runs on a ModelRunner and a paged KV pool of its own (its own
KVCacheManager; no prefix cache). For each target request it drafts for, it keeps a
shadow sequence: a Request whose tokens are the target's known tokens followed by the
drafts it fed itself, and whose blocks live in the draft pool, so the draft's KV holds
a prefix of them. Each call:

1. catches every drafting request up with the tokens the draft has not seen (its
   whole prompt the first time; afterwards the one or two tokens the target added
   beyond what the draft computed), as one ragged batch under a token budget: a long
   prompt is prefilled in chunks over several steps, and the request drafts only once
   it has caught up. The rows that caught up get logits for their first draft;
2. runs the remaining draft positions as decode steps batched across all drafting
   requests: one forward per draft position for the whole batch.

Drafts are greedy (argmax of the draft's logits). The proposal is then one-hot, and
for a one-hot proposal the engine's verification rule (accept a draft iff the token the
target samples at its position equals it; sluice/runner/spec_verify.py) is exactly
rejection sampling: P(accept d) = p(d) = min(1, p(d)/q(d)), and a rejection leaves p
conditioned on "not d", i.e. norm(max(p - q, 0)). So the output follows the target's
distribution exactly, for greedy and sampled requests alike, and a seeded request gives
the same tokens as without speculation.

After verification the draft's KV is rolled back to the longest prefix it shares with
the target's tokens (what it computed for accepted drafts stays; the rejected draft's
and anything after it go), and a request that finishes, is aborted or is preempted
frees its draft blocks at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sluice.core.request import Request
from sluice.core.sampling_params import SamplingParams
from sluice.engine.kv_cache import KVCacheManager
from sluice.engine.speculative.shadow import ShadowProposer
from sluice.runner.model_runner import ModelRunner

# The shadow sequences' params: greedy, no logprobs (the runner reads prompt_logprobs).
_SHADOW_PARAMS = SamplingParams(temperature=0)


@dataclass(eq=False)
class _Shadow:
    """The draft model's view of one target request."""

    seq: Request  # tokens: the target's first num_known, then drafts fed to the draft
    num_known: int


@dataclass(eq=False)
class _Row:
    """A request drafting this call: where its drafts go and how many it wants."""

    index: int
    shadow: _Shadow
    num_drafts: int


class DraftModelProposer(ShadowProposer[_Shadow, _Row]):
    def __init__(
        self,
        runner: ModelRunner,
        kv: KVCacheManager,
        *,
        vocab_size: int,
        max_model_len: int,
        max_chunk_tokens: int,
        output_ids: torch.Tensor | None = None,
    ) -> None:
        """vocab_size: the ids both models have (the smaller vocabulary): drafts are the
        argmax over them, and a request holding a larger id is not drafted for;
        max_model_len: the draft's context (positions past it get no drafts);
        max_chunk_tokens: the tokens a call may catch up on; output_ids: the ids the
        draft's logits are for, column by column, where its head is restricted (all
        below vocab_size)."""
        self.runner = runner
        self.kv = kv
        self.vocab_size = vocab_size
        self.output_ids = output_ids
        self.max_model_len = max_model_len
        self.max_chunk_tokens = max_chunk_tokens
        self._shadows: dict[Request, _Shadow] = {}
        self.num_forwards = 0  # draft forward passes (catch-up and decode)

    # ---- the Proposer protocol ---------------------------------------------------

    def verified(self, req: Request) -> None:
        shadow = self._shadows.get(req)
        if shadow is not None and not req.is_finished and not self._sync(req, shadow):
            self.release(req)

    # ---- the draft's forward passes ------------------------------------------------

    def _catch_up(
        self, requests: Sequence[Request], num_tokens: Sequence[int], drafts: list[list[int]]
    ) -> list[_Row]:
        """One forward over every drafting request's unseen tokens (within the budget);
        the first draft of each that caught up. Returns those rows."""
        budget = self.max_chunk_tokens
        batch: list[tuple[Request, int]] = []
        rows: list[_Row] = []
        for i, (req, k) in enumerate(zip(requests, num_tokens, strict=True)):
            # The last draft is never fed back: positions up to num_tokens + k - 2.
            k = min(k, self.max_model_len - req.num_tokens + 1)
            shadow = self._shadow(req) if k > 0 and budget > 0 else None
            if shadow is None:
                continue
            seq = shadow.seq
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.kv.allocate_slots(seq, n):
                continue  # the draft pool is full: no drafts this step
            batch.append((seq, n))
            budget -= n
            if seq.num_computed_tokens + n == seq.num_tokens:
                rows.append(_Row(i, shadow, k))
        if not batch:
            return []
        _, tokens = self._forward(batch)
        for row in rows:
            drafts[row.index].append(tokens[row.shadow.seq])
        return rows

    def _draft(self, rows: list[_Row], drafts: list[list[int]]) -> None:
        _, tokens = self._forward([(row.shadow.seq, 1) for row in rows])
        for row in rows:
            drafts[row.index].append(tokens[row.shadow.seq])

    # ---- shadows -----------------------------------------------------------------

    def _shadow(self, req: Request) -> _Shadow | None:
        """The request's shadow, in step with its tokens (made the first time); None if
        the request holds a token the draft model does not have."""
        shadow = self._shadows.get(req)
        if shadow is None:
            seq = Request(req.request_id, req.prompt_token_ids, _SHADOW_PARAMS)
            shadow = self._shadows[req] = _Shadow(seq, 0)
        if not self._sync(req, shadow):
            self.release(req)
            return None
        return shadow

    def _sync(self, req: Request, shadow: _Shadow) -> bool:
        """Keep the draft's KV for the longest prefix its tokens share with the
        target's (accepted drafts included), forget the rest, and take the target's
        new tokens. At least the last known token is left to compute: its logits give
        the first draft. False if a new token is an id the draft model lacks."""
        seq, tokens = shadow.seq, req.all_token_ids
        if any(t >= self.vocab_size for t in tokens[shadow.num_known :]):
            return False
        same = shadow.num_known
        limit = min(seq.num_tokens, len(tokens))
        while same < limit and seq.all_token_ids[same] == tokens[same]:
            same += 1
        keep = min(same, seq.num_computed_tokens, len(tokens) - 1)
        self.kv.rollback(seq, seq.num_computed_tokens - keep)
        del seq.all_token_ids[same:]
        seq.all_token_ids.extend(tokens[same:])
        shadow.num_known = len(tokens)
        return True
