"""LoRA adapters through a real `sluice serve` and the official openai client: adapters
named as the model (listed in /v1/models with their base as parent), loaded and
unloaded at run time without losing a request, bad adapters and unknown names
answered with 4xx errors while the server keeps serving."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from serving import Server, serve

from sluice import LLM, LoRARequest, SamplingParams

DATA = Path(__file__).parent / "data" / "lora"
QUESTION = "List the names of all customers who live in Paris."


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with serve(
        "--dtype", "float32",
        "--kv-cache-memory", "0.25",
        "--max-model-len", "1024",
        "--enable-lora",
        "--max-loras", "2",
        "--lora-modules", f"sql={DATA / 'smollm2-sql'}", f"caps={DATA / 'smollm2-caps'}",
    ) as srv:  # fmt: skip
        yield srv


@pytest.fixture(scope="module")
def offline() -> dict[str | None, str]:
    """The same chat answered in this process (fp32, greedy), per adapter."""
    llm = LLM(dtype="float32", kv_cache_memory=0.25, enable_lora=True)
    msgs = [{"role": "user", "content": QUESTION}]
    params = SamplingParams(temperature=0, max_tokens=24)
    out: dict[str | None, str] = {}
    for name in (None, "sql", "caps"):
        lora = None if name is None else LoRARequest(name, 1, str(DATA / f"smollm2-{name}"))
        (o,) = llm.chat(msgs, params, use_tqdm=False, lora_request=lora)
        out[name] = o.outputs[0].text
    return out


def _ask(client: openai.OpenAI, model: str) -> str:
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=24,
        temperature=0,
    )
    return r.choices[0].message.content or ""


def test_models_lists_adapters_with_their_parent(server: Server) -> None:
    models = {m.id: m for m in server.client().models.list().data}
    base = next(m for m in models.values() if getattr(m, "parent", None) is None)
    assert {"sql", "caps"} <= set(models)
    for name in ("sql", "caps"):
        card: Any = models[name]
        assert card.parent == base.id and card.root.endswith(f"smollm2-{name}")
    assert server.client().models.retrieve("sql").id == "sql"


def test_each_adapter_answers_as_offline(server: Server, offline: dict[str | None, str]) -> None:
    client = server.client()
    base = client.models.list().data[0].id
    assert _ask(client, "sql") == offline["sql"]
    assert _ask(client, "caps") == offline["caps"]
    assert _ask(client, base) == offline[None]
    assert offline["sql"] != offline[None]


def test_mixed_concurrent_requests(server: Server, offline: dict[str | None, str]) -> None:
    """Requests for two adapters and the base at once, streamed and not: each gets the
    answer it gets alone."""
    client = server.async_client()
    base = server.client().models.list().data[0].id

    async def one(model: str, stream: bool) -> str:
        msgs: Any = [{"role": "user", "content": QUESTION}]
        if not stream:
            r = await client.chat.completions.create(
                model=model, messages=msgs, max_tokens=24, temperature=0
            )
            return r.choices[0].message.content or ""
        parts = []
        async for chunk in await client.chat.completions.create(
            model=model, messages=msgs, max_tokens=24, temperature=0, stream=True
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        return "".join(parts)

    async def run() -> list[str]:
        jobs = [one(m, s) for m in ("sql", "caps", base) for s in (False, True)]
        return await asyncio.gather(*jobs)

    got = asyncio.run(run())
    want = [offline[n] for n in ("sql", "caps", None) for _ in (0, 1)]
    assert got == want


def test_unknown_model_is_404_naming_what_is_served(server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        _ask(server.client(), "nope")
    assert "`sql`" in str(info.value) and "`caps`" in str(info.value)


def test_load_and_unload_at_run_time(server: Server, offline: dict[str | None, str]) -> None:
    r = server.post(
        "/v1/load_lora_adapter", {"lora_name": "sql2", "lora_path": str(DATA / "smollm2-sql")}
    )
    assert r.status_code == 200, r.text
    assert "sql2" in {m.id for m in server.client().models.list().data}
    assert _ask(server.client(), "sql2") == offline["sql"]
    again = server.post(
        "/v1/load_lora_adapter", {"lora_name": "sql2", "lora_path": str(DATA / "smollm2-sql")}
    )
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "sql2"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _ask(server.client(), "sql2")
    gone = server.post("/v1/unload_lora_adapter", {"lora_name": "sql2"})
    assert gone.status_code == 404


def test_bad_adapter_load_is_400_naming_it(server: Server, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(DATA / "smollm2-sql", bad)
    (bad / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "use_dora": true}')
    r = server.post("/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(bad)})
    assert r.status_code == 400
    error = r.json()["error"]
    assert "'broken'" in error["message"] and "DoRA" in error["message"]
    missing = server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"})
    assert missing.status_code == 400 and "not found" in missing.json()["error"]["message"]
    assert server.post("/v1/load_lora_adapter", {"lora_name": "x"}).status_code == 400
    assert "broken" not in {m.id for m in server.client().models.list().data}


def test_unload_under_load_loses_no_request(server: Server, offline: dict[str | None, str]) -> None:
    """Requests running through an adapter when it is unloaded finish with its answer."""
    path = str(DATA / "smollm2-caps")
    assert server.post(
        "/v1/load_lora_adapter", {"lora_name": "caps2", "lora_path": path}
    ).status_code == 200  # fmt: skip
    client = server.async_client()

    async def ask() -> str:
        r = await client.chat.completions.create(
            model="caps2",
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=24,
            temperature=0,
        )
        return r.choices[0].message.content or ""

    async def run() -> list[str]:
        jobs = [asyncio.ensure_future(ask()) for _ in range(6)]
        await asyncio.sleep(0.3)  # running by now
        unload = await asyncio.to_thread(
            server.post, "/v1/unload_lora_adapter", {"lora_name": "caps2"}
        )
        assert unload.status_code == 200
        return await asyncio.gather(*jobs)

    assert asyncio.run(run()) == [offline["caps"]] * 6
    health = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 2})  # fmt: skip
    assert health.status_code == 200


def test_metrics_count_each_adapters_requests_and_tokens(server: Server) -> None:
    before = server.metrics()
    _ask(server.client(), "sql")
    after = server.metrics()
    key = "sluice_lora_requests{lora_name=sql}"
    assert after[key] == before.get(key, 0) + 1
    tokens = "sluice_lora_generated_tokens{lora_name=sql}"
    assert after[tokens] >= before.get(tokens, 0) + 8
    assert 1 <= after["sluice_lora_loaded_slots"] <= 2  # --max-loras 2
    assert after["sluice_lora_slot_loads"] >= 1
