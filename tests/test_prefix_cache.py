"""Automatic prefix caching on the real model: same outputs, exact hit counts, LRU."""

from __future__ import annotations

import pytest

from sluice import LLM, SamplingParams
from sluice.core.request import Request
from sluice.engine.kv_cache import CacheHit

SYSTEM = (
    "You are a careful assistant. Answer briefly and precisely. Think about units, "
    "check arithmetic twice, and say when you are unsure. " * 4
)
QUESTIONS = [
    "What is 7 times 8?",
    "Name a prime number.",
    "Spell 'cat' backwards.",
    "What colour is the sky?",
    "How many legs has a spider?",
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)


def prompts(llm: LLM) -> list[list[int]]:
    # Shared system prompt of several blocks, then distinct questions; plus a prompt that
    # shares only part of a block and one that is a strict prefix of another.
    tok = llm.tokenizer
    base = tok.encode(SYSTEM)
    out = [base + tok.encode(" Q: " + q) for q in QUESTIONS]
    out.append(base[:37] + tok.encode(" unrelated ending"))
    out.append(base[:40])
    return out


@pytest.fixture(scope="module")
def reference(llm_fp32: LLM) -> list[list[int]]:
    llm_fp32.engine.reset_prefix_cache()
    llm_fp32.engine.kv.enable_prefix_caching = False
    try:
        outs = llm_fp32.generate(prompts(llm_fp32), GREEDY, use_tqdm=False)
    finally:
        llm_fp32.engine.kv.enable_prefix_caching = True
    return [o.outputs[0].token_ids for o in outs]


def test_outputs_identical_with_cache_and_hits_are_exact(
    llm_fp32: LLM, reference: list[list[int]]
) -> None:
    eng = llm_fp32.engine
    eng.reset_prefix_cache()
    ps = prompts(llm_fp32)
    bs = eng.config.block_size
    # One at a time, so each request sees what the earlier ones left in the cache.
    first = llm_fp32.generate([ps[0]], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    shared = len(llm_fp32.tokenizer.encode(SYSTEM))
    for i, p in enumerate(ps[1:5], start=1):
        out = llm_fp32.generate([p], GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == reference[i]
        # Exactly the full blocks of the shared prefix (the question starts right after).
        common = next(j for j, (a, b) in enumerate(zip(p, ps[0], strict=False)) if a != b)
        assert common >= shared - 1
        assert out.num_cached_tokens == (common // bs) * bs
    partial = llm_fp32.generate([ps[5]], GREEDY, use_tqdm=False)[0]
    assert partial.num_cached_tokens == (37 // bs) * bs
    assert partial.outputs[0].token_ids == reference[5]
    # Fully cached prompt: its last token is still computed to get logits.
    again = llm_fp32.generate([ps[0]], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == ((len(ps[0]) - 1) // bs) * bs
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    stats = eng.stats()
    assert 0 < stats["prefix_cache_hit_rate"] < 1
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]


def test_batched_requests_share_blocks_in_one_step(
    llm_fp32: LLM, reference: list[list[int]]
) -> None:
    llm_fp32.engine.reset_prefix_cache()
    outs = llm_fp32.generate(prompts(llm_fp32), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    # Admitted in the same step as the first one, later requests still hit its blocks.
    assert all(o.num_cached_tokens > 0 for o in outs[1:5])


def test_same_outputs_under_eviction_pressure(reference: list[list[int]]) -> None:
    per_block = 30 * 2 * 16 * 3 * 64 * 4
    llm = LLM(dtype="float32", kv_cache_memory=14 * per_block / 2**30)
    ps = prompts(llm)
    for _ in range(2):
        outs = llm.generate(ps, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
    stats = llm.stats()
    assert llm.engine.kv.pool.num_evictions > 0
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]
    # Clearing the cache drops every cached block; the pool is entirely free.
    llm.engine.reset_prefix_cache()
    assert not llm.engine.kv.pool.cached
    assert all(h is None for h in llm.engine.kv.pool.block_hash)


def test_prompt_logprobs_bypass_the_cache(llm_fp32: LLM) -> None:
    ps = prompts(llm_fp32)
    llm_fp32.generate([ps[0]], GREEDY, use_tqdm=False)
    sp = GREEDY.clone(prompt_logprobs=1)
    out = llm_fp32.generate([ps[0]], sp, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ps[0])


def test_preempted_requests_reuse_their_own_blocks(
    llm_fp32: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    sp = SamplingParams(temperature=0, max_tokens=40, min_tokens=40)
    ps = prompts(llm_fp32)[:4]
    llm_fp32.engine.kv.enable_prefix_caching = False
    try:  # the same requests with neither the cache nor preemption
        expected = [o.outputs[0].token_ids for o in llm_fp32.generate(ps, sp, use_tqdm=False)]
    finally:
        llm_fp32.engine.kv.enable_prefix_caching = True

    per_block = 30 * 2 * 16 * 3 * 64 * 4
    llm = LLM(dtype="float32", kv_cache_memory=10 * per_block / 2**30)
    # Record the prefix hits of requests coming back after a preemption.
    kv = llm.engine.kv
    lookup = kv.find_cached_prefix
    rehits: list[int] = []

    def find_cached_prefix(request: Request) -> CacheHit:
        hit = lookup(request)
        if request.num_preemptions:
            rehits.append(hit.num_tokens)
        return hit

    monkeypatch.setattr(kv, "find_cached_prefix", find_cached_prefix)
    outs = llm.generate(ps, sp, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    # A preempted request's blocks stay cached after it is freed: it recomputes less.
    assert rehits and max(rehits) > 0
    assert llm.stats()["kv_free_blocks"] == llm.stats()["kv_total_blocks"]
