"""Batched sampling: logit bias, min_tokens, penalties, temperature, top-k/top-p/min-p,
per-request seeds and logprobs, in a handful of tensor ops per step.

Sampling is by inverse CDF with one uniform draw per row, exact for p. A seeded
request draws its uniform from a generator keyed by (seed, output position), so its
text depends only on its own logits, never on what else is batched with it or on
whether it was preempted and recomputed. (An exponential race, argmax p / E, needs a
random number per vocabulary entry: 63 ms a step for 64 rows here, against ~3 ms.)

A row is a request, or one position of a request verifying draft tokens (a
`DraftRow`: the request as it would be after the drafts before that position), so
every verified position is processed and drawn as a one-token decode would be
(sluice/runner/spec_verify.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sluice.core.request import SamplingRow
from sluice.core.sampling_params import SamplingParams

_GREEDY_EPS = 1e-5
# Candidates that top-k/top-p look at before falling back to sorting a whole row.
_CANDIDATES = 512


# Logprob of the sampled token, its rank, top-N (ids, logprobs).
TokenLogprobs = tuple[float, int, list[int], list[float]]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row, None unless the request asked for logprobs.
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __init__(self, vocab_size: int, seed: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        requests: Sequence[SamplingRow],
        stop_ids: list[list[int]],
        allowed: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> SamplerOutput:
        """logits: [S, V] fp32, one row per request. stop_ids[i]: tokens that would end
        request i (blocked while it is below min_tokens). allowed: (row indices, bool
        [rows, V]) the tokens a constrained row's grammar allows; applied after bias and
        penalties, before temperature and top-k/top-p, so those renormalize over what the
        grammar allows. Logprobs stay the model's own (before any of this)."""
        params = [r.sampling_params for r in requests]
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        logits = self._edit_logits(logits, requests, params, stop_ids, allowed)
        token_list = self._next_tokens(logits, requests, params).tolist()
        if raw_logprobs is None:
            return SamplerOutput(token_list, [None] * len(token_list))
        return SamplerOutput(token_list, _logprobs(raw_logprobs, params, token_list))

    def _edit_logits(
        self,
        logits: torch.Tensor,
        requests: Sequence[SamplingRow],
        params: list[SamplingParams],
        stop_ids: list[list[int]],
        allowed: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """logits after logit bias, min_tokens, penalties and the grammar's mask, in that
        order. These edit in place: on a copy, made only when one applies (a [rows, vocab]
        copy per step is not free at large batches)."""
        if allowed is not None or any(
            p.logit_bias or _below_min_tokens(r, p) or _has_penalty(p)
            for r, p in zip(requests, params, strict=True)
        ):
            logits = logits.clone()
        _bias_and_block_stops(logits, requests, params, stop_ids)
        if any(_has_penalty(p) for p in params):
            self._apply_penalties(logits, requests)
        if allowed is not None:
            rows, mask = allowed
            rows = rows.to(logits.device)
            logits[rows] = logits[rows].masked_fill(~mask.to(logits.device), float("-inf"))
        return logits

    def _next_tokens(
        self, logits: torch.Tensor, requests: Sequence[SamplingRow], params: list[SamplingParams]
    ) -> torch.Tensor:
        """One token per row: argmax where the temperature is ~0, else sampled."""
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        greedy = temps < _GREEDY_EPS
        if bool(greedy.all()):
            return logits.argmax(dim=-1)
        if not bool(greedy.any()):
            return self._sample(logits, requests, temps)
        # Mixed: each kind of row through its own path only.
        tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        g, ng = greedy.nonzero().flatten(), (~greedy).nonzero().flatten()
        tokens[g.to(logits.device)] = logits[g.to(logits.device)].argmax(dim=-1)
        sampled = [requests[i] for i in ng.tolist()]
        tokens[ng.to(logits.device)] = self._sample(
            logits[ng.to(logits.device)], sampled, temps[ng]
        )
        return tokens

    def _sample(
        self, logits: torch.Tensor, requests: Sequence[SamplingRow], temps: torch.Tensor
    ) -> torch.Tensor:
        params = [r.sampling_params for r in requests]
        dev = logits.device
        s, v = logits.shape
        logits = logits / temps.clamp(min=_GREEDY_EPS).to(dev)[:, None]
        top_k = torch.tensor([min(p.top_k or v, v) for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
        u = self._uniforms(requests).to(dev)
        filtered = (top_k < v) | (top_p < 1.0)
        if not bool(filtered.any()):  # the common case: no index copies
            return _inverse_cdf(_min_p(logits.softmax(dim=-1), min_p), u)

        tokens = torch.empty(s, dtype=torch.long, device=dev)
        rows = (~filtered).nonzero().flatten()
        if rows.numel():  # the whole vocabulary
            probs = _min_p(logits[rows].softmax(dim=-1), min_p[rows])
            tokens[rows] = _inverse_cdf(probs, u[rows])

        rows = filtered.nonzero().flatten()
        if rows.numel():
            # top-k/top-p on the best candidates only: topk is ~10x cheaper than sorting
            # the vocabulary on CPU. A row whose nucleus may reach past the candidates
            # is redone on a full sort.
            k_rows = top_k[rows]
            limited = k_rows[k_rows < v]
            k0 = int(limited.max()) if limited.numel() else 0
            if limited.numel() < rows.numel():  # some rows have top-p only
                k0 = max(k0, _CANDIDATES)
            k0 = min(k0, v)
            row_logits = logits[rows]
            vals, ids = row_logits.topk(k0, dim=-1)
            vals, covered = _top_k_top_p(vals, ids, row_logits, k_rows, top_p[rows])
            if not bool(covered.all()):
                redo = rows[~covered]
                full, full_ids = logits[redo].sort(dim=-1, descending=True)
                full, _ = _top_k_top_p(full, full_ids, logits[redo], top_k[redo], top_p[redo])
                pick = _inverse_cdf(_min_p(full.softmax(dim=-1), min_p[redo]), u[redo])
                tokens[redo] = full_ids.gather(-1, pick[:, None]).squeeze(-1)
                vals, ids, rows = vals[covered], ids[covered], rows[covered]
            if rows.numel():
                probs = _min_p(vals.softmax(dim=-1), min_p[rows])
                pick = _inverse_cdf(probs, u[rows])
                tokens[rows] = ids.gather(-1, pick[:, None]).squeeze(-1)
        return tokens

    def _uniforms(self, requests: Sequence[SamplingRow]) -> torch.Tensor:
        """One U[0, 1) per row: from (seed, output position) for seeded requests, so a
        seeded row never depends on its neighbours; from the sampler's stream otherwise."""
        u = torch.rand(len(requests), generator=self.generator)
        for i, r in enumerate(requests):
            if r.seed is not None:
                g = torch.Generator()
                g.manual_seed(hash((r.seed, r.num_output_tokens)) & 0x7FFF_FFFF_FFFF_FFFF)
                u[i] = torch.rand(1, generator=g)[0]
        return u

    def _apply_penalties(self, logits: torch.Tensor, requests: Sequence[SamplingRow]) -> None:
        s, v = logits.shape
        dev = logits.device
        counts = torch.zeros(s, v, device=dev)
        in_prompt = torch.zeros(s, v, dtype=torch.bool, device=dev)
        for i, r in enumerate(requests):
            if not _has_penalty(r.sampling_params):
                continue
            out_ids = r.output_token_ids
            if out_ids:
                counts[i].index_add_(
                    0, torch.tensor(out_ids, device=dev), torch.ones(len(out_ids), device=dev)
                )
            if r.sampling_params.repetition_penalty != 1.0:
                in_prompt[i, torch.tensor(r.prompt_token_ids, device=dev)] = True
        rep = torch.tensor([r.sampling_params.repetition_penalty for r in requests], device=dev)
        freq = torch.tensor([r.sampling_params.frequency_penalty for r in requests], device=dev)
        pres = torch.tensor([r.sampling_params.presence_penalty for r in requests], device=dev)
        seen = in_prompt | (counts > 0)
        rep = rep[:, None].expand(s, v)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, penalised, logits))
        logits -= freq[:, None] * counts + pres[:, None] * (counts > 0).float()


def _below_min_tokens(r: SamplingRow, p: SamplingParams) -> bool:
    return bool(p.min_tokens and r.num_output_tokens < p.min_tokens)


def _bias_and_block_stops(
    logits: torch.Tensor,
    requests: Sequence[SamplingRow],
    params: list[SamplingParams],
    stop_ids: list[list[int]],
) -> None:
    """Add each row's logit bias; mask its stop tokens while it is below min_tokens."""
    for i, (r, p) in enumerate(zip(requests, params, strict=True)):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
            vals = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
            logits[i, ids] += vals.to(logits.device)
        # A grammar that is complete may allow nothing but the end: it wins over
        # min_tokens (the masked row would otherwise have nothing left to sample).
        if _below_min_tokens(r, p) and stop_ids[i] and r.grammar is None:
            logits[i, torch.tensor(stop_ids[i], device=logits.device)] = float("-inf")


def _logprobs(
    raw_logprobs: torch.Tensor, params: list[SamplingParams], token_list: list[int]
) -> list[TokenLogprobs | None]:
    """Per row, for the rows that asked: the sampled token's logprob and rank, and the
    top-N, all from the model's own logprobs."""
    out: list[TokenLogprobs | None] = [None] * len(token_list)
    for i, p in enumerate(params):
        if p.logprobs is None:
            continue
        row = raw_logprobs[i]
        lp = row[token_list[i]]
        rank = int((row > lp).sum().item()) + 1
        top_ids: list[int] = []
        top_vals: list[float] = []
        if p.logprobs > 0:
            vals, ids = row.topk(p.logprobs)
            top_ids, top_vals = ids.tolist(), vals.tolist()
        out[i] = (float(lp.item()), rank, top_ids, top_vals)
    return out


def _top_k_top_p(
    sorted_logits: torch.Tensor,
    sorted_ids: torch.Tensor,
    row_logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask the leading, descending-sorted logits of each row (the first K of its V)
    to its top-k, then to the smallest prefix whose mass (renormalized after top-k, as
    a full sort would) reaches top-p. Also: which rows' answer is exact, i.e. whose
    kept set cannot extend past the K given."""
    k0, v = sorted_logits.shape[-1], row_logits.shape[-1]
    ranks = torch.arange(k0, device=sorted_logits.device)
    masked = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    # Renormalized over the kept top-k where top-k applies (all inside the K), else
    # over the whole row.
    probs = masked.softmax(dim=-1)
    whole = top_k >= v
    if bool(whole.any()):
        probs[whole] = row_logits[whole].softmax(dim=-1).gather(-1, sorted_ids[whole])
    mass = probs.cumsum(dim=-1)
    drop = (mass - probs) >= top_p[:, None]  # always keeps the first token
    covered = (top_k <= k0) | (k0 == v) | (mass[:, -1] >= top_p)
    return masked.masked_fill(drop, float("-inf")), covered


def _min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    if not bool((min_p > 0).any()):
        return probs
    keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return probs * keep


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of (unnormalized) probs, given U[0, 1) per row: the
    first whose cumulative mass exceeds u * total, so a zero-mass entry is never drawn."""
    cdf = probs.float().cumsum(dim=-1)
    total = cdf[:, -1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    pick = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
    return pick.clamp(max=probs.shape[-1] - 1)


def _has_penalty(p: object) -> bool:
    return (
        getattr(p, "repetition_penalty", 1.0) != 1.0
        or getattr(p, "presence_penalty", 0.0) != 0.0
        or getattr(p, "frequency_penalty", 0.0) != 0.0
    )
