"""The engine's side of constrained decoding: per step, the token masks of the
constrained rows; after sampling, advancing each matcher and the tokens it forces.

A sequence's matcher lives on its `Request` (``grammar``) and only ever sees tokens
the sequence keeps, so it survives preemption: recompute replays the KV, not the
matcher. The masks go to the sampler as llguidance's packed bitmask (one bit per
vocabulary entry), computed for all constrained rows in parallel off the GIL.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import llguidance.numpy as llg_np
import torch

from sluice.core.request import DraftRow, Request, SamplingRow

# llguidance's packed masks (one bit per vocabulary entry, 32 to an int32), through its
# numpy helpers on our tensors' memory. (Its `llguidance.torch` helpers do the same, but
# importing that module compiles a kernel with torch.compile, which loads dynamo and
# inductor: 2 s added to every start of sluice.)


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """Room for `rows` masks, all tokens allowed."""
    return torch.from_numpy(llg_np.allocate_token_bitmask(rows, vocab_size))


def fill_mask(matcher: llguidance.LLMatcher, bitmask: torch.Tensor, row: int) -> None:
    """The matcher's mask of allowed next tokens into row `row`."""
    llg_np.fill_next_token_bitmask(matcher, bitmask.numpy(), row)


def fill_masks(
    executor: llguidance.LLExecutor,
    rows: list[tuple[llguidance.LLMatcher, int]],
    bitmask: torch.Tensor,
) -> None:
    """Several matchers' masks at once, in parallel threads off the GIL."""
    llg_np.fill_next_token_bitmask_par(executor, rows, bitmask.numpy())


class ConstraintMasks:
    """Computes the masks of a step's constrained rows."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._executor = llguidance.LLExecutor(num_threads=2)
        self._bitmask = new_bitmask(1, vocab_size)
        self.num_masks = 0

    def __call__(self, rows: Sequence[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(row indices, bool mask [len(indices), vocab]) of the constrained rows, or
        None when no row is constrained."""
        idx = [i for i, r in enumerate(rows) if r.grammar is not None]
        if not idx:
            return None
        if self._bitmask.shape[0] < len(idx):
            self._bitmask = new_bitmask(len(idx), self.vocab_size)
        bitmask = self._bitmask[: len(idx)]
        # Rows of known tokens first, all at once; then the draft rows, whose masks
        # need their matcher advanced by the drafts before them.
        plain = [
            (rows[i].grammar, j) for j, i in enumerate(idx) if not isinstance(rows[i], DraftRow)
        ]
        if len(plain) == 1:
            fill_mask(plain[0][0], bitmask, plain[0][1])
        elif plain:
            fill_masks(self._executor, plain, bitmask)
        drafts = [(rows[i], j) for j, i in enumerate(idx) if isinstance(rows[i], DraftRow)]
        if drafts:
            _fill_draft_masks(drafts, bitmask)  # type: ignore[arg-type]
        self.num_masks += len(idx)
        return torch.tensor(idx, dtype=torch.long), unpack_bitmask(bitmask, self.vocab_size)


def _fill_draft_masks(rows: list[tuple[DraftRow, int]], bitmask: torch.Tensor) -> None:
    """Masks of draft rows (in row order: a request's rows by growing draft length):
    each matcher consumes the drafts up to its row, then is rolled back to where it
    was. The drafts were checked against the grammar when proposed (`valid_drafts`)."""
    consumed: dict[int, tuple[Request, int]] = {}
    for row, j in rows:
        req = row.request
        done = consumed.get(id(req), (req, 0))[1]
        if not req.grammar.consume_tokens(list(row.drafts[done:])):
            raise AssertionError("a draft the grammar rejects reached verification")
        consumed[id(req)] = (req, len(row.drafts))
        fill_mask(req.grammar, bitmask, j)
    for req, n in consumed.values():
        req.grammar.rollback(n)


def valid_drafts(req: Request, drafts: list[int]) -> list[int]:
    """The leading drafts the request's grammar allows (all of them if unconstrained):
    a draft past a token the grammar rejects could never be accepted."""
    if req.grammar is None or not drafts:
        return drafts
    return drafts[: req.grammar.validate_tokens(drafts)]


_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, ceil(V/32)] int32 bit words -> [R, V] bool (bit j of word w is token 32w + j)."""
    bits = (bitmask[:, :, None] >> _BITS) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def advance(req: Request, token_id: int, consumed: bool = False) -> bool:
    """Feed a sampled token to the sequence's matcher (unless it has it already: a
    forced token); True when the grammar is complete (nothing but the end may
    follow), so the sequence can stop without another step."""
    matcher = req.grammar
    if matcher is None:
        return False
    if not consumed and not matcher.consume_token(token_id):
        # Cannot happen for a masked sample; if it does, stop rather than emit text the
        # grammar does not allow.
        return True
    return bool(matcher.is_stopped())


def forced_tokens(req: Request) -> list[int]:
    """Tokens the grammar allows as the only continuation, already consumed by the
    matcher: the engine appends them without sampling (they cost one prefill chunk,
    not one forward pass each). None for requests that want logprobs, whose every
    token needs the model's own distribution."""
    matcher = req.grammar
    if matcher is None or req.sampling_params.logprobs is not None:
        return []
    tokens = list(matcher.compute_ff_tokens())
    if tokens and not matcher.consume_tokens(tokens):
        return []
    return tokens
