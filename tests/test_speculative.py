"""Speculative decoding: lossless on the real model, and its parts alone.

On the bundled model in fp32, greedy output with n-gram drafts is the same, token for
token, as without (alone, in a mixed batch with chunked prefills, under preemption,
with prefix-cache hits), and so is seeded sampled output: the verifier samples every
draft position with the uniform it would have had without speculation. The prompts
repeat text so that drafts exist and some are accepted (checked). Then the parts: the
acceptance rule against a known distribution, the KV rollback, the scheduler's grant,
the n-gram index and the cost model.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

from sluice import LLM, SamplingParams
from sluice.cli import build_parser, engine_config
from sluice.config import EngineConfig
from sluice.core.errors import ConfigError
from sluice.core.request import DraftRow, Request
from sluice.engine.kv_cache import KVCacheManager
from sluice.engine.prefix_cache import extend_block_hashes
from sluice.engine.scheduler import Scheduler
from sluice.engine.speculative import (
    NgramProposer,
    Speculator,
    StepCosts,
    best_num_drafts,
    plan_drafts,
)
from sluice.engine.speculative.ngram import NgramIndex
from sluice.runner.sampler import Sampler
from sluice.runner.spec_verify import accepted_length, rejection_sample

# Text the model copies (so drafts get accepted), and text it does not.
REPEATS = [
    "apple, banana, cherry, grape, lemon, mango, orange, peach, pear, plum. " * 3
    + "apple, banana,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n" * 2 + "def add(a,",
    "One two three four five six seven eight nine ten. " * 3 + "One two",
]
OTHER = "The capital of France is"
PER_BLOCK = 30 * 2 * 16 * 3 * 64 * 4  # bytes of one fp32 KV block of the bundled model


def greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, **kw)


def speculating(method: str = "ngram", **options: Any) -> LLM:
    """An fp32 engine with `method`'s drafts whose batches of any size speculate: these
    tests are about the seam, which must hold for any batch, not about the cost model
    (whose measured table may let only a single decode row speculate)."""
    llm = LLM(
        dtype="float32",
        speculative_method=method,
        num_speculative_tokens=4,
        speculative_draft_cost=0.05,
        **options,
    )
    assert llm.engine.speculator is not None
    return llm


@pytest.fixture(scope="module")
def spec() -> LLM:
    return speculating(kv_cache_memory=0.25, max_num_batched_tokens=64)


def token_ids(llm: LLM, prompts: list[str], params: SamplingParams | list[SamplingParams]) -> list:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_all_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_requests"] == stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]


# ---- lossless on the real model ---------------------------------------------------


def test_greedy_equals_no_speculation_alone(
    spec: LLM, plain: Callable[[str, int], list[int]]
) -> None:
    before = spec.stats()
    generated = 0
    for prompt in [*REPEATS, OTHER]:
        got = token_ids(spec, [prompt], greedy(40))
        assert got == [[plain(prompt, 40)]]
        generated += len(got[0][0])
    after = spec.stats()
    assert after["spec_accepted_tokens"] > before["spec_accepted_tokens"]
    # Several tokens a step: fewer steps (prefills included) than tokens.
    assert after["num_steps"] - before["num_steps"] < generated
    assert_all_free(spec)


def test_greedy_mixed_batch_with_chunked_prefill(
    spec: LLM,
    llm_fp32: LLM,
    plain: Callable[[str, int], list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Verifying rows share steps with another request's prefill chunk (64-token steps;
    drafts get only the budget the chunk leaves)."""
    eng = spec.engine
    long_prompt = REPEATS[1] * 3  # ~150 tokens: three chunks
    penalised = greedy(30, repetition_penalty=1.1)
    expected = {
        "a": plain(REPEATS[0], 30),
        "b": token_ids(llm_fp32, [long_prompt], greedy(20))[0][0],
        "c": token_ids(llm_fp32, [REPEATS[2]], penalised)[0][0],
    }
    mixed: list[bool] = []
    execute = eng.runner.execute

    def recording(scheduled: list[tuple[Request, int]]) -> Any:
        verifying = any(r.spec_token_ids for r, _ in scheduled)
        mixed.append(
            verifying and any(r.num_computed_tokens < r.num_prompt_tokens - 1 for r, _ in scheduled)
        )
        return execute(scheduled)

    monkeypatch.setattr(eng.runner, "execute", recording)
    accepted = spec.stats()["spec_accepted_tokens"]
    eng.add_request("a", REPEATS[0], greedy(30))
    eng.add_request("c", REPEATS[2], penalised)
    got: dict[str, list[int]] = {}
    for step in range(200):
        if step == 4:
            eng.add_request("b", long_prompt, greedy(20))
        for out in eng.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
        if not eng.has_unfinished_requests():
            break
    assert got == expected
    assert any(mixed)
    assert spec.stats()["spec_accepted_tokens"] > accepted
    assert_all_free(spec)


FRUIT = "(apple|banana|cherry|grape|lemon|mango|orange|peach|pear|plum)"


def test_constrained_drafts_stay_inside_the_grammar(spec: LLM, llm_fp32: LLM) -> None:
    """A regex-constrained request that copies its prompt drafts, its drafts are cut
    where the grammar would reject them, each draft row is masked by the grammar after
    the drafts before it, and the output equals the constrained output without
    speculation; the matcher ends where the kept tokens put it."""
    pattern = f" {FRUIT}(, {FRUIT}){{0,8}}"  # done in ~27 tokens, before max_tokens
    params = greedy(40, structured_output={"regex": pattern})
    (expected,) = llm_fp32.generate([REPEATS[0]], params, use_tqdm=False)
    before = spec.stats()
    (got,) = spec.generate([REPEATS[0]], params, use_tqdm=False)
    after = spec.stats()
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert got.outputs[0].finish_reason == "stop" and re.fullmatch(pattern, got.outputs[0].text)
    assert after["spec_accepted_tokens"] - before["spec_accepted_tokens"] >= 5
    assert_all_free(spec)


def test_preemption_with_a_tiny_cache(plain: Callable[[str, int], list[int]]) -> None:
    small = speculating(kv_cache_memory=10 * PER_BLOCK / 2**30, max_num_batched_tokens=64)
    prompts = REPEATS  # ~40-50 tokens each + 40 out: three do not fit in 10 blocks
    assert token_ids(small, prompts, greedy(40)) == [[plain(p, 40)] for p in prompts]
    stats = small.stats()
    assert stats["num_preemptions"] > 0
    assert stats["spec_accepted_tokens"] > 0
    assert_all_free(small)


def test_prefix_cache_hits_and_no_draft_is_ever_named(
    spec: LLM, plain: Callable[[str, int], list[int]]
) -> None:
    eng = spec.engine
    eng.reset_prefix_cache()
    expected = [[plain(REPEATS[0], 40)]]
    first = token_ids(spec, [REPEATS[0]], greedy(40))
    (again,) = spec.generate([REPEATS[0]], greedy(40), use_tqdm=False)
    assert first == expected == [[again.outputs[0].token_ids]]
    assert again.num_cached_tokens > 0
    # Every named block holds tokens of the sequence (its hash chain), never drafts.
    seq = spec.tokenizer.encode(REPEATS[0]) + expected[0][0]
    valid = set(extend_block_hashes([], seq, len(seq), eng.config.block_size))
    pool = eng.kv.pool
    named = {h for h in pool.block_hash if h is not None}
    assert named and named <= valid
    assert all(pool.cached[h] == b for b, h in enumerate(pool.block_hash) if h is not None)
    assert_all_free(spec)


def test_seeded_sampling_equals_no_speculation(spec: LLM, llm_fp32: LLM) -> None:
    """Each draft position is sampled with the draw it would have had without drafts;
    penalties and logprobs see the drafts before it; n = 2 forks after the prompt.
    top_k: see test_n_with_prefix_cache_and_preemption on full-vocabulary draws."""
    sp = SamplingParams(
        temperature=0.7, top_k=20, seed=5, n=2, max_tokens=32, logprobs=2, presence_penalty=0.2
    )
    before = spec.stats()["spec_accepted_tokens"]
    (ref,) = llm_fp32.generate([REPEATS[2]], sp, use_tqdm=False)
    (got,) = spec.generate([REPEATS[2]], sp, use_tqdm=False)
    assert spec.stats()["spec_accepted_tokens"] > before
    for r, g in zip(ref.outputs, got.outputs, strict=True):
        assert g.token_ids == r.token_ids and g.text == r.text
        assert r.logprobs is not None and g.logprobs is not None
        assert [list(e) for e in g.logprobs] == [list(e) for e in r.logprobs]
        for ge, rl in zip(g.logprobs, r.logprobs, strict=True):
            for tok, lp in rl.items():
                assert ge[tok].logprob == pytest.approx(lp.logprob, abs=1e-4)
                assert ge[tok].rank == lp.rank
    assert_all_free(spec)


def _record_emits(monkeypatch: pytest.MonkeyPatch, llm: LLM) -> list[tuple[int, int]]:
    """(tokens offered, tokens appended) of each of the engine's appends of a sampled run."""
    eng = llm.engine
    seen: list[tuple[int, int]] = []
    emit = eng._emit

    def recording(req: Request, tokens: list[int], *args: Any) -> int:
        n = emit(req, tokens, *args)
        seen.append((len(tokens), n))
        return n

    monkeypatch.setattr(eng, "_emit", recording)
    return seen


def test_stop_string_inside_an_accepted_run(
    spec: LLM, llm_fp32: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stop at words of the list the model keeps copying; at least one of them
    completes before the end of a step's accepted run."""
    prompt = REPEATS[0]
    seen = _record_emits(monkeypatch, spec)
    inside = 0
    for stop in ("peach", "pear", "orange", "mango", "lemon"):
        (ref,) = llm_fp32.generate([prompt], greedy(40, stop=[stop]), use_tqdm=False)
        (got,) = spec.generate([prompt], greedy(40, stop=[stop]), use_tqdm=False)
        r, g = ref.outputs[0], got.outputs[0]
        assert (g.text, g.token_ids, g.finish_reason, g.stop_reason) == (
            r.text,
            r.token_ids,
            r.finish_reason,
            r.stop_reason,
        )
        inside += g.stop_reason == stop and seen[-1][1] < seen[-1][0]
        if inside:
            break
    assert inside > 0
    assert_all_free(spec)


@pytest.mark.parametrize("uncapped", [False, True])
def test_max_tokens_inside_an_accepted_run(
    spec: LLM,
    plain: Callable[[str, int], list[int]],
    monkeypatch: pytest.MonkeyPatch,
    uncapped: bool,
) -> None:
    """Drafts never reach past max_tokens; without that cap (uncapped) the engine still
    stops at max_tokens inside the run."""
    if uncapped:
        monkeypatch.setattr(Speculator, "_tokens_left", lambda self, req: 1000)
    seen = _record_emits(monkeypatch, spec)
    prompt = REPEATS[0]
    for n in (7, 11, 16):
        assert token_ids(spec, [prompt], greedy(n)) == [[plain(prompt, n)]]
    assert any(offered > 1 for offered, _ in seen)
    if uncapped:
        assert any(appended < offered for offered, appended in seen)
    assert_all_free(spec)


# ---- the acceptance rule ------------------------------------------------------------


def tv(counts: Counter[int], n: int, p: torch.Tensor) -> float:
    return 0.5 * sum(abs(counts.get(t, 0) / n - float(p[t])) for t in range(p.numel()))


P0 = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
P1 = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])
BOUND = 0.03  # ~4x the sampling noise at these counts; the wrong rules below are > 0.2


def test_verification_follows_the_target_distribution() -> None:
    """The engine's rule on the real sampler: rows sampled at temperature 1, drafts
    accepted while equal. The first output token follows p0, the second (after an
    accepted draft) p1; accepting every draft, or resampling from p without removing
    the draft, would be far off."""
    n, draft = 20000, 0
    sampler = Sampler(6, seed=1, device=torch.device("cpu"))
    reqs = [Request(f"r{i}", [1], SamplingParams(temperature=1.0)) for i in range(n)]
    rows = [row for r in reqs for row in (r, DraftRow(r, [draft]), DraftRow(r, [draft, 1]))]
    logits = torch.stack([P0.log(), P1.log(), P1.log()]).repeat(n, 1)
    out = sampler(logits, rows, [[] for _ in rows]).token_ids
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    for i in range(n):
        sampled = out[3 * i : 3 * i + 3]
        emitted = sampled[: accepted_length(sampled, [draft, 1]) + 1]
        first[emitted[0]] += 1
        if emitted[0] == draft:
            second[emitted[1]] += 1
    assert tv(first, n, P0) < BOUND
    assert tv(second, sum(second.values()), P1) < BOUND
    # What wrong rules would give for the first token, against the same bound.
    always = Counter({draft: n})
    resample_with_draft = (1 - P0[draft]) * P0
    resample_with_draft[draft] += P0[draft]
    assert tv(always, n, P0) > 5 * BOUND
    assert 0.5 * float((resample_with_draft - P0).abs().sum()) > 5 * BOUND


def test_rejection_sample_with_a_proposal_distribution() -> None:
    """The general rule (for draft models): drafts drawn from q, output follows p."""
    gen = torch.Generator().manual_seed(3)
    q0 = torch.tensor([0.05, 0.05, 0.10, 0.10, 0.30, 0.40])  # far from p0
    q1 = torch.tensor([0.40, 0.30, 0.10, 0.10, 0.05, 0.05])
    n = 6000
    first: Counter[int] = Counter()
    always: Counter[int] = Counter()
    for _ in range(n):
        d0 = int(torch.multinomial(q0, 1, generator=gen))
        d1 = int(torch.multinomial(q1, 1, generator=gen))
        p = torch.stack([P0, P1, P1])
        out = rejection_sample(p, torch.stack([q0, q1]), [d0, d1], gen)
        assert 1 <= len(out) <= 3
        first[out[0]] += 1
        always[d0] += 1
    assert tv(first, n, P0) < 0.04
    assert tv(always, n, P0) > 0.2  # accepting every draft follows q, not p


def test_accepted_length() -> None:
    assert accepted_length([5], []) == 0
    assert accepted_length([1, 2, 3], [1, 2]) == 2
    assert accepted_length([1, 9, 3], [1, 2]) == 1
    assert accepted_length([9, 2, 3], [1, 2]) == 0


# ---- KV rollback and the scheduler's grant -------------------------------------------


def test_rollback_frees_the_rejected_blocks_and_names_only_known_tokens() -> None:
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    req = Request("r", list(range(10, 17)), SamplingParams())  # 7 known tokens
    assert kv.allocate_slots(req, 6)
    req.num_computed_tokens = 6
    req.spec_token_ids = [1, 2, 3, 4, 5, 6]
    # Verify: the last known token and 6 drafts, positions 6..12 (4 blocks).
    assert kv.allocate_slots(req, 7)
    assert len(req.block_ids) == 4 and kv.num_free_blocks == 12
    assert req.num_named_blocks == 1  # only tokens 0..3; tokens 4..7 include a draft
    req.num_computed_tokens += 7
    req.all_token_ids += [1, 9]  # one draft accepted, then the target's own token
    kv.rollback(req, 5)
    assert req.num_computed_tokens == 8 and len(req.block_ids) == 2
    assert kv.num_free_blocks == 14
    named = [h for h in kv.pool.block_hash if h is not None]
    assert named == extend_block_hashes([], req.all_token_ids, 4, 4)
    kv.free(req)
    assert kv.num_free_blocks == 16


def test_scheduler_grants_drafts_from_spare_budget_and_drops_them_before_preempting() -> None:
    cfg = EngineConfig(block_size=4, max_num_batched_tokens=8)
    kv = KVCacheManager(6, 4, enable_prefix_caching=False)
    s = Scheduler(cfg, kv, max_model_len=64)
    a, b = (Request(x, [1, 2, 3], SamplingParams()) for x in "ab")
    for r in (a, b):
        s.add(r)
    s.schedule()  # both prompts: 1 block each
    for r in (a, b):
        r.num_computed_tokens = 3
        r.append_token(7)
    a.spec_token_ids = [1, 2, 3, 4, 5, 6, 7, 8]
    out = s.schedule()
    # 8 tokens of budget: b's own token first, so a gets 1 + 6 drafts.
    assert out.scheduled == [(a, 7), (b, 1)] and a.spec_token_ids == [1, 2, 3, 4, 5, 6]
    # Blocks run short: drafts take only what the others' own tokens leave.
    for r, n in out.scheduled:
        r.num_computed_tokens += n
    kv.rollback(a, 6)
    a.append_token(7)
    b.append_token(7)
    a.spec_token_ids = [1] * 6
    kv.pool.allocate(kv.num_free_blocks - 2)  # one more block each for their own token
    out = s.schedule()
    # a's drafts get only the free slots of the block its own token opens: 3 of them.
    assert out.scheduled == [(a, 4), (b, 1)] and a.spec_token_ids == [1, 1, 1]
    assert not out.preempted


# ---- the proposer and the cost model ------------------------------------------------


def test_ngram_drafts_follow_the_most_recent_longest_match() -> None:
    index = NgramIndex(2, 4)
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3]
    index.update(tokens)
    assert index.draft(tokens, 3) == [5, 6, 1]  # "1 2 3" last seen before "5 6"
    assert index.draft([*tokens, 8], 2) == []  # "3 8" never seen
    periodic = [7, 8, 7, 8]
    index = NgramIndex(2, 4)
    index.update(periodic)
    assert index.draft(periodic, 5) == [7, 8, 7, 8, 7]  # continues the cycle
    req = Request("r", [4, 5, 6, 4, 5], SamplingParams())
    proposer = NgramProposer()
    assert proposer.propose([req], [3]) == [[6, 4, 5]]
    req.append_token(6)
    assert proposer.propose([req], [2]) == [[4, 5]]  # index extended, not rebuilt


# The table measured on this project's Zen 4 (bfloat16, bundled model): one row's first
# two drafts are cheap, a second row makes every draft dear.
ZEN4 = StepCosts(
    (
        (1.0, 1.25, 1.55, 2.6, 3.4),
        (1.0, 1.8, 2.7, 3.6, 4.5),
    )
)


def test_cost_model_and_when_speculation_is_off() -> None:
    cheap = StepCosts.uniform(0.01, max_rows=2)  # drafts nearly free
    assert best_num_drafts(0.0, 8, cheap) == 0
    assert best_num_drafts(1.0, 8, cheap) == 8
    ks = [best_num_drafts(a / 10, 4, ZEN4) for a in range(11)]
    assert ks == sorted(ks) and ks[0] == 0 < ks[5]  # higher acceptance, more drafts
    assert best_num_drafts(1.0, 4, ZEN4) == 2  # the third draft leaves the cheap region
    assert ZEN4.cost(1, 6) == pytest.approx(5.0)  # extended by the last slope
    # Two rows: drafts cost 0.8-0.9 of a step, so even sure drafts barely pay, and
    # middling ones never; the row that is sure drafts, the other does not.
    assert plan_drafts([0.6, 0.6], [4, 4], ZEN4) == [0, 0]
    assert plan_drafts([1.0, 0.1], [4, 4], ZEN4)[1] == 0
    assert plan_drafts([0.9, 0.9, 0.9], [4, 4, 4], ZEN4) == [0, 0, 0]  # not measured
    spec = Speculator(NgramProposer(), 4, max_model_len=100, costs=cheap)

    def decoding(rid: str, **kw: Any) -> Request:
        r = Request(rid, [1, 2, 3, 1, 2], SamplingParams(**kw))
        r.num_computed_tokens = r.num_tokens - 1
        return r

    class TwoTokens:  # a grammar that allows only the first two drafts
        def validate_tokens(self, tokens: list[int]) -> int:
            return min(2, len(tokens))

    a, b, c = decoding("a"), decoding("b", max_tokens=2), decoding("c")
    c.grammar = TwoTokens()
    spec.propose([a, b])
    assert a.spec_token_ids == [3, 1, 2, 3] and b.spec_token_ids == [3]  # b: max_tokens
    spec.propose([a, c])
    assert a.spec_token_ids == [3, 1, 2, 3] and c.spec_token_ids == [3, 1]  # c: its grammar
    spec.propose([a, b, c])  # three decode rows: more than measured, drafts cleared
    assert a.spec_token_ids == b.spec_token_ids == c.spec_token_ids == []

    # At the measured costs, drafts that keep failing stop; as the counts decay the
    # request tries again, rarely.
    spec = Speculator(NgramProposer(), 4, max_model_len=100, costs=ZEN4)
    history = []
    for _ in range(60):
        spec.propose([a])
        history.append(len(a.spec_token_ids))
        if a.spec_token_ids:
            spec.observe(a, len(a.spec_token_ids), 0, 1)
    stopped = history.index(0)
    assert 0 < stopped < 5
    assert 0 < sum(map(bool, history[stopped:])) < 6


def test_step_costs_are_measured_once_and_cached(tmp_path: Any) -> None:
    from sluice.engine.speculative.step_costs import load_or_measure

    class Fake:
        calls = 0

        def run(self) -> StepCosts:
            self.calls += 1
            return ZEN4

    fake = Fake()
    key = {"model": "m", "dtype": "float32"}
    assert load_or_measure(key, fake, tmp_path) == ZEN4  # type: ignore[arg-type]
    assert load_or_measure(key, fake, tmp_path) == ZEN4  # type: ignore[arg-type]
    assert fake.calls == 1
    load_or_measure({**key, "dtype": "bfloat16"}, fake, tmp_path)  # type: ignore[arg-type]
    assert fake.calls == 2


@pytest.mark.usefixtures("step_costs_measured")
def test_engine_measures_its_step_costs() -> None:
    """The engine's table, measured at start-up (in the default dtype: its steps are the
    fast ones), has a row per measured batch size, each starting at 1 and never
    falling; the pool and the prefix cache are left as they were."""
    fresh = LLM(speculative_method="ngram", kv_cache_memory=0.05)
    costs = fresh.engine.speculator.costs  # type: ignore[union-attr]
    assert 1 <= costs.max_rows <= 4
    for row in costs.rel:
        assert row[0] == 1.0 and list(row) == sorted(row) and len(row) == 5
    kv = fresh.engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert not kv.pool.cached  # nothing of the measurement is named
    stats = fresh.stats()
    assert stats["num_steps"] == stats["prefix_cache_queried_tokens"] == 0


def test_a_given_draft_cost_replaces_the_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    """speculative_draft_cost: a flat table for every batch up to max_num_seqs, and
    nothing measured or read from the cache."""
    from sluice.engine.speculative import methods

    def refuse(*args: Any) -> StepCosts:
        raise AssertionError("the step costs were measured or read")

    monkeypatch.setattr(methods, "load_or_measure", refuse)
    llm = LLM(
        dtype="float32",
        speculative_method="ngram",
        speculative_draft_cost=0.25,
        max_num_seqs=6,
        kv_cache_memory=0.05,
    )
    assert llm.engine.speculator is not None
    costs = llm.engine.speculator.costs
    assert costs.max_rows == 6 and costs.cost(6, 4) == pytest.approx(2.0)
    assert best_num_drafts(0.9, 4, costs) > 0
    for bad in (-0.1, float("nan"), float("inf"), True, "0.1"):
        with pytest.raises(ConfigError) as err:
            EngineConfig(speculative_draft_cost=bad)  # type: ignore[arg-type]
        assert err.value.param == "speculative_draft_cost"


# ---- the surface -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "command", [["serve"], ["generate", "hello"], ["chat"]], ids=lambda c: c[0]
)
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_options_and_flags(command: list[str], method: str) -> None:
    args = build_parser().parse_args(
        [*command, "--speculative-method", method, "--num-speculative-tokens", "6"]
    )
    cfg = engine_config(args)
    assert (cfg.speculative_method, cfg.num_speculative_tokens) == (method, 6)
    args = build_parser().parse_args([*command, "--speculative-draft-cost", "0.1"])
    assert engine_config(args).speculative_draft_cost == 0.1
    with pytest.raises(ConfigError) as err:
        EngineConfig(speculative_method="medusa")  # type: ignore[arg-type]
    assert err.value.param == "speculative_method"
    with pytest.raises(ConfigError, match=r"num_speculative_tokens must be an integer in 1\.\.15"):
        EngineConfig(num_speculative_tokens=0)


def test_metrics_mirror_the_engine_stats(spec: LLM) -> None:
    from sluice.server.metrics import ServerMetrics

    spec.generate([REPEATS[0]], greedy(16), use_tqdm=False)
    stats = spec.stats()
    assert stats["spec_method"] == "ngram" and stats["spec_drafted_tokens"] > 0
    text = ServerMetrics("m").render(stats).decode()
    drafted, accepted = stats["spec_drafted_tokens"], stats["spec_accepted_tokens"]
    emitted, steps = stats["spec_emitted_tokens"], stats["spec_verify_steps"]
    # Each verification emits its accepted drafts and one more (a stop can cut it short).
    assert 0 < emitted <= accepted + steps
    for name, value in [
        ("num_draft_tokens", float(drafted)),
        ("num_accepted_tokens", float(accepted)),
        ("num_emitted_tokens", float(emitted)),
        ("num_drafts", float(steps)),
        ("acceptance_rate", accepted / drafted),
        ("mean_accepted_length", emitted / steps),
    ]:
        assert f'sluice_spec_decode_{name}{{model_name="m"}} {value}' in text
