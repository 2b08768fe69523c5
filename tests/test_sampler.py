"""Sampler units on hand-made logits: penalties, filters, min_tokens, seeds."""

from __future__ import annotations

import torch

from sluice.core.request import Request
from sluice.runner.sampler import Sampler
from sluice.sampling_params import SamplingParams

V = 8


def request(
    params: SamplingParams, prompt: list[int], output: list[int], seed: int | None = None
) -> Request:
    r = Request("r", prompt, params, seed=seed)
    for t in output:
        r.append_token(t)
    return r


def sample(logits: list[float], req: Request, stop: list[int] | None = None) -> int:
    sampler = Sampler(V, seed=0, device=torch.device("cpu"))
    return sampler(torch.tensor([logits]), [req], [stop or []]).token_ids[0]


def test_presence_penalty_counts_output_tokens_once() -> None:
    logits = [0.0, 3.0, 2.0, 0, 0, 0, 0, 0]
    greedy = SamplingParams(temperature=0)
    assert sample(logits, request(greedy, [2], [1])) == 1
    # Token 1 was generated: 3.0 - 1.5 < 2.0. Prompt tokens are not penalised.
    assert sample(logits, request(greedy.clone(presence_penalty=1.5), [2], [1, 1, 1])) == 2
    assert sample(logits, request(greedy.clone(presence_penalty=0.5), [2], [1, 1, 1])) == 1


def test_frequency_penalty_scales_with_count() -> None:
    logits = [0.0, 3.0, 2.0, 0, 0, 0, 0, 0]
    sp = SamplingParams(temperature=0, frequency_penalty=0.6)
    assert sample(logits, request(sp, [], [1])) == 1  # 3.0 - 0.6 > 2.0
    assert sample(logits, request(sp, [], [1, 1])) == 2  # 3.0 - 1.2 < 2.0


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    sp = SamplingParams(temperature=0, repetition_penalty=2.0)
    # Prompt token 1 (logit 3 -> 1.5) falls below token 2 (2.0).
    assert sample([0.0, 3.0, 2.0, 0, 0, 0, 0, 0], request(sp, [1], [])) == 2
    # A negative logit gets more negative: token 0 (-0.5 -> -1.0) loses to token 3 (-0.8).
    assert sample([-0.5, -9, -9, -0.8, -9, -9, -9, -9], request(sp, [0], [])) == 3


def test_min_tokens_blocks_stop_tokens() -> None:
    sp = SamplingParams(temperature=0, min_tokens=2)
    logits = [0.0, 5.0, 4.0, 0, 0, 0, 0, 0]
    assert sample(logits, request(sp, [3], [4]), stop=[1]) == 2
    assert sample(logits, request(sp, [3], [4, 4]), stop=[1]) == 1


def test_top_k_top_p_min_p_restrict_the_support() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05, 1e-9, 1e-9, 1e-9, 1e-9])).tolist()
    for params, allowed in [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.7), {0, 1}),
        (SamplingParams(min_p=0.35), {0, 1}),
        (SamplingParams(top_p=0.5), {0}),
    ]:
        seen = {sample(logits, request(params.clone(seed=s), [0], [], seed=s)) for s in range(200)}
        assert seen == allowed, params


def test_seeded_rows_do_not_depend_on_neighbours() -> None:
    # A wide uniform vocabulary and several seeds: with broken seeding a match is a
    # 1-in-50,000 chance each (an 8-token one passed one time in eight).
    vocab = 50_000
    sampler = Sampler(vocab, seed=0, device=torch.device("cpu"))
    sp = SamplingParams(temperature=1.0)
    logits = torch.zeros(3, vocab)
    for seed in (1, 42, 2**40):
        a = request(sp, [0], [], seed=seed)
        alone = sampler(logits[:1], [a], [[]]).token_ids[0]
        a = request(sp, [0], [], seed=seed)
        together = sampler(logits, [request(sp, [0], []), a, request(sp, [1], [])], [[]] * 3)
        assert together.token_ids[1] == alone, seed


def frequencies(
    vocab: int, logits: torch.Tensor, params: SamplingParams, draws: int
) -> torch.Tensor:
    """How often each token is drawn from `draws` identical rows (unseeded)."""
    sampler = Sampler(vocab, seed=0, device=torch.device("cpu"))
    reqs = [request(params, [0], []) for _ in range(draws)]
    out = sampler(logits.expand(draws, vocab), reqs, [[]] * draws).token_ids
    return torch.bincount(torch.tensor(out), minlength=vocab).float() / draws


def test_sampling_follows_the_filtered_distribution() -> None:
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = probs.log()
    # Temperature 1 without filters: the distribution itself (4 sigma ~ 0.02 here).
    freq = frequencies(6, logits, SamplingParams(temperature=1.0), 8000)
    assert torch.allclose(freq, probs, atol=0.025), freq
    # top_k=3 renormalizes over the three best; top_p=0.7 keeps the smallest prefix
    # reaching 0.7 (0.4 + 0.25 + 0.15); temperature 0.5 squares the ratios.
    kept = probs[:3] / probs[:3].sum()
    for params, expected in [
        (SamplingParams(temperature=1.0, top_k=3), kept),
        (SamplingParams(temperature=1.0, top_p=0.7), kept),
        (SamplingParams(temperature=0.5), probs**2 / (probs**2).sum()),
    ]:
        freq = frequencies(6, logits, params, 8000)
        assert torch.allclose(freq[:3], expected[:3], atol=0.025), (params, freq)
        if params.top_k or params.top_p < 1:
            assert freq[3:].sum() == 0, params


def test_top_p_nucleus_beyond_the_candidates_is_not_truncated() -> None:
    # A nearly flat distribution over 4096 tokens: top_p=0.9 keeps ~3,700 of them, far more
    # than the candidates top-p looks at first, so those rows take the full sort.
    vocab = 4096
    logits = -torch.arange(vocab) * 1e-4  # strictly decreasing: the nucleus is a prefix
    freq = frequencies(vocab, logits, SamplingParams(temperature=1.0, top_p=0.9), 4000)
    drawn = freq.nonzero().flatten()
    assert int(drawn.max()) > 2048  # tokens far past the first candidates are drawn
    p = logits.softmax(dim=-1)
    nucleus = int(((p.cumsum(dim=-1) - p) < 0.9).sum())
    assert int(drawn.max()) < nucleus
