"""How an engine is built (docs/architecture.md, "Construction"): the builder hands
LLMEngine finished parts and releases what it built when a later part fails; every
runner comes from one factory and takes keywords only; speculative methods are known
to the engine through their registration alone."""

from __future__ import annotations

import ast
import inspect
import socket
from pathlib import Path

import pytest
import torch

from sluice.config import EngineConfig
from sluice.core.choices import SPECULATIVE_METHODS
from sluice.engine import builder
from sluice.engine.engine import LLMEngine
from sluice.engine.speculative.methods import METHODS
from sluice.engine.speculative.ngram import NgramProposer
from sluice.engine.speculative.source import DraftBuild
from sluice.engine.speculative.suffix import SuffixProposer
from sluice.runner.factory import RunnerOptions
from sluice.runner.kv_layout import KVLayout
from sluice.runner.model_runner import ModelRunner

PACKAGE = Path(__file__).resolve().parents[1] / "sluice"


def _calls(name: str) -> list[str]:
    """The modules of sluice/ that call `name(...)`."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == name:
                found.append(str(path.relative_to(PACKAGE)))
    return found


def test_every_runner_comes_from_the_factory() -> None:
    assert set(_calls("ModelRunner")) == {"runner/factory.py"}
    params = list(inspect.signature(ModelRunner.__init__).parameters.values())[1:]
    assert params and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params)


def test_speculative_methods_are_known_by_registration_only() -> None:
    assert tuple(METHODS) == SPECULATIVE_METHODS
    # The engine and its builder name no method: a new one is a line in METHODS.
    for module in ("engine/engine.py", "engine/builder.py"):
        tree = ast.parse((PACKAGE / module).read_text())
        names = {
            n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in METHODS
        }
        assert not names, f"{module} names speculative methods {names}"
    assert [m for m, info in METHODS.items() if info.needs_features] == ["eagle"]


@pytest.mark.parametrize(("method", "kind"), [("ngram", NgramProposer), ("suffix", SuffixProposer)])
def test_token_methods_load_nothing(method: str, kind: type) -> None:
    config = EngineConfig(speculative_method=method)  # type: ignore[arg-type]
    source = METHODS[config.speculative_method].load(None)  # type: ignore[arg-type,index]
    assert source.kv_bytes_per_block(16, torch.float32) == 0
    assert source.cost_key() is None
    options = RunnerOptions(torch.float32, torch.device("cpu"))
    layout = KVLayout(block_size=16, num_blocks=8, max_model_len=128)
    assert isinstance(source.build(DraftBuild(config, None, options, layout)), kind)  # type: ignore[arg-type]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_failed_build_releases_what_it_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill instance's block server listens once the connector is built; a part
    built after it fails, and the port is free again (nothing half-built lingers)."""
    port = _free_port()

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the sampler could not be built")

    monkeypatch.setattr(builder, "Sampler", broken)
    config = EngineConfig(
        dtype="float32", kv_cache_memory=0.02, kv_role="prefill", kv_transfer_port=port
    )
    with pytest.raises(RuntimeError, match="sampler"):
        LLMEngine.from_config(config)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # would raise EADDRINUSE had the server stayed up


def test_the_engine_holds_its_parts() -> None:
    engine = LLMEngine.from_config(EngineConfig(dtype="float32", kv_cache_memory=0.02))
    parts = engine.parts
    assert (engine.runner, engine.kv, engine.scheduler) == (parts.runner, parts.kv, parts.scheduler)
    # The runner's KV pools are the layout the builder sized, and the manager's too.
    assert engine.runner.layout == parts.layout
    assert engine.kv.pool.num_blocks == parts.layout.num_blocks == engine.runner.num_blocks
    assert engine.max_model_len == parts.layout.max_model_len
    with pytest.raises(AttributeError):
        parts.runner = None  # type: ignore[misc]
