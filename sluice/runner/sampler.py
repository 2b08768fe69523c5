"""Batched sampling: logit bias, min_tokens, penalties, temperature, top-k/top-p/min-p,
per-request seeds and logprobs, in a handful of tensor ops per step.

Randomness uses the exponential race (argmax of p / E with E ~ Exp(1)), which samples
exactly from p. A seeded request draws its E from a generator keyed by (seed, output
position), so its text depends only on its own logits, never on what else is batched
with it or on whether it was preempted and recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.engine.request import Request

_GREEDY_EPS = 1e-5


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row, None unless the request asked for logprobs: (logprob of the sampled
    # token, its rank, top-N (ids, logprobs)).
    logprobs: list[tuple[float, int, list[int], list[float]] | None]


class Sampler:
    def __init__(self, vocab_size: int, seed: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, requests: list[Request], stop_ids: list[list[int]]
    ) -> SamplerOutput:
        """logits: [S, V] fp32, one row per request. stop_ids[i]: tokens that would end
        request i (blocked while it is below min_tokens)."""
        s = logits.shape[0]
        params = [r.sampling_params for r in requests]
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        # Bias, min_tokens and penalties edit logits in place: copy only when one applies
        # (a [rows, vocab] copy per step is not free at large batches).
        if any(
            p.logit_bias or (p.min_tokens and r.num_output_tokens < p.min_tokens) or _has_penalty(p)
            for r, p in zip(requests, params, strict=True)
        ):
            logits = logits.clone()

        for i, (r, p) in enumerate(zip(requests, params, strict=True)):
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
                vals = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
                logits[i, ids] += vals.to(logits.device)
            if p.min_tokens and r.num_output_tokens < p.min_tokens and stop_ids[i]:
                logits[i, torch.tensor(stop_ids[i], device=logits.device)] = float("-inf")

        if any(_has_penalty(p) for p in params):
            self._apply_penalties(logits, requests)

        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        greedy = temps < _GREEDY_EPS
        tokens = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            tokens = torch.where(
                greedy.to(logits.device), tokens, self._sample(logits, requests, temps)
            )

        token_list = tokens.tolist()
        out: list[tuple[float, int, list[int], list[float]] | None] = [None] * s
        if raw_logprobs is not None:
            for i, p in enumerate(params):
                if p.logprobs is None:
                    continue
                row = raw_logprobs[i]
                tok = token_list[i]
                lp = row[tok]
                rank = int((row > lp).sum().item()) + 1
                top_ids: list[int] = []
                top_vals: list[float] = []
                if p.logprobs > 0:
                    vals, ids = row.topk(p.logprobs)
                    top_ids, top_vals = ids.tolist(), vals.tolist()
                out[i] = (float(lp.item()), rank, top_ids, top_vals)
        return SamplerOutput(token_list, out)

    def _sample(
        self, logits: torch.Tensor, requests: list[Request], temps: torch.Tensor
    ) -> torch.Tensor:
        params = [r.sampling_params for r in requests]
        dev = logits.device
        logits = logits / temps.clamp(min=_GREEDY_EPS).to(dev)[:, None]
        top_k = torch.tensor([p.top_k or self.vocab_size for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        if bool((top_k < self.vocab_size).any()) or bool((top_p < 1.0).any()):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(logits.shape[-1], device=dev)
            drop = ranks[None, :] >= top_k[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            probs = sorted_logits.softmax(dim=-1)
            # Keep the smallest set whose mass reaches top_p (always at least one token).
            drop = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
        if bool((min_p > 0).any()):
            keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs * keep
        race = torch.empty_like(probs)
        for i, r in enumerate(requests):
            if r.seed is not None:
                g = torch.Generator(device=dev)
                g.manual_seed(hash((r.seed, r.num_output_tokens)) & 0x7FFF_FFFF_FFFF_FFFF)
                race[i].exponential_(generator=g)
            else:
                race[i].exponential_(generator=self.generator)
        return (probs / race).argmax(dim=-1)

    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request]) -> None:
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


def _has_penalty(p: object) -> bool:
    return (
        getattr(p, "repetition_penalty", 1.0) != 1.0
        or getattr(p, "presence_penalty", 0.0) != 0.0
        or getattr(p, "frequency_penalty", 0.0) != 0.0
    )
