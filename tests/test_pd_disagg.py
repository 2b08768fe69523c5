"""Prefill/decode disaggregation: the prefill side holds a finished prompt's KV blocks,
the decode side pulls them over TCP, loads them and generates the same greedy tokens
as one instance, computing at most the last block of the prompt.

The engine tests use the session's fp32 engine for both sides in turn (its model load
is the expensive part): the prefill connector is attached, the prompt prefilled and
held, then the RAM prefix cache is dropped and the pool filled with noise, so the
decode side can only get the prompt's KV through the transfer. The transport tests run
the block server alone; the proxy tests run the proxy on fake instances; and one real
three-process run (`sluice serve --role prefill|decode|proxy`, ~20 s).
"""

from __future__ import annotations

import dataclasses
import json
import random
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from serving import free_port, serve

from sluice import LLM, SamplingParams
from sluice.config import EngineConfig
from sluice.core.errors import ConfigError, SamplingParamsError
from sluice.core.request import Request, RequestStatus
from sluice.engine.engine import LLMEngine
from sluice.engine.kv_cache import KVCacheManager
from sluice.engine.kv_connector import (
    BlockFormat,
    BlockTransfer,
    KVConnector,
    KVConnectorScheduler,
    pd_decode_connector,
    pd_prefill_connector,
)
from sluice.engine.kv_connector.pd_transport import (
    BlockServer,
    TransferError,
    fetch_blocks,
    recv_exact,
    recv_json,
    send_json,
)
from sluice.engine.scheduler import Scheduler
from sluice.server.pd_proxy import build_proxy_app

BS = 16
HOLD = {"do_remote_decode": True}


def random_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


# 300 tokens: 18 whole blocks and 12 more; 320: 20 whole blocks, the last one holding
# the last prompt token, which the decode side computes (with the 15 before it).
PROMPTS = [random_prompt(11, 300), random_prompt(12, 320), random_prompt(13, 9)]


def greedy(n: int = 8, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, min_tokens=n, **kw)


def use(eng: LLMEngine, connector: KVConnector | None) -> None:
    """Put `connector` on the engine without closing the one it had (the test keeps
    both sides' connectors and switches between them)."""
    eng.kv_connector = connector
    eng.scheduler.connector = connector.scheduler if connector else None


def forget_kv(eng: LLMEngine) -> None:
    """What a separate decode instance starts from: no prefix cache, no stale KV."""
    eng.reset_prefix_cache()
    for pool in eng.runner.kv_pools:
        pool.fill_(3)  # a block the transfer missed would be read as this


def computed_tokens(eng: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Tokens each request computes in forward passes from now on."""
    counts: dict[str, int] = {}
    execute = eng.runner.execute

    def counting(scheduled: list[tuple[Request, int]]) -> Any:
        for req, n in scheduled:
            counts[req.request_id] = counts.get(req.request_id, 0) + n
        return execute(scheduled)

    monkeypatch.setattr(eng.runner, "execute", counting)
    return counts


def wait_for(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def sides(llm_fp32: LLM) -> Iterator[tuple[KVConnector, KVConnector]]:
    eng = llm_fp32.engine
    fmt = eng.kv_block_format()
    prefill = pd_prefill_connector(fmt, eng.runner, "127.0.0.1", 0, timeout=30.0)
    decode = pd_decode_connector(fmt, 10.0, eng.runner)
    yield prefill, decode
    use(eng, None)
    prefill.close()
    decode.close()
    eng.reset_prefix_cache()


def held(prefill: KVConnector) -> float:
    return prefill.stats()["pd_held_blocks"]


def prefill_and_hold(llm: LLM, prefill: KVConnector, prompt: list[int]) -> dict[str, Any]:
    use(llm.engine, prefill)
    (out,) = llm.generate([prompt], greedy(1, kv_transfer_params=HOLD), use_tqdm=False)
    params = out.kv_transfer_params
    assert params is not None and params["do_remote_prefill"]
    assert params["num_blocks"] == (len(prompt) - 1) // BS
    assert held(prefill) == params["num_blocks"]
    return params


def test_decode_continues_where_prefill_stopped(
    llm_fp32: LLM, sides: tuple[KVConnector, KVConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    prefill, decode = sides
    eng = llm_fp32.engine
    use(eng, None)
    eng.reset_prefix_cache()
    reference = [
        o.outputs[0].token_ids for o in llm_fp32.generate(PROMPTS, greedy(), use_tqdm=False)
    ]
    for prompt, want in zip(PROMPTS, reference, strict=True):
        forget_kv(eng)
        params = prefill_and_hold(llm_fp32, prefill, prompt)
        forget_kv(eng)
        use(eng, decode)
        counts = computed_tokens(eng, monkeypatch)
        (out,) = llm_fp32.generate([prompt], greedy(kv_transfer_params=params), use_tqdm=False)
        monkeypatch.undo()
        assert out.outputs[0].token_ids == want
        # The decode side computed the prompt past its last whole block only (at least
        # its last token), then one token per output token but the last.
        loaded = params["num_blocks"] * BS
        assert 1 <= len(prompt) - loaded <= BS
        assert out.num_cached_tokens == loaded
        (count,) = counts.values()
        assert count == len(prompt) - loaded + len(want) - 1
        # Confirmed: the prefill side holds nothing any more.
        wait_for(lambda: held(prefill) == 0)
    stats = decode.stats()
    assert stats["pd_failed_transfers"] == 0 and stats["pd_pulled_transfers"] == len(PROMPTS)
    wait_for(lambda: prefill.stats()["pd_sent_transfers"] == len(PROMPTS))


def test_failed_pull_computes_the_prompt_here(
    llm_fp32: LLM, sides: tuple[KVConnector, KVConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill instance is gone (nothing listens at its address): the decode side
    computes the whole prompt and still answers, the same way."""
    _, decode = sides
    eng = llm_fp32.engine
    prompt = PROMPTS[0]
    use(eng, None)
    forget_kv(eng)
    (ref,) = llm_fp32.generate([prompt], greedy(), use_tqdm=False)
    forget_kv(eng)
    use(eng, decode)
    failed = decode.stats()["pd_failed_transfers"]
    gone = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": free_port()}
    gone |= {"transfer_id": "nope", "num_blocks": 18}
    counts = computed_tokens(eng, monkeypatch)
    (out,) = llm_fp32.generate([prompt], greedy(kv_transfer_params=gone), use_tqdm=False)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert out.num_cached_tokens == 0
    assert next(iter(counts.values())) == len(prompt) + 8 - 1
    assert decode.stats()["pd_failed_transfers"] == failed + 1


def test_decode_gone_mid_transfer_frees_the_blocks(
    llm_fp32: LLM, sides: tuple[KVConnector, KVConnector]
) -> None:
    """A decode instance that reads part of the blocks and goes away: the prefill side
    drops the transfer at once (nobody else will pull it), not at the deadline."""
    prefill, _ = sides
    params = prefill_and_hold(llm_fp32, prefill, PROMPTS[0])
    fmt = dataclasses.asdict(llm_fp32.engine.kv_block_format())
    with socket.create_connection((params["remote_host"], params["remote_port"])) as sock:
        send_json(sock, {"transfer_id": params["transfer_id"], "format": fmt})
        assert recv_json(sock)["ok"]
        recv_exact(sock, fmt["nbytes"] * 2)  # two blocks of 18, then gone
    wait_for(lambda: held(prefill) == 0)
    assert prefill.stats()["pd_broken_transfers"] >= 1
    # Its pool is all free too: it copied the blocks out when the request finished.
    stats = llm_fp32.engine.stats()
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]


# ---- parking in the scheduler ---------------------------------------------------------------


class Parking(KVConnectorScheduler):
    """Holds back the requests named in `parked` (their KV is on its way)."""

    def __init__(self, parked: set[str]) -> None:
        self.parked = parked

    def is_ready(self, request: Request) -> bool:
        return request.request_id not in self.parked

    def num_loadable_tokens(self, request: Request, num_hit_tokens: int) -> int:
        return 0

    def request_admitted(self, request: Request, load_blocks: list[int]) -> None:
        pass

    def request_finished(self, request: Request) -> None:
        pass

    def take_loads(self) -> list[BlockTransfer]:
        return []

    def take_saves(self) -> list[BlockTransfer]:
        return []


def test_a_parked_request_keeps_its_place_and_others_pass() -> None:
    connector = Parking({"a"})
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    scheduler = Scheduler(EngineConfig(block_size=4), kv, 64, connector)
    a, b, c = (Request(r, [1, 2, 3, 4, 5], SamplingParams()) for r in "abc")
    for r in (a, b, c):
        scheduler.add(r)
    out = scheduler.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["b", "c"]
    assert list(scheduler.waiting) == [a] and a.num_computed_tokens == 0 and not a.block_ids
    connector.parked.clear()  # its KV arrived
    d = Request("d", [1, 2, 3], SamplingParams())
    scheduler.add(d)
    out = scheduler.schedule()
    assert [r.request_id for r, _ in out.scheduled][-2:] == ["a", "d"]
    # A parked request can be aborted like any waiting one.
    e = Request("e", [7, 8], SamplingParams())
    connector.parked.add("e")
    scheduler.add(e)
    scheduler.schedule()
    scheduler.finish(e, RequestStatus.FINISHED_ABORTED)
    assert not scheduler.waiting


# ---- the block server alone ------------------------------------------------------------

FMT = BlockFormat("m", "gguf", "float32", "float32", BS, "float32[2,2,1,16,4]", 1024)


def hold_one(server: BlockServer, tid: str, num_blocks: int = 3) -> list[torch.Tensor]:
    blocks = [torch.full((FMT.nbytes,), i, dtype=torch.uint8) for i in range(num_blocks)]
    assert server.reserve(tid, list(range(num_blocks * BS)), num_blocks)
    for i, b in enumerate(blocks):
        server.put(tid, i, b)
    return blocks


def test_another_block_format_is_refused() -> None:
    server = BlockServer("127.0.0.1", 0, FMT, timeout=30.0)
    try:
        blocks = hold_one(server, "t1")
        for change in ({"dtype": "bfloat16"}, {"model": "other"}, {"kv_dtype": "int8"}):
            other = dataclasses.replace(FMT, **change)  # type: ignore[arg-type]
            with pytest.raises(TransferError, match="block format differs"):
                fetch_blocks("127.0.0.1", server.port, "t1", other, 5.0)
        # Still there for a decode instance of the right model, which gets every byte.
        assert server.stats()["pd_held_transfers"] == 1
        ids, data, n = fetch_blocks("127.0.0.1", server.port, "t1", FMT, 5.0)
        assert n == 3 and ids == list(range(3 * BS))
        assert bytes(data) == b"".join(bytes(b.numpy()) for b in blocks)
        wait_for(lambda: server.stats()["pd_held_transfers"] == 0)
        with pytest.raises(TransferError, match="no KV transfer"):
            fetch_blocks("127.0.0.1", server.port, "t1", FMT, 5.0)
    finally:
        server.close()


def test_an_unclaimed_transfer_expires() -> None:
    server = BlockServer("127.0.0.1", 0, FMT, timeout=0.4)
    try:
        hold_one(server, "t2")
        assert server.stats()["pd_held_blocks"] == 3
        wait_for(lambda: server.stats()["pd_held_blocks"] == 0, timeout=5.0)
        assert server.stats()["pd_expired_transfers"] == 1
    finally:
        server.close()


def test_holds_are_capped() -> None:
    server = BlockServer("127.0.0.1", 0, FMT, timeout=30.0, max_bytes=4 * FMT.nbytes)
    try:
        hold_one(server, "a")
        assert not server.reserve("b", [], 2)
        assert server.stats()["pd_dropped_holds"] == 1
    finally:
        server.close()


# ---- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ("yes", "must be an object"),
        ({"do_remote_decode": 1}, "must be a bool"),
        ({"hold": True}, "unknown key"),
        ({"do_remote_prefill": True, "remote_host": "h", "remote_port": 0}, "remote_port"),
        (
            {"do_remote_prefill": True, "remote_host": "h", "remote_port": 9, "num_blocks": 1},
            "transfer_id",
        ),
    ],
)
def test_kv_transfer_params_are_checked(params: Any, match: str) -> None:
    with pytest.raises(SamplingParamsError, match=match) as info:
        SamplingParams(kv_transfer_params=params)
    assert info.value.param == "kv_transfer_params"


def test_kv_role_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="kv_role"):
        EngineConfig(kv_role="both")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        EngineConfig(kv_role="decode", enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="pick one"):
        EngineConfig(kv_role="prefill", kv_offload_dir="/tmp/x")
    with pytest.raises(ConfigError, match="kv_transfer_port"):
        EngineConfig(kv_role="prefill", kv_transfer_port=70000)


# ---- the proxy, on fake instances -------------------------------------------------------

PARAMS = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 5}
PARAMS |= {"transfer_id": "x", "num_blocks": 1}


class Fakes:
    """A prefill and a decode instance as the proxy sees them (what they were sent)."""

    def __init__(
        self, decode_up: bool = True, prefill_status: int = 200, decode_breaks: bool = False
    ) -> None:
        self.sent: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": []}
        self.decode_up = decode_up
        self.prefill_status = prefill_status
        self.decode_breaks = decode_breaks  # it goes away after its first event

    def __call__(self, request: httpx.Request) -> httpx.Response:
        role = request.url.host
        body = json.loads(request.content)
        self.sent[role].append(body)
        if role == "prefill":
            if self.prefill_status != 200:
                err = {"error": {"message": "bad n", "type": "invalid_request_error"}}
                return httpx.Response(self.prefill_status, json=err)
            return httpx.Response(200, json={"choices": [], "kv_transfer_params": PARAMS})
        if not self.decode_up:
            raise httpx.ConnectError("connection refused")
        if body.get("stream") and self.decode_breaks:
            sse = {"content-type": "text/event-stream"}
            return httpx.Response(200, stream=BreaksOff(), headers=sse)
        if body.get("stream"):
            events = b'data: {"choices": [{"text": "hi"}]}\n\ndata: [DONE]\n\n'
            return httpx.Response(
                200, content=events, headers={"content-type": "text/event-stream"}
            )
        return httpx.Response(200, json={"choices": [{"text": "hello"}]})


class BreaksOff(httpx.AsyncByteStream):
    """A decode instance's stream that ends in a broken connection after one event."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b'data: {"choices": [{"text": "hi"}]}\n\n'
        raise httpx.ReadError("connection reset by peer")


def proxy_client(fakes: Fakes) -> TestClient:
    app = build_proxy_app("http://prefill", "http://decode", httpx.MockTransport(fakes))
    return TestClient(app)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_proxy_prefills_then_decodes(path: str) -> None:
    fakes = Fakes()
    body = {"prompt": "x", "messages": [], "max_tokens": 50, "n": 2, "logprobs": 1}
    with proxy_client(fakes) as client:
        r = client.post(path, json=body, headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json() == {"choices": [{"text": "hello"}]}
        r = client.post(path, json={**body, "stream": True})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    first = fakes.sent["prefill"][0]
    assert first["max_tokens"] == 1 and first["kv_transfer_params"] == HOLD
    assert "n" not in first and "logprobs" not in first and "stream" not in first
    for sent in fakes.sent["decode"]:
        assert sent["kv_transfer_params"] == PARAMS and sent["max_tokens"] == 50


def test_proxy_errors_are_openai_errors() -> None:
    with proxy_client(Fakes(decode_up=False)) as client:
        for stream in (False, True):
            r = client.post("/v1/completions", json={"prompt": "x", "stream": stream})
            assert r.status_code == 502
            err = r.json()["error"]
            assert err["code"] == "decode_unavailable"
            assert "decode instance at http://decode" in err["message"]
    with proxy_client(Fakes(decode_breaks=True)) as client:
        r = client.post("/v1/completions", json={"prompt": "x", "stream": True})
        assert r.status_code == 200  # the headers were out before it broke
        events = [e for e in r.text.split("\n\n") if e]
        assert events[0] == 'data: {"choices": [{"text": "hi"}]}'
        assert json.loads(events[1][6:])["error"]["code"] == "decode_unavailable"
        assert events[-1] == "data: [DONE]"
    with proxy_client(Fakes(prefill_status=400)) as client:
        r = client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 400 and r.json()["error"]["message"] == "bad n"
        r = client.post("/v1/completions", content=b"{")
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


# ---- three real processes -----------------------------------------------------------------


def test_three_processes_end_to_end() -> None:
    """`sluice serve --role prefill`, `--role decode` and `--role proxy`: the proxy's
    answers equal one instance's, streamed or not; a decode instance that is gone is a
    502 naming it, and the prefill side then drops the blocks at the timeout."""
    common = ("--dtype", "float32", "--kv-cache-memory", "0.25", "--max-model-len", "1024")
    with (
        serve(*common, "--role", "prefill", "--kv-transfer-timeout", "3") as pre,
        serve(*common, "--role", "decode") as dec,
    ):
        _check_proxy(pre.url, dec.url, pre.headers)
        _check_dead_decode(pre.url, pre.headers)


def _check_proxy(prefill: str, decode: str, headers: dict[str, str]) -> None:
    import subprocess
    import sys

    port = free_port()
    cmd = [sys.executable, "-m", "sluice.cli", "serve", "--role", "proxy", "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--prefill-url", prefill, "--decode-url", decode])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _healthy(url), timeout=60)
        prompt = " ".join(f"word{i}" for i in range(120))
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0}
        # One instance's answer: the prefill instance's, so the decode instance's RAM
        # cache is still empty when the proxy's first request reaches it.
        want = httpx.post(f"{prefill}/v1/completions", json=body, headers=headers, timeout=120)
        got = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
        stream = httpx.post(
            f"{url}/v1/completions", json={**body, "stream": True}, headers=headers, timeout=120
        )
        text = "".join(
            json.loads(line[6:])["choices"][0]["text"]
            for line in stream.text.splitlines()
            if line.startswith("data: {")
        )
        assert text == want.json()["choices"][0]["text"]
        stats = httpx.get(f"{decode}/stats", headers=headers).json()
        assert stats["pd_pulled_transfers"] == 2 and stats["pd_failed_transfers"] == 0
        n_prompt = got.json()["usage"]["prompt_tokens"]
        assert stats["pd_loaded_tokens"] == (n_prompt - 1) // BS * BS
        chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 8}
        chat |= {"temperature": 0}
        want = httpx.post(f"{prefill}/v1/chat/completions", json=chat, headers=headers, timeout=120)
        got = httpx.post(f"{url}/v1/chat/completions", json=chat, headers=headers, timeout=120)
        assert got.status_code == 200, got.text
        message = got.json()["choices"][0]["message"]["content"]
        assert message == want.json()["choices"][0]["message"]["content"]
    finally:
        proc.terminate()
        proc.wait(30)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _check_dead_decode(prefill: str, headers: dict[str, str]) -> None:
    app = build_proxy_app(prefill, f"http://127.0.0.1:{free_port()}")
    with TestClient(app) as client:
        r = client.post(
            "/v1/completions", json={"prompt": "a b c " * 40, "max_tokens": 4}, headers=headers
        )
    assert r.status_code == 502 and r.json()["error"]["code"] == "decode_unavailable"

    def stats() -> dict[str, Any]:
        return dict(httpx.get(f"{prefill}/stats", headers=headers).json())

    assert stats()["pd_held_transfers"] == 1
    wait_for(lambda: stats()["pd_held_transfers"] == 0, timeout=15)
    assert stats()["kv_free_blocks"] == stats()["kv_total_blocks"]
