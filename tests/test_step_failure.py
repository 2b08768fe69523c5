"""A step that raises must not leave KV it never wrote in the prefix cache.

Each test makes one forward pass fail on the real engine, then checks that later
requests give exactly what they give without the prefix cache (a fresh engine's output,
greedy, fp32), and that no block leaks.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sluice import LLM, SamplingParams
from sluice.core.request import Request
from sluice.engine.async_engine import AsyncLLM, EngineStepError
from sluice.engine.engine import LLMEngine

TEXT = (
    "The river rose through the night, and by morning the lower streets of the town were "
    "under water. Boats moved between the houses, carrying bread, lamps and the old "
    "people who had refused to leave, while on the hill the bells rang every hour. "
    "Nobody could remember a flood like it, not even the miller, who was ninety."
)
GREEDY = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)


class InjectedFailure(RuntimeError):
    pass


class FailingExecute:
    """Stands in for `ModelRunner.execute`: runs the real one, except that the next
    call after `arm()` dies instead of writing its KV. What such a step leaves in its
    slots is undefined; it is made visibly wrong here (random, and finite: padded
    attention multiplies unused slots by zero) rather than left to chance, since those
    slots may happen to hold the very same KV from an earlier request."""

    def __init__(self, engine: LLMEngine) -> None:
        self.runner = engine.runner
        self.real = engine.runner.execute
        self.armed = False
        self.failures = 0

    def arm(self) -> None:
        self.armed = True

    def __call__(self, scheduled: list[tuple[Request, int]]) -> Any:
        if not self.armed:
            return self.real(scheduled)
        self.armed = False
        self.failures += 1
        bs = self.runner.block_size
        for req, n in scheduled:
            for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
                self.runner.kv_pools[0][:, :, req.block_ids[pos // bs], :, pos % bs].normal_()
        raise InjectedFailure("injected: the forward pass died")


@pytest.fixture
def failing(llm_fp32: LLM, monkeypatch: pytest.MonkeyPatch) -> FailingExecute:
    eng = llm_fp32.engine
    fail = FailingExecute(eng)
    monkeypatch.setattr(eng.runner, "execute", fail)
    eng.reset_prefix_cache()
    return fail


def uncached(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """The outputs with every block computed afresh: what a fresh engine gives."""
    kv = llm.engine.kv
    kv.enable_prefix_caching = False
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        kv.enable_prefix_caching = True
    return [o.outputs[0].token_ids for o in outs]


def assert_all_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_requests"] == 0 and stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]


def test_failed_prefill_leaves_nothing_to_hit(llm_fp32: LLM, failing: FailingExecute) -> None:
    tok = llm_fp32.tokenizer
    base = tok.encode(TEXT)[:48]  # three full blocks, shared by both prompts
    ps = [base + tok.encode(" What happened next?"), base + tok.encode(" Who was the miller?")]
    ref = uncached(llm_fp32, ps, GREEDY)
    llm_fp32.engine.reset_prefix_cache()

    # Both requests are admitted in the failing step; the second one shares the first
    # one's blocks in that same step.
    failing.arm()
    with pytest.raises(InjectedFailure):
        llm_fp32.generate(ps, GREEDY, use_tqdm=False)
    assert failing.failures == 1
    assert_all_free(llm_fp32)

    outs = llm_fp32.generate(ps, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert outs[0].num_cached_tokens == 0  # nothing the failed step named was served
    # Sharing within one step still works once a step succeeds.
    assert outs[1].num_cached_tokens == 48
    assert_all_free(llm_fp32)


def test_failed_decode_step_unnames_the_block_it_filled(
    llm_fp32: LLM, failing: FailingExecute
) -> None:
    eng = llm_fp32.engine
    bs = eng.config.block_size
    prompt = llm_fp32.tokenizer.encode(TEXT)[: 4 * bs - 1]
    (out,) = uncached(llm_fp32, [prompt], GREEDY)
    # A prompt that covers the block the first decode step fills (the fourth).
    longer = prompt + out[:2]
    (ref_longer,) = uncached(llm_fp32, [longer], GREEDY)
    eng.reset_prefix_cache()

    eng.add_request("a", prompt, GREEDY)
    assert [o.outputs[0].token_ids for o in eng.step()] == [out[:1]]  # the prefill
    failing.arm()
    with pytest.raises(InjectedFailure):
        eng.step()  # the decode that completes the fourth block
    assert eng.abort_request("a")  # what the server does with requests in flight
    assert_all_free(llm_fp32)

    (again,) = llm_fp32.generate([longer], GREEDY, use_tqdm=False)
    assert again.outputs[0].token_ids == ref_longer
    # The prefill's blocks were written and stay shared; the failed step's block is not.
    assert again.num_cached_tokens == 3 * bs
    assert_all_free(llm_fp32)


def test_engine_steps_on_after_a_failed_step(llm_fp32: LLM, failing: FailingExecute) -> None:
    # Offline, the caller may step again: the requests of the failed step are recomputed.
    eng = llm_fp32.engine
    ids = llm_fp32.tokenizer.encode(TEXT)
    # b extends a's prompt by a block, c extends b's: in the failing step b hits a's
    # written blocks and c hits the block b names in that very step.
    ps = {"a": ids[:40], "b": ids[:56], "c": ids[:60]}
    ref = dict(zip(ps, uncached(llm_fp32, list(ps.values()), GREEDY), strict=True))
    eng.reset_prefix_cache()

    eng.add_request("a", ps["a"], GREEDY)
    eng.step()
    eng.add_request("b", ps["b"], GREEDY)
    eng.add_request("c", ps["c"], GREEDY)
    failing.arm()
    with pytest.raises(InjectedFailure):
        eng.step()
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert {r: o.outputs[0].token_ids for r, o in done.items()} == ref
    assert_all_free(llm_fp32)


def test_server_loop_fails_the_step_and_serves_the_next_request_right(
    llm_fp32: LLM, failing: FailingExecute
) -> None:
    tok = llm_fp32.tokenizer
    prompt = tok.encode(TEXT)[:50]
    (ref,) = uncached(llm_fp32, [prompt], GREEDY)
    llm_fp32.engine.reset_prefix_cache()

    async def main() -> list[int]:
        llm = AsyncLLM(llm_fp32.engine)
        try:
            failing.arm()
            stream = await llm.generate(prompt, GREEDY)
            with pytest.raises(EngineStepError):
                async for _ in stream:
                    pass
            stream = await llm.generate(prompt, GREEDY)
            outs = [o async for o in stream]
            assert outs[-1].num_cached_tokens == 0
            return outs[-1].outputs[0].token_ids
        finally:
            llm.shutdown()

    assert asyncio.run(main()) == ref
    assert_all_free(llm_fp32)
