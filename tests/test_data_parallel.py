"""Data-parallel replicas behind one `sluice serve` (the mp backend): the same greedy
text as one engine, routing that keeps a prompt's prefix on one replica, per-replica
metrics, and a replica killed by its pid mid-load.

One server for the module (two replicas, fp32, two sequences each so that requests
wait in the replicas' queues). The router's own rules are tested without processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, ClassVar

import httpx
import pytest
from conftest import PROMPTS
from serving import Server, serve, wait_idle

from sluice.config import EngineConfig
from sluice.core.errors import (
    ConfigError,
    EngineStepError,
    ModelFileError,
    QueueFullError,
    RequestError,
)
from sluice.core.lora import LoRARequest
from sluice.distributed import DataParallelLLM
from sluice.distributed.backend import ReplicaDied
from sluice.distributed.messages import Stop
from sluice.distributed.replica import run_replica
from sluice.distributed.router import RouteCounts, Router
from sluice.distributed.stats import merged_stats
from sluice.engine.engine import LLMEngine
from sluice.outputs import CompletionOutput, RequestOutput
from sluice.sampling_params import SamplingParams

# Two real replica processes in the default run: the same text as one engine and the
# prefix routing. Killing a replica (18 s more) is `make test-dist`; the router's own
# rules below need no processes.
dist = pytest.mark.dist


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with serve(
        "--data-parallel-size", "2",
        "--dtype", "float32",
        "--kv-cache-memory", "0.25",
        "--max-model-len", "1024",
        "--max-num-seqs", "2",
        "--shutdown-timeout", "60",
    ) as srv:  # fmt: skip
        yield srv


def stats(server: Server) -> dict[str, Any]:
    response = httpx.get(f"{server.url}/stats", headers=server.headers, timeout=10)
    result: dict[str, Any] = response.json()
    return result


def test_outputs_equal_one_engine(server: Server, llm_fp32: Any) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm_fp32.generate(PROMPTS, params, use_tqdm=False)]

    async def main() -> list[str]:
        client = server.async_client()
        replies = await asyncio.gather(
            *(
                client.completions.create(
                    model="smollm2-135m",
                    prompt=p,
                    max_tokens=24,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                for p in PROMPTS
            )
        )
        return [r.choices[0].text for r in replies]

    assert asyncio.run(main()) == expected
    replicas = stats(server)["replicas"]
    assert all(r["routed"] > 0 for r in replicas), replicas  # both replicas served


def test_a_shared_prefix_goes_to_the_replica_that_holds_it(server: Server) -> None:
    before = {r["replica"]: r["routed_by_prefix"] for r in stats(server)["replicas"]}
    # ~5 full KV blocks of shared system prompt, then a different question each time.
    system = "You are a careful assistant who answers in one short sentence. " * 6
    client = server.client()
    for q in ("What is two plus two?", "Name a color.", "Name a fruit."):
        client.completions.create(model="smollm2-135m", prompt=system + q, max_tokens=2)
    after = stats(server)["replicas"]
    by_prefix = [r["routed_by_prefix"] - before[r["replica"]] for r in after]
    assert sorted(by_prefix) == [0, 2], after  # the 2nd and 3rd followed the 1st
    holder = after[by_prefix.index(2)]
    assert holder["prefix_cache_hit_rate"] > 0
    metrics = server.metrics()
    key = f"sluice_replica_requests_routed_by_prefix{{replica={holder['replica']}}}"
    assert metrics[key] >= 2
    for name in ("load", "kv_cache_usage_perc", "prefix_cache_hit_rate", "up"):
        assert f"sluice_replica_{name}{{replica=0}}" in metrics, sorted(metrics)


def _stream(server: Server, prompt: str, max_tokens: int) -> tuple[int, str | None]:
    """(tokens streamed, the error event's message or None) of one streamed request."""
    body = {
        "model": "smollm2-135m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    tokens, error = 0, None
    headers = {**server.headers, "Content-Type": "application/json"}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=120
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                error = event["error"]["message"]
            elif event["choices"][0]["text"]:
                tokens += 1
    return tokens, error


@dist
def test_zz_a_killed_replica_loses_only_what_it_streamed(server: Server) -> None:
    """SIGKILL replica 0 while both replicas run two streams and queue more. Streams it
    had started end with an error event; those it had not started are re-sent and end
    whole; nothing hangs; the survivor's KV pool is all free afterwards; replica 0
    comes back."""
    victim = stats(server)["replicas"][0]
    max_tokens = 48

    async def main() -> list[tuple[int, str | None]]:
        prompts = [f"Story number {i}: once upon a time" for i in range(10)]
        jobs = [asyncio.to_thread(_stream, server, p, max_tokens) for p in prompts]
        tasks = [asyncio.ensure_future(j) for j in jobs]
        deadline = time.monotonic() + 60
        # Kill once replica 0 has sent tokens (so some of its streams have begun).
        generated = victim["num_generated_tokens"]
        while stats(server)["replicas"][0]["num_generated_tokens"] < generated + 4:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        os.kill(victim["pid"], signal.SIGKILL)
        return list(await asyncio.wait_for(asyncio.gather(*tasks), timeout=180))

    results = asyncio.run(main())
    errors = [(n, e) for n, e in results if e is not None]
    assert errors, results  # replica 0 was streaming when it died
    assert all("replica 0 died" in e for _, e in errors), errors
    assert all(n > 0 for n, _ in errors), results  # unstreamed ones were never failed
    assert all(n == max_tokens for n, e in results if e is None), results
    after = stats(server)
    assert after["num_lost_to_replica_death"] == len(errors)
    assert after["num_resent_after_replica_death"] > 0  # queued ones moved to replica 1
    # Still serving, and replica 0 comes back (a new process).
    reply = server.client().completions.create(model="smollm2-135m", prompt="Hi", max_tokens=4)
    assert reply.choices[0].text
    deadline = time.monotonic() + 120
    while not (r0 := stats(server)["replicas"][0])["alive"]:
        assert time.monotonic() < deadline, r0
        time.sleep(0.2)
    assert r0["restarts"] == 1 and r0["pid"] != victim["pid"]
    idle = wait_idle(server)
    for r in idle["replicas"]:
        assert r["kv_free_blocks"] == r["kv_total_blocks"] > 0, idle["replicas"]
        assert r["num_requests"] == 0


# ---- the router alone ------------------------------------------------------------------


@pytest.mark.parametrize("cache_aware", [True, False])
def test_router_prefix_first_then_least_loaded(cache_aware: bool) -> None:
    router = Router(3, block_size=4, balance_threshold=2, cache_aware=cache_aware)
    alive = [True, True, True]
    shared = list(range(12))
    first = router.choose([*shared, 100], [0, 0, 0], alive)
    loads = [0, 0, 0]
    loads[first] = 1
    again = router.choose([*shared, 200], loads, alive)
    if cache_aware:
        assert again == first  # 3 blocks held there, load within the threshold
        assert router.counts[first].routed_by_prefix == 1
    else:
        assert again != first  # least loaded
    loads[first] = 5  # too busy: the prefix no longer pays for the queue
    assert router.choose([*shared, 300], loads, alive) != first
    # A dead replica is never chosen, and forgets what it held.
    alive[first] = False
    router.forget(first)
    assert router.choose([*shared, 400], [0, 0, 0], alive) != first


def test_router_gathers_an_adapters_requests_where_it_is_loaded() -> None:
    """A replica that was sent an adapter gets its later requests (other prompts
    too) while within the balance; a prompt's blocks under one adapter are no prefix
    for another adapter or the base; a replica remembers at most max_loras adapters."""
    router = Router(2, block_size=4, balance_threshold=2, max_loras=2)
    alive = [True, True]
    home = router.choose([1, 2, 3, 4, 5], [0, 0], alive, "sql")
    other = 1 - home
    loads = [0, 0]
    loads[home] = 1  # busier, but within the threshold
    assert router.choose([9, 9, 9, 9, 9], loads, alive, "sql") == home
    assert router.counts[home].routed_by_prefix == 1
    # The same prompt for the base or another adapter: no prefix held, least loaded.
    assert router.choose([1, 2, 3, 4, 5], loads, alive) == other
    assert router.choose([1, 2, 3, 4, 5], loads, alive, "caps") == other
    loads[home] = 5  # too busy: the adapter no longer pays for the queue
    assert router.choose([7, 7, 7, 7, 7], loads, alive, "sql") == other
    # `other` now holds caps and sql; a third adapter there pushes caps out.
    router.choose([8, 8, 8, 8, 8], [9, 0], [False, True], "json")
    assert list(router._adapters[1]) == ["sql", "json"]


def test_router_remembers_at_most_a_replicas_capacity() -> None:
    router = Router(1, block_size=2, capacity_blocks=2)
    router.choose([1, 2, 3, 4], [0], [True])  # 2 blocks
    router.choose([5, 6, 7, 8], [0], [True])  # 2 more: the first two are evicted
    assert router.choose([1, 2, 3, 4], [0], [True]) == 0
    assert router.counts[0].routed_by_prefix == 0  # forgotten, so not a prefix hit
    with pytest.raises(ValueError, match="no replica is alive"):
        router.choose([1, 2], [0], [False])


# ---- the front end's bookkeeping on fake replicas (threads, no model) ------------------


class OneAtATimeEngine:
    """Runs its requests one after another, one token "x" per step: the others wait,
    unstreamed, as queued requests do in a busy replica."""

    max_model_len = 64

    def __init__(self, config: Any) -> None:
        self.groups: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}

    def add_request(self, request_id: str, prompt: Any, params: Any = None, **kw: Any) -> None:
        self.groups[request_id] = (prompt, params, [])

    def abort_request(self, request_id: str) -> bool:
        return self.groups.pop(request_id, None) is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def step(self) -> list[RequestOutput]:
        time.sleep(0.01)
        rid, (prompt, params, toks) = next(iter(self.groups.items()))
        toks.append(7)
        done = len(toks) >= params.max_tokens
        if done:
            del self.groups[rid]
        text = "x" * len(toks)
        out = CompletionOutput(0, text, list(toks), "length" if done else None, "x", [7])
        return [RequestOutput(rid, None, prompt, [out], done)]

    def stats(self) -> dict[str, Any]:
        n = len(self.groups)
        return {"num_running": min(n, 1), "num_waiting": max(n - 1, 0), "num_requests": n}


class ThreadChannel:
    """The replica's side of an in-process transport; silent once `dead` is set."""

    def __init__(self, dead: threading.Event) -> None:
        self.commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.dead = dead

    def receive(self, timeout: float | None) -> list[Any]:
        if self.dead.is_set():
            return [Stop()]
        try:
            return [self.commands.get(timeout=0.05 if timeout is None else max(timeout, 1e-3))]
        except queue.Empty:
            return []

    def send(self, event: Any) -> None:
        if not self.dead.is_set():
            self.events.put(event)


class ThreadHandle:
    """A ReplicaHandle running the real replica loop on a thread with OneAtATimeEngine;
    `kill()` cuts the transport, as a dead process's pipe does."""

    engine: type[OneAtATimeEngine] = OneAtATimeEngine

    def __init__(self, index: int, config: Any) -> None:
        self.dead = threading.Event()
        self.channel = ThreadChannel(self.dead)
        self.thread = threading.Thread(
            target=run_replica, args=(config, self.channel, self.engine), daemon=True
        )
        self.thread.start()

    def send(self, command: Any) -> None:
        if not self.dead.is_set():
            self.channel.commands.put(command)

    def receive(self) -> Any:
        while not self.dead.is_set():
            try:
                return self.channel.events.get(timeout=0.05)
            except queue.Empty:
                continue
        raise ReplicaDied("killed")

    def kill(self) -> None:
        self.dead.set()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)


def test_a_dead_replicas_unstreamed_requests_move_and_streamed_ones_fail() -> None:
    async def main() -> None:
        dp = DataParallelLLM(EngineConfig(data_parallel_size=2), start=ThreadHandle)
        try:
            params = SamplingParams(max_tokens=20)
            streams = [await dp.generate([i + 1] * 3, params) for i in range(6)]
            on_zero = [s.request_id for s in streams if dp._requests[s.request_id].replica == 0]
            assert len(on_zero) == 3  # least loaded alternates

            async def consume(s: Any) -> int | str:
                n = 0
                try:
                    async for out in s:
                        n = len(out.outputs[0].token_ids)
                        if s.request_id == on_zero[0] and n == 2:
                            dp.replicas[0].kill()
                except EngineStepError as exc:
                    return str(exc)
                return n

            results = await asyncio.wait_for(asyncio.gather(*map(consume, streams)), 30)
            by_id = dict(zip([s.request_id for s in streams], results, strict=True))
            assert by_id.pop(on_zero[0]) == "replica 0 died while generating this request"
            assert set(by_id.values()) == {20}  # the rest ran whole, two of them moved
            stats = dp.stats()
            assert stats["num_resent_after_replica_death"] == 2
            assert stats["num_lost_to_replica_death"] == 1
            deadline = time.monotonic() + 10
            while not dp.replicas[0].alive:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            assert dp.replicas[0].restarts == 1
            again = await dp.generate([5, 5], SamplingParams(max_tokens=3))
            assert [len(o.outputs[0].token_ids) async for o in again][-1] == 3
            assert dp.stats()["num_requests"] == 0 and not dp._requests
        finally:
            dp.shutdown()
        assert not dp.is_running

    asyncio.run(main())


class AdapterRecordingEngine(OneAtATimeEngine):
    """Records which adapter each request reached its replica with."""

    seen: ClassVar[dict[str, str | None]] = {}

    def add_request(self, request_id: str, prompt: Any, params: Any = None, **kw: Any) -> None:
        lora = kw.get("lora_request")
        self.seen[request_id] = None if lora is None else lora.lora_name
        super().add_request(request_id, prompt, params)


class AdapterThreadHandle(ThreadHandle):
    engine = AdapterRecordingEngine


def test_adapter_requests_reach_their_replica_with_the_adapter() -> None:
    """The front end sends each request's adapter with it, and the router keeps an
    adapter's requests on the replica it first went to (the base ones balance)."""
    config = EngineConfig(data_parallel_size=2, enable_lora=True,
                          lora_modules=("sql=/adapters/sql",))  # fmt: skip
    sql = config.lora_requests()[0]

    async def main() -> None:
        dp = DataParallelLLM(config, start=AdapterThreadHandle)
        try:
            params = SamplingParams(max_tokens=20)  # running while the others arrive
            streams, replicas = [], []
            for i in range(5):
                lora, prompt = (sql, [i + 1] * 3) if i < 3 else (None, [7, i])
                streams.append(await dp.generate(prompt, params, lora_request=lora))
                replicas.append(dp._requests[streams[-1].request_id].replica)
            for s in streams:
                assert [len(o.outputs[0].token_ids) async for o in s][-1] == 20
        finally:
            dp.shutdown()
        assert len(set(replicas[:3])) == 1  # the adapter's requests together
        assert replicas[3] != replicas[0]  # the base goes to the less loaded one
        seen = AdapterRecordingEngine.seen
        assert [seen[s.request_id] for s in streams] == ["sql"] * 3 + [None] * 2

    asyncio.run(asyncio.wait_for(main(), 30))


class FakeRegistry:
    """An engine's LoRA registry as the replica loop uses it; refuses a path "/bad"."""

    def __init__(self, names: list[str]) -> None:
        self.names = set(names)

    def register(self, request: LoRARequest) -> None:
        if request.lora_path == "/bad":
            raise ModelFileError(request.lora_path, "truncated")
        self.names.add(request.lora_name)

    def unregister(self, name: str) -> bool:
        if name not in self.names:
            return False
        self.names.remove(name)
        return True


class AdapterServingEngine(AdapterRecordingEngine):
    """Serves the config's adapters, and those loaded at run time; every instance
    (a restarted replica makes a new one) is kept for the test to look at."""

    made: ClassVar[list[AdapterServingEngine]] = []

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.lora = FakeRegistry([r.lora_name for r in config.lora_requests()])
        self.made.append(self)


class AdapterServingHandle(ThreadHandle):
    engine = AdapterServingEngine


def test_adapters_load_and_unload_on_every_replica_at_run_time() -> None:
    """POST /v1/load_lora_adapter behind data-parallel replicas: every replica loads
    it (a refusal anywhere unloads it everywhere and names the defect), requests
    naming it run, a restarted replica loads it before its first request, and an
    unload reaches every replica."""
    config = EngineConfig(data_parallel_size=2, enable_lora=True,
                          lora_modules=("sql=/adapters/sql",))  # fmt: skip
    made = AdapterServingEngine.made
    made.clear()

    async def main() -> None:
        dp = DataParallelLLM(config, start=AdapterServingHandle)
        try:
            await dp.load_lora_adapter(LoRARequest("caps", 2, "/adapters/caps"))
            assert [e.lora.names for e in made] == [{"sql", "caps"}] * 2
            assert set(dp.lora_adapters()) == {"sql", "caps"}
            with pytest.raises(RequestError, match="already loaded"):
                await dp.load_lora_adapter(LoRARequest("caps", 3, "/adapters/caps"))
            with pytest.raises(ModelFileError, match="truncated"):
                await dp.load_lora_adapter(LoRARequest("broken", 4, "/bad"))
            assert "broken" not in dp.lora_adapters()
            caps = dp.lora_adapters()["caps"]
            stream = await dp.generate([1, 2, 3], SamplingParams(max_tokens=3), lora_request=caps)
            assert [len(o.outputs[0].token_ids) async for o in stream][-1] == 3
            assert AdapterRecordingEngine.seen[stream.request_id] == "caps"
            assert await dp.unload_lora_adapter("sql")  # one it started with
            dp.replicas[0].kill()
            deadline = time.monotonic() + 10
            while not (dp.replicas[0].restarts == 1 and dp.replicas[0].alive):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            again = await dp.generate([4, 5], SamplingParams(max_tokens=2), lora_request=caps)
            assert [len(o.outputs[0].token_ids) async for o in again][-1] == 2
            assert len(made) == 3 and made[2].lora.names == {"caps"}  # the restarted one
            assert await dp.unload_lora_adapter("caps")
            assert not await dp.unload_lora_adapter("caps")
            # The two live replicas serve nothing now; the killed one's engine kept caps.
            assert sorted(len(e.lora.names) for e in made) == [0, 0, 1]
            assert dp.lora_adapters() == {}
        finally:
            dp.shutdown()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_bad_options_name_their_field() -> None:
    for kwargs, field in [
        ({"data_parallel_size": 0}, "data_parallel_size"),
        ({"data_parallel_size": 1.5}, "data_parallel_size"),
        ({"distributed_executor_backend": "mpi"}, "distributed_executor_backend"),
    ]:
        with pytest.raises(ConfigError) as err:
            EngineConfig(**kwargs)
        assert err.value.param == field
    # An engine in this process is one replica: the option is the server's.
    with pytest.raises(ConfigError, match="sluice serve") as err:
        LLMEngine.from_config(EngineConfig(data_parallel_size=2))
    assert err.value.param == "data_parallel_size"


def test_errors_cross_processes_with_their_field() -> None:
    import pickle

    err = pickle.loads(pickle.dumps(RequestError("prompt", "too long")))
    assert (type(err), err.param, str(err)) == (RequestError, "prompt", "too long")
    full = pickle.loads(pickle.dumps(QueueFullError(3, 2)))
    assert (full.num_waiting, full.limit) == (3, 2)


def test_a_replayable_request_runs_again_after_its_replica_dies() -> None:
    """A request whose consumer keeps only the final output (a non-streamed response)
    is run again from the start elsewhere, though it had outputs."""

    async def main() -> None:
        dp = DataParallelLLM(EngineConfig(data_parallel_size=2), start=ThreadHandle)
        try:
            params = SamplingParams(max_tokens=20)
            streams = [await dp.generate([9, i], params, replayable=True) for i in range(2)]
            victim = next(s for s in streams if dp._requests[s.request_id].replica == 0)

            async def final(s: Any) -> list[int]:
                last = None
                async for out in s:
                    last = out
                    if s is victim and len(out.outputs[0].token_ids) == 2:
                        dp.replicas[0].kill()
                assert last is not None and last.finished
                return list(last.outputs[0].token_ids)

            results = await asyncio.wait_for(asyncio.gather(*map(final, streams)), 30)
            assert [len(r) for r in results] == [20, 20]
            stats = dp.stats()
            assert (
                stats["num_resent_after_replica_death"],
                stats["num_lost_to_replica_death"],
            ) == (
                1,
                0,
            )
        finally:
            dp.shutdown()

    asyncio.run(main())


def test_merged_stats_sum_both_pools_and_report_the_fuller() -> None:
    """Replicas of a split-pool model (Gemma 3) report a second pool; the front end sums
    each pool's blocks and, as one engine does, reports the fuller pool's use."""

    def replica(i: int, free: int, local_free: int) -> Any:
        stats = {
            "kv_total_blocks": 100,
            "kv_free_blocks": free,
            "kv_local_total_blocks": 10,
            "kv_local_free_blocks": local_free,
        }
        return SimpleNamespace(index=i, alive=True, pid=i, restarts=0, stats=stats)

    replicas = [replica(0, 90, 2), replica(1, 80, 4)]
    out = merged_stats(replicas, [0, 0], [RouteCounts(), RouteCounts()])  # type: ignore[arg-type]
    assert (out["kv_total_blocks"], out["kv_free_blocks"]) == (200, 170)
    assert (out["kv_local_total_blocks"], out["kv_local_free_blocks"]) == (20, 6)
    assert out["kv_usage"] == pytest.approx(0.7)  # the local pools: 14 of 20 in use
