"""Scheduler: token budget, chunked prefill, seat cap, preemption and freeing."""

from __future__ import annotations

import pytest

from sluice.config import EngineConfig
from sluice.core.request import Request, RequestStatus
from sluice.engine.kv_cache import KVCacheManager
from sluice.engine.scheduler import Scheduler
from sluice.sampling_params import SamplingParams


def make(
    num_blocks: int = 64, block_size: int = 4, budget: int = 32, seqs: int = 8, policy: str = "fcfs"
) -> Scheduler:
    cfg = EngineConfig(
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        scheduling_policy=policy,
    )
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    return Scheduler(cfg, kv, max_model_len=num_blocks * block_size)


def req(n: int, rid: str, t: float = 0.0, priority: int = 0) -> Request:
    return Request(
        rid,
        list(range(1, n + 1)),
        SamplingParams(max_tokens=100),
        arrival_time=t,
        priority=priority,
    )


def run_step(s: Scheduler) -> dict[str, int]:
    """Schedule, then pretend the model ran: advance and sample one token per finisher."""
    out = s.schedule()
    assert out.num_batched_tokens <= s.config.max_num_batched_tokens
    for r, n in out.scheduled:
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.append_token(7)
    return {r.request_id: n for r, n in out.scheduled}


def test_long_prompt_is_chunked_and_shares_steps_with_decodes() -> None:
    s = make(budget=16)
    s.add(req(5, "short", 0))
    assert run_step(s) == {"short": 5}
    s.add(req(40, "long", 1))
    steps = [run_step(s) for _ in range(3)]
    # The decode keeps going every step; the long prompt takes what budget is left.
    assert steps == [{"short": 1, "long": 15}, {"short": 1, "long": 15}, {"short": 1, "long": 10}]


def test_max_num_seqs_caps_running_requests() -> None:
    s = make(seqs=2)
    for i in range(4):
        s.add(req(3, f"r{i}", i))
    assert set(run_step(s)) == {"r0", "r1"}
    assert len(s.waiting) == 2


def test_preemption_frees_the_newest_and_recomputes_it() -> None:
    s = make(num_blocks=6, block_size=4, budget=64)
    a, b = req(8, "a", 0), req(8, "b", 1)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefilled: 2 blocks each + growing
    seen_preempt = False
    for _ in range(12):
        out = s.schedule()
        seen_preempt |= bool(out.preempted)
        for r, n in out.scheduled:
            r.num_computed_tokens += n
            if r.num_computed_tokens == r.num_tokens:
                r.append_token(7)
        if out.preempted:
            assert out.preempted[0] is b  # newest goes first
            assert b.block_ids == [] and b.status == RequestStatus.WAITING
    assert seen_preempt and s.num_preemptions >= 1
    # The oldest request was never starved: it decoded every step.
    assert a.num_output_tokens == 13


def test_priority_policy_admits_urgent_first() -> None:
    s = make(seqs=1, policy="priority")
    s.add(req(3, "low", 0, priority=5))
    s.add(req(3, "high", 1, priority=0))
    assert set(run_step(s)) == {"high"}


@pytest.mark.parametrize("abort_while", ["waiting", "running"])
def test_finish_returns_all_blocks(abort_while: str) -> None:
    s = make(num_blocks=16)
    reqs = [req(6, f"r{i}", i) for i in range(3)]
    for r in reqs:
        s.add(r)
    if abort_while == "running":
        run_step(s)
    for r in reqs:
        s.finish(r, RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_free_blocks == 16 and not s.running and not s.waiting
