"""The suffix proposer: lossless on the real model, a repeated request drafts from the
store of finished ones, and its parts (the anchor index, the choice of the draft, the
store's LRU bound on memory) alone.

The real-model tests share one engine, so its store fills with the earlier tests'
requests as a server's would: drafts from it must never change the output either.
"""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import Callable

import pytest
from test_speculative import OTHER, REPEATS, assert_all_free, greedy, speculating, token_ids

from sluice import LLM, SamplingParams
from sluice.core.request import Request
from sluice.engine.speculative import SuffixProposer
from sluice.engine.speculative.anchor_index import AnchorIndex, pack, unpack
from sluice.engine.speculative.suffix import (
    MAX_MATCH,
    OWN_ANCHORS,
    Match,
    longest_matches,
    most_likely_path,
)
from sluice.engine.speculative.suffix_store import SuffixStore

STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


@pytest.fixture(scope="module")
def suffix() -> LLM:
    """fp32, suffix drafts, batches of any size speculate (test_speculative's engine)."""
    return speculating("suffix", kv_cache_memory=0.25, max_num_batched_tokens=64)


def proposer_of(llm: LLM) -> SuffixProposer:
    spec = llm.engine.speculator
    assert spec is not None and isinstance(spec.proposer, SuffixProposer)
    return spec.proposer


# ---- lossless on the real model ---------------------------------------------------


def test_greedy_equals_no_speculation(suffix: LLM, plain: Callable[[str, int], list[int]]) -> None:
    """One prompt at a time, then all at once (a batch of decode rows drafting from
    their own text and from the store, which by then holds these very prompts)."""
    before = suffix.stats()
    prompts = [*REPEATS, OTHER]
    for prompt in prompts:
        assert token_ids(suffix, [prompt], greedy(40)) == [[plain(prompt, 40)]]
    alone = suffix.stats()
    assert alone["spec_accepted_tokens"] > before["spec_accepted_tokens"]
    # Several tokens a step: fewer steps (prefills included) than tokens.
    assert alone["num_steps"] - before["num_steps"] < 40 * len(prompts)
    outs = suffix.generate(prompts, greedy(40), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [plain(p, 40) for p in prompts]
    after = suffix.stats()
    # Each request's own counts add up to the engine's.
    for key in ("spec_drafted_tokens", "spec_accepted_tokens"):
        per_request = sum(getattr(o.metrics, key) for o in outs if o.metrics is not None)
        assert per_request == after[key] - alone[key] > 0
    assert_all_free(suffix)


def test_a_repeated_request_drafts_from_the_store(
    suffix: LLM, plain: Callable[[str, int], list[int]]
) -> None:
    """Free text gives the request's own text little to match; the same request again
    finds the first one's prompt and output in the store and drafts it whole."""
    store = proposer_of(suffix).store
    stored = store.num_tokens
    before = suffix.stats()
    (first,) = suffix.generate([STORY], greedy(40), use_tqdm=False)
    assert store.num_tokens > stored  # the finished request went into the store
    (second,) = suffix.generate([STORY], greedy(40), use_tqdm=False)
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == plain(STORY, 40)
    m1, m2 = first.metrics, second.metrics
    assert m1 is not None and m2 is not None
    assert m2.spec_accepted_tokens >= 20
    assert m2.spec_accepted_tokens >= 0.9 * m2.spec_drafted_tokens
    assert m2.spec_accepted_tokens > m1.spec_accepted_tokens
    after = suffix.stats()
    drafted = m1.spec_drafted_tokens + m2.spec_drafted_tokens
    accepted = m1.spec_accepted_tokens + m2.spec_accepted_tokens
    assert after["spec_drafted_tokens"] - before["spec_drafted_tokens"] == drafted
    assert after["spec_accepted_tokens"] - before["spec_accepted_tokens"] == accepted
    assert after["spec_mean_accepted_length"] > 1.0
    assert_all_free(suffix)


def test_seeded_sampling_and_n_equal_no_speculation(suffix: LLM, llm_fp32: LLM) -> None:
    """Seeded draws do not depend on the drafts; both forks of n = 2 go to the store."""
    sp = SamplingParams(temperature=0.8, top_k=20, seed=7, n=2, max_tokens=24)
    (ref,) = llm_fp32.generate([REPEATS[1]], sp, use_tqdm=False)
    (got,) = suffix.generate([REPEATS[1]], sp, use_tqdm=False)
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in ref.outputs]
    assert_all_free(suffix)


# ---- the anchor index ----------------------------------------------------------------


def test_anchor_index_lookup_cap_and_removal() -> None:
    index = AnchorIndex([2, 4], cap=2)
    assert index.lengths == (4, 2)
    seq = [1, 2, 3, 1, 2, 4, 1, 2, 5]
    index.add(seq, 0, len(seq))
    # "1 2" was followed at 2, 5 and 8; the cap keeps the newest two, newest first.
    assert index.lookup([9, 1, 2], 2) == [8, 5]
    assert index.lookup([3, 1, 2, 4], 4) == [6]
    assert index.lookup([7, 7], 2) == [] and index.lookup([2], 2) == []
    other = [1, 2, 6, 6]
    index.add(other, 0, len(other), segment=3)
    assert [unpack(p) for p in index.lookup([1, 2], 2)] == [(3, 2), (0, 8)]
    index.remove(other, 3)
    assert index.lookup([1, 2], 2) == [8]  # the one the cap dropped stays dropped
    index.remove(seq, 0)
    assert index.num_positions == 0 and not any(index.maps.values())
    assert unpack(pack(5, 77)) == (5, 77)


def test_lookups_touch_at_most_cap_candidates_whatever_the_store() -> None:
    """O(match length), not O(corpus): a store full of one anchor still yields at most
    `cap` candidates per anchor length."""
    store = SuffixStore(100_000, [4, 16], cap=16)
    for _ in range(200):
        store.add([5, 6, 7, 8] * 20)
    assert all(len(store.index.lookup([5, 6, 7, 8] * 4, n)) <= 16 for n in (4, 16))


# ---- the choice of the draft -----------------------------------------------------------


def _store(*segments: list[int]) -> SuffixStore:
    store = SuffixStore(10_000, [4, 16], cap=16)
    for seg in segments:
        store.add(seg)
    return store


def test_the_longest_match_wins_over_a_more_frequent_shorter_one() -> None:
    context = [50, 51, 1, 2, 3, 4]
    short = [60, 61, 1, 2, 3, 4, 7, 7]  # matches 4 tokens, three times
    longer = [50, 51, 1, 2, 3, 4, 9, 9]  # matches 6
    store = _store(short, short, short, longer)
    length, matches = longest_matches(context, None, store, MAX_MATCH)
    assert length == 6 and [m.tokens[m.pos] for m in matches] == [9]


def test_the_longest_match_wins_across_own_text_and_store() -> None:
    """The store's 12-token match beats the request's own 9-token one, though the own
    index has an anchor length (8) the store lacks."""
    x = list(range(300, 312))
    context = [9, *x[3:], 66, 8, *x]
    own = AnchorIndex(OWN_ANCHORS, 16)
    own.add(context, 0, len(context))
    store = _store([5, *x, 77])
    length, matches = longest_matches(context, own, store, MAX_MATCH)
    assert length == 12 and [m.tokens[m.pos] for m in matches] == [77]
    assert longest_matches(context, own, _store(), MAX_MATCH)[0] == 9


def test_ties_go_to_the_most_frequent_next_token() -> None:
    context = [1, 2, 3, 4, 5]
    store = _store([1, 2, 3, 4, 5, 7, 8], [1, 2, 3, 4, 5, 7, 9], [1, 2, 3, 4, 5, 6, 6])
    length, matches = longest_matches(context, None, store, MAX_MATCH)
    assert length == 5 and len(matches) == 3
    # 7 twice against 6 once (the newest); then 8 and 9 split (2/3 x 1/2 < 0.4), and
    # on a tie the newest goes first.
    assert most_likely_path(context, matches, 5, min_confidence=0.4)[0] == [7]
    assert most_likely_path(context, matches, 5, min_confidence=0.3)[0] == [7, 9]


def test_draft_length_follows_the_match() -> None:
    proposer = SuffixProposer(10_000)
    text = list(range(100, 140))
    proposer.store.add(text)
    # A 4-token match drafts at most 4; a 20-token match drafts all k.
    assert proposer.draft([1, *text[:4]], None, 10) == text[4:8]
    assert proposer.draft([1, *text[:20]], None, 10) == text[20:30]
    assert proposer.draft([1, *text[:20]], None, 3) == text[20:23]
    assert proposer.draft([1, 2, 3, 4, 5], None, 10) == []


def test_own_text_drafts_like_prompt_lookup_and_continues_periodically() -> None:
    proposer = SuffixProposer(10_000)
    req = Request("r", [7, 8, 9, 7, 8, 9, 7, 8], SamplingParams())
    # The end matches 5 tokens (period 3): drafts read on past the end.
    assert proposer.propose([req], [5]) == [[9, 7, 8, 9, 7]]
    req.append_token(9)
    assert proposer.propose([req], [2]) == [[7, 8]]  # the index was extended
    own = Match(req.all_token_ids, 3, 0)
    assert most_likely_path(req.all_token_ids, [own], 8, 0.3)[0] == [7, 8, 9, 7, 8, 9, 7, 8]


def test_finished_requests_feed_the_store() -> None:
    proposer = SuffixProposer()
    first = Request("a", [11, 12, 13, 14, 15], SamplingParams())
    for tok in (21, 22, 23, 24):
        first.append_token(tok)
    assert proposer.propose([first], [4]) == [[]]
    proposer.finish(first)
    again = Request("b", [11, 12, 13, 14, 15], SamplingParams())
    assert proposer.propose([again], [4]) == [[21, 22, 23, 24]]
    # A fork of n > 1 (index 1) stores only its prompt's tail and its output.
    fork = Request("c", list(range(200, 260)), SamplingParams(), index=1)
    fork.append_token(5)
    proposer.finish(fork)
    assert len(proposer.store.segments[max(proposer.store.segments)]) == MAX_MATCH + 1


# ---- the store's bound -------------------------------------------------------------


def test_eviction_is_lru_by_request_and_bounds_the_tokens() -> None:
    store = SuffixStore(1000, [4, 16], cap=16)
    rng = random.Random(0)
    ids = [store.add([rng.randrange(50_000) for _ in range(100)]) for _ in range(10)]
    assert store.num_tokens == 1000 and store.num_evicted == 0
    store.touch(ids[0])  # used lately: outlives the others
    for _ in range(5):
        store.add([rng.randrange(50_000) for _ in range(100)])
    assert store.num_tokens == 1000 and store.num_evicted == 5
    assert ids[0] in store.segments and all(i not in store.segments for i in ids[1:6])
    # The index holds the live segments' positions only.
    held = {
        unpack(p)[0]
        for m in store.index.maps.values()
        for v in m.values()
        for p in ([v] if isinstance(v, int) else v)
    }
    assert held == set(store.segments)
    assert store.index.num_positions == sum(2 * len(s) - 4 - 16 for s in store.segments.values())
    store.add(list(range(5000)))  # longer than the budget: its last 1000 tokens stay
    assert [list(s) for s in store.segments.values()] == [list(range(4000, 5000))]


def test_memory_stays_bounded_as_traffic_grows() -> None:
    """Memory levels off once the budget is full: after the first rounds of eviction
    (the index's dicts grow their tables once, and keep them) more traffic costs
    nothing more. Random tokens, so every anchor is new: the worst case, under 300
    bytes a token with two anchor lengths."""
    budget = 20_000
    rng = random.Random(1)
    store = SuffixStore(budget, [4, 16], cap=16)

    def fill_and_measure(base: int) -> int:
        for _ in range(budget // 400):
            store.add([rng.randrange(50_000) for _ in range(400)])
        return tracemalloc.get_traced_memory()[0] - base

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        held = [fill_and_measure(base) for _ in range(5)]
    finally:
        tracemalloc.stop()
    assert store.num_tokens == budget and store.num_evicted > 0
    assert max(held) < 300 * budget
    assert max(held[2:]) < 1.02 * held[1]
