"""The disk tier under the prefix cache (`--kv-offload-dir`): blocks that left RAM come
back from disk with the same greedy tokens, bad files mean recompute, the size limit
holds, and a new tier on the same directory (what a restart builds) is warm.

The engine tests share the session's fp32 engine and attach a disk tier to it for the
module (its model load is the expensive part); a real server restart (SIGTERM, a new
`sluice serve` on the same directory) keeps a long system prompt warm;
`test_restart_with_eviction` (slow) runs separate engines with a pool too small for two
prompts.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sluice import LLM, SamplingParams
from sluice.cli import build_parser, engine_config
from sluice.config import EngineConfig
from sluice.core.errors import ConfigError
from sluice.core.request import Request, RequestStatus
from sluice.engine.engine import LLMEngine
from sluice.engine.kv_cache import KVCacheManager
from sluice.engine.kv_connector import (
    BlockFormat,
    BlockTransfer,
    DiskStore,
    KVConnectorScheduler,
    disk_tier,
)
from sluice.engine.kv_connector.disk_store import SUFFIX
from sluice.engine.kv_connector.disk_tier import block_keys
from sluice.engine.scheduler import Scheduler
from sluice.outputs import RequestOutput
from sluice.server.metrics import ServerMetrics

GREEDY = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
BS = 16


def random_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


LONG = random_prompt(1, 2000)  # 125 blocks
SHORT = random_prompt(2, 300)  # 18 full blocks


def attach(eng: LLMEngine, directory: Path, **format_changes: object) -> None:
    """Give `eng` a fresh disk tier on `directory`: what a restart builds (the index is
    read from the directory), optionally as another model or dtype would see it."""
    fmt = dataclasses.replace(eng.kv_block_format(), **format_changes)  # type: ignore[arg-type]
    eng.attach_kv_connector(disk_tier(directory, 2**30, fmt, eng.runner))


def run(llm: LLM, prompt: list[int]) -> RequestOutput:
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    llm.engine.wait_for_kv_saves()
    return out


@pytest.fixture(scope="module")
def tier(llm_fp32: LLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    directory = tmp_path_factory.mktemp("kv-tier")
    llm_fp32.engine.reset_prefix_cache()
    attach(llm_fp32.engine, directory)
    yield directory
    llm_fp32.engine.close()
    llm_fp32.engine.reset_prefix_cache()


@pytest.fixture(scope="module")
def long_reference(llm_fp32: LLM, tier: Path) -> list[int]:
    """The long prompt's greedy tokens, computed in full (the tier was empty)."""
    out = run(llm_fp32, LONG)
    assert out.num_cached_tokens == 0
    return list(out.outputs[0].token_ids)


@pytest.fixture(scope="module")
def short_reference(llm_fp32: LLM, tier: Path) -> list[int]:
    llm_fp32.engine.reset_prefix_cache()
    out = run(llm_fp32, SHORT)
    return list(out.outputs[0].token_ids)


def files_of(directory: Path) -> list[Path]:
    return sorted(directory.glob("*" + SUFFIX))


def test_long_prompt_comes_back_from_disk(
    llm_fp32: LLM, tier: Path, long_reference: list[int]
) -> None:
    eng = llm_fp32.engine
    assert len(files_of(tier)) >= 124  # every full block of the prompt, written after it
    eng.reset_prefix_cache()  # out of RAM
    before = eng.stats()["kv_offload_loaded_tokens"]
    out = run(llm_fp32, LONG)
    full = (len(LONG) - 1) // BS * BS
    assert out.num_cached_tokens == full  # at most one block computed
    assert eng.stats()["kv_offload_loaded_tokens"] - before == full
    assert list(out.outputs[0].token_ids) == long_reference
    stats = eng.stats()
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]


def test_a_restarted_tier_is_warm(llm_fp32: LLM, tier: Path, long_reference: list[int]) -> None:
    eng = llm_fp32.engine
    attach(eng, tier)
    eng.reset_prefix_cache()
    assert eng.stats()["kv_offload_files"] == len(files_of(tier))
    out = run(llm_fp32, LONG)
    assert out.num_cached_tokens == (len(LONG) - 1) // BS * BS
    assert eng.stats()["kv_offload_loaded_tokens"] == out.num_cached_tokens
    assert list(out.outputs[0].token_ids) == long_reference


def test_corrupt_and_truncated_files_are_recomputed(
    llm_fp32: LLM, tier: Path, short_reference: list[int]
) -> None:
    eng = llm_fp32.engine
    keys = block_keys(eng.scheduler.connector._root, SHORT, 18, BS, [])  # type: ignore[union-attr]
    path = tier / (keys[15] + SUFFIX)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40  # one bit in the payload
    path.write_bytes(data)
    eng.reset_prefix_cache()
    out = run(llm_fp32, SHORT)
    assert out.num_cached_tokens == 15 * BS  # up to the bad block
    assert list(out.outputs[0].token_ids) == short_reference
    assert eng.stats()["kv_offload_corrupt_files"] == 1
    assert path.exists()  # deleted, then written again by the recompute

    path = tier / (keys[12] + SUFFIX)
    path.write_bytes(path.read_bytes()[:1000])
    eng.reset_prefix_cache()
    out = run(llm_fp32, SHORT)
    assert out.num_cached_tokens == 12 * BS
    assert list(out.outputs[0].token_ids) == short_reference
    assert eng.stats()["kv_offload_corrupt_files"] == 2


def test_another_model_or_dtype_misses(
    llm_fp32: LLM, tier: Path, short_reference: list[int]
) -> None:
    eng = llm_fp32.engine
    prompt = SHORT[:100]  # its 6 full blocks are on disk, written by this model in fp32
    answers = []
    for change in ({"model": "another-model"}, {"dtype": "bfloat16", "kv_dtype": "bfloat16"}, {}):
        attach(eng, tier, **change)
        eng.reset_prefix_cache()
        out = run(llm_fp32, prompt)
        answers.append(list(out.outputs[0].token_ids))
        loaded = eng.stats()["kv_offload_loaded_tokens"]
        assert out.num_cached_tokens == loaded == (96 if not change else 0)
    assert answers[0] == answers[1] == answers[2]


# ---- the scheduler's side of the interface, with a fake connector ----------------------


class PromisingConnector(KVConnectorScheduler):
    """Says every prompt block past the RAM hit but the last is loadable."""

    def __init__(self) -> None:
        self.admitted: list[tuple[str, list[int]]] = []
        self.finished: list[str] = []

    def num_loadable_tokens(self, request: Request, num_hit_tokens: int) -> int:
        return ((request.num_tokens - 1) // 4) * 4 - num_hit_tokens

    def request_admitted(self, request: Request, load_blocks: list[int]) -> None:
        self.admitted.append((request.request_id, list(load_blocks)))

    def request_finished(self, request: Request) -> None:
        self.finished.append(request.request_id)

    def take_loads(self) -> list[BlockTransfer]:
        return [BlockTransfer(b, f"{r}:{i}") for r, bs in self.admitted for i, b in enumerate(bs)]

    def take_saves(self) -> list[BlockTransfer]:
        return []


def test_loadable_tokens_count_as_computed_and_get_blocks() -> None:
    connector = PromisingConnector()
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    scheduler = Scheduler(EngineConfig(block_size=4), kv, 64, connector)
    request = Request("r", list(range(1, 15)), SamplingParams())  # 14 tokens: 3 full blocks
    scheduler.add(request)
    out = scheduler.schedule()
    assert out.scheduled == [(request, 2)]  # only the tokens past the 12 loaded ones
    assert request.num_computed_tokens == 12 and request.num_cached_tokens == 12
    assert connector.admitted == [("r", request.block_ids[:3])]
    assert [t.block_id for t in out.kv_loads] == request.block_ids[:3]
    scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
    assert connector.finished == ["r"] and kv.num_free_blocks == 16


# ---- the store on its own -----------------------------------------------------------

FORMAT = BlockFormat("m", "none", "float32", "float32", 16, "uint8[64]", 64)


def block(i: int) -> torch.Tensor:
    return torch.full((64,), i, dtype=torch.uint8)


def test_size_limit_holds_in_lru_order(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 10**6, FORMAT)
    store.put("k0", block(0))
    store.flush()
    file_size = store.num_bytes
    store.close()
    store = DiskStore(tmp_path, 3 * file_size, FORMAT)  # a restart with a smaller limit
    for i in range(1, 4):
        store.put(f"k{i}", block(i))
        store.flush()
        time.sleep(0.02)  # file times tick at the kernel's clock, a few ms
    assert store.read("k1") is not None  # k1 is now the most recently used
    time.sleep(0.02)
    store.put("k4", block(4))
    store.flush()
    assert store.num_bytes <= 3 * file_size
    assert sorted(p.stem for p in files_of(tmp_path)) == ["k1", "k3", "k4"]
    assert store.read("k2") is None and store.read("k0") is None
    payload = store.read("k4")
    assert payload is not None and bytes(payload) == bytes(64 * [4])
    store.close()
    # A restart keeps the order: k3 is the least recently used.
    store = DiskStore(tmp_path, 3 * file_size, FORMAT)
    store.put("k5", block(5))
    store.flush()
    assert sorted(p.stem for p in files_of(tmp_path)) == ["k1", "k4", "k5"]
    store.close()


def test_foreign_files_are_rejected(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 10**6, FORMAT)
    store.put("k0", block(0))
    store.flush()
    store.close()
    other = DiskStore(tmp_path, 10**6, dataclasses.replace(FORMAT, model="other"))
    assert other.read("k0") is None  # the header names another model
    assert other.counters.corrupt_files == 1 and not files_of(tmp_path)
    other.close()


def test_write_errors_skip_the_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(src: object, dst: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    store = DiskStore(tmp_path, 10**6, FORMAT)
    monkeypatch.setattr(os, "replace", full)
    assert store.put("k0", block(0))
    store.put("k1", block(1))
    store.flush()
    assert store.counters.write_errors == 2 and store.num_files == 0
    assert not list(tmp_path.iterdir())  # no temporary file left behind
    monkeypatch.undo()
    store.put("k0", block(0))
    store.flush()
    assert store.read("k0") is not None
    store.close()


def test_block_keys_are_stable_across_processes() -> None:
    # blake2b, never Python's per-process hash: a restarted server finds its files.
    keys = block_keys(b"root", list(range(40)), 2, 16, [])
    assert keys[0] == block_keys(b"root", list(range(16)), 1, 16, [])[0]
    assert keys == [
        "8a9ef9c3f41c4f8122b59026a261af91",
        "20a5a51262a63ba3dd2edf39353c4cee",
    ]


# ---- options ------------------------------------------------------------------------


def test_options_are_validated() -> None:
    for kwargs, field in (
        ({"kv_offload_dir": ""}, "kv_offload_dir"),
        ({"kv_offload_dir": "/tmp/x", "enable_prefix_caching": False}, "kv_offload_dir"),
        ({"kv_offload_size": 0}, "kv_offload_size"),
        ({"kv_offload_size": "big"}, "kv_offload_size"),
    ):
        with pytest.raises(ConfigError) as exc:
            EngineConfig(**kwargs)  # type: ignore[arg-type]
        assert exc.value.param == field
    args = build_parser().parse_args(
        ["serve", "--kv-offload-dir", "/tmp/x", "--kv-offload-size", "0.5"]
    )
    config = engine_config(args)
    assert (config.kv_offload_dir, config.kv_offload_size) == ("/tmp/x", 0.5)


def test_metrics_show_the_tier() -> None:
    text = ServerMetrics("m").render({"kv_offload_hit_blocks": 3, "kv_offload_files": 7})
    assert b'sluice_kv_offload_hit_blocks{model_name="m"} 3.0' in text
    assert b'sluice_kv_offload_files{model_name="m"} 7.0' in text


@pytest.mark.slow
def test_restart_with_eviction(tmp_path: Path) -> None:
    """Separate engines whose pool holds one long prompt: the second prompt evicts the
    first from RAM, the repeat loads it; a new engine on the same directory is warm."""
    per_block = 30 * 2 * 16 * 3 * 64 * 4
    options = {
        "dtype": "float32",
        "kv_cache_memory": 140 * per_block / 2**30,
        "kv_offload_dir": str(tmp_path),
    }
    llm = LLM(**options)
    first = run(llm, LONG)
    run(llm, random_prompt(3, 1000))
    assert llm.engine.kv.pool.num_evictions > 0
    again = run(llm, LONG)
    assert again.num_cached_tokens == (len(LONG) - 1) // BS * BS
    assert llm.stats()["kv_offload_hit_blocks"] > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    llm.engine.close()
    restarted = LLM(**options)
    warm = run(restarted, LONG)
    assert warm.num_cached_tokens == (len(LONG) - 1) // BS * BS
    assert warm.outputs[0].token_ids == first.outputs[0].token_ids
    restarted.engine.close()


def test_server_restart_keeps_a_long_system_prompt_warm(tmp_path: Path) -> None:
    """`sluice serve --kv-offload-dir`: a chat with a long system prompt, a clean
    shutdown (SIGTERM), a new server on the same directory: the same system prompt
    loads from disk, and /stats and /metrics say so."""
    import httpx

    from tests.serving import serve

    system = " ".join(f"Rule {i}: answer in plain words and check every number." for i in range(80))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi!"}]
    body = {"model": "smollm2-135m", "messages": messages, "max_tokens": 4, "temperature": 0}
    answers = []
    for restart in range(2):
        with serve("--dtype", "float32", "--kv-offload-dir", str(tmp_path)) as srv:
            r = srv.post("/v1/chat/completions", body)
            assert r.status_code == 200, r.text
            answers.append(r.json()["choices"][0]["message"]["content"])
            stats = httpx.get(f"{srv.url}/stats", headers=srv.headers, timeout=10).json()
            metrics = srv.metrics()
        if restart == 0:
            assert stats["kv_offload_hit_blocks"] == 0
        else:
            assert stats["kv_offload_hit_blocks"] >= 40  # ~900 tokens of system prompt
            assert metrics["sluice_kv_offload_hit_blocks"] == stats["kv_offload_hit_blocks"]
    assert answers[0] == answers[1]
