"""Verifying draft tokens without changing what the target model would output.

A request verifying k drafts d_0..d_{k-1} gets k + 1 rows of logits: row j is the
target's next-token distribution p_j after the known tokens and d_0..d_{j-1}. The
sampler processes and samples every row as if it were decoded on its own (penalties
and min_tokens see the drafts before it, a seed draws for its output position), giving
t_0..t_k. The output is t_0..t_a, where a is the number of leading drafts equal to
the token sampled for their position (`accepted_length`).

That is rejection sampling for a model-free draft, whose proposal q is one-hot on
d_j: the standard rule accepts d_j with probability min(1, p(d_j) / q(d_j)) = p(d_j)
and otherwise draws from norm(max(p - q, 0)), which is p with d_j removed. Drawing
t_j ~ p_j and accepting iff t_j == d_j does exactly that: P(accept) = p_j(d_j), and a
rejected t_j is p_j conditioned on t_j != d_j. Greedy rows are the special case
t_j = argmax p_j (the longest prefix equal to the target's argmax, plus its next
token). Because each row is sampled with the uniform it would get without
speculation (the sampler's seeded draws depend on the output position only), a
seeded request gives the same tokens with or without drafts.

`rejection_sample` is the general rule, for proposers that have a distribution of
their own (a draft model): accept with min(1, p/q), resample from norm(max(p - q, 0)).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accepted_length(sampled: Sequence[int], drafts: Sequence[int]) -> int:
    """How many leading drafts equal the token sampled at their position. `sampled` has
    one more entry than `drafts` (the row after the last draft); the output is
    sampled[: accepted_length + 1]."""
    assert len(sampled) == len(drafts) + 1
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return a


def rejection_sample(
    p: torch.Tensor,
    q: torch.Tensor,
    drafts: Sequence[int],
    generator: torch.Generator | None = None,
) -> list[int]:
    """Speculative sampling with a proposal distribution (Leviathan et al. 2023).

    p: [k + 1, V] target probabilities (row j after drafts[:j]); q: [k, V] the
    proposal's probabilities that drafts[j] was drawn from. Returns the accepted drafts
    and one more token: a resample from norm(max(p_j - q_j, 0)) at the first rejection,
    or a draw from p_k when every draft is accepted. The output follows p exactly."""
    k = len(drafts)
    assert p.shape[0] == k + 1 and q.shape[0] == k
    u = torch.rand(k + 1, generator=generator, dtype=torch.float64)
    out: list[int] = []
    for j, d in enumerate(drafts):
        pd, qd = float(p[j, d]), float(q[j, d])
        if qd > 0 and u[j] * qd < pd:  # accept with probability min(1, p/q)
            out.append(d)
            continue
        residual = (p[j] - q[j]).clamp(min=0)
        if float(residual.sum()) <= 0:  # p == q: a rejection has probability 0
            residual = p[j]
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[k], 1, generator=generator)))
    return out
