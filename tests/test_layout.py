"""The import rules of docs/architecture.md (its "Layers and the direction of imports"),
checked on the source with `ast`.

Every `import` in sluice/ counts: module level, inside functions and under
TYPE_CHECKING alike, since each is an arrow a reader has to follow.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sluice"

# Which parts of sluice each part may import (besides itself). Lowest first; the
# public re-export modules sluice.sampling_params and sluice.outputs count as core.
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "settings": {"core"},
    "kernels": {"core", "settings"},
    # config may ask the kernels what the CPU runs (dtype and quantization "auto").
    "config": {"core", "settings", "kernels"},
    "attention": {"core", "settings", "config", "kernels"},
    "layers": {"core", "settings", "config", "kernels"},
    # What each model architecture is (names, config reading, tensor names, weight
    # fix-ups, capabilities): declarations the loader and the models both read, so
    # below both, and nothing the loader may not import itself.
    "architectures": {"core", "config"},
    "models": {"core", "settings", "config", "kernels", "attention", "layers", "architectures"},
    # The loader repacks a GGUF file's blocks with the kernels' C code where it loads.
    "loader": {"core", "settings", "config", "kernels", "architectures"},
    # The runner and the engine ask an architecture's registration what it can do.
    "runner": {
        "core",
        "settings",
        "config",
        "kernels",
        "attention",
        "layers",
        "architectures",
        "models",
    },
    # Constrained decoding: constraints to grammar matchers, masks, forced tokens.
    "structured": {"core"},
    # Tensor parallelism's collectives (torch.distributed, shared memory); the model
    # sees them through a Protocol of its own, so only the engine, which starts the
    # group, imports this.
    "parallel": {"core", "settings"},
    # The engine reports which CPU kernel level it runs; it starts tensor-parallel groups.
    "engine": {
        "core",
        "settings",
        "config",
        "kernels",
        "architectures",
        "loader",
        "runner",
        "structured",
        "parallel",
    },
    # Data-parallel replicas: whole engines in other processes, a router in front.
    "distributed": {"core", "settings", "config", "loader", "engine"},
    "server": {"core", "settings", "config", "loader", "engine", "distributed"},
    # The front doors: LLM (and the package's __init__), the CLI, `sluice bench`.
    "api": {"core", "settings", "config", "engine"},
    # The CLI's pull / list / rm manage models without starting an engine.
    "cli": {"core", "settings", "config", "loader", "engine", "server", "bench"},
    "bench": {"api"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def imports_of(module: str) -> Iterator[str]:
    """The sluice modules `module` imports (`from pkg import sub` names pkg.sub when it
    is a module)."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    package = module if _is_package(module) else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        else:
            continue
        for name in names:
            if name == "sluice" or name.startswith("sluice."):
                yield name


def part_of(module: str) -> str:
    """The part of sluice (a key of ALLOWED) that `module` belongs to."""
    parts = module.split(".")
    if module in ("sluice", "sluice.llm"):
        return "api"
    if module in ("sluice.sampling_params", "sluice.outputs"):
        return "core"
    return parts[1]


def test_every_module_has_a_part() -> None:
    assert {part_of(m) for m in MODULES} == set(ALLOWED)


def _violations() -> set[tuple[str, str]]:
    bad = set()
    for module in MODULES:
        mine = part_of(module)
        for target in imports_of(module):
            theirs = part_of(target)
            if theirs != mine and theirs not in ALLOWED[mine]:
                bad.add((module, target))
    return bad


def test_imports_follow_the_layers() -> None:
    unexpected = sorted(_violations())
    assert not unexpected, f"imports against the layering rules (importer, imported): {unexpected}"


def test_the_checker_finds_a_planted_violation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The rule above passes on a clean tree; this shows it would not pass on a dirty one
    # (its list of tolerated exceptions, now gone, was empty and could not fail).
    planted = tmp_path / "planted.py"
    planted.write_text("from sluice.server.app import build_app\nfrom . import errors\n")
    monkeypatch.setitem(MODULES, "sluice.core.planted", planted)
    assert _violations() == {("sluice.core.planted", "sluice.server.app")}


def test_core_imports_nothing_else_of_sluice() -> None:
    for module in MODULES:
        if module.startswith("sluice.core"):
            others = [t for t in imports_of(module) if not t.startswith("sluice.core")]
            assert not others, f"{module} imports {others}"


def test_runner_does_not_import_the_engine() -> None:
    for module in MODULES:
        if module.startswith("sluice.runner"):
            assert not [t for t in imports_of(module) if t.startswith("sluice.engine")]


# What builds parts: the engine loop reaches them only through engine/builder.py (the
# builder hands it finished parts), so it never loads, sizes or constructs anything.
CONSTRUCTION = (
    "sluice.loader",
    "sluice.runner.factory",
    "sluice.engine.kv_sizing",
    "sluice.engine.speculative.methods",
    "sluice.engine.speculative.draft_load",
    "sluice.engine.speculative.eagle_load",
)


def test_the_engine_loop_receives_its_parts() -> None:
    assert "sluice.engine.builder" in set(imports_of("sluice.engine.engine"))
    for module in ("sluice.engine.engine", "sluice.engine.async_engine"):
        built = [t for t in imports_of(module) if t.startswith(CONSTRUCTION)]
        assert not built, f"{module} builds parts itself: imports {built}"


def _find_cycle(nodes: list[str]) -> list[str] | None:
    graph = {m: {t for t in imports_of(m) if t in nodes and t != m} for m in nodes}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return [*path[path.index(t) :], t]
            if t not in state and (cycle := visit(t)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(nodes):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_the_loader_has_no_import_cycle() -> None:
    loader = [m for m in MODULES if m.startswith("sluice.loader.")]
    assert "sluice.loader.gguf_metadata" in loader
    assert _find_cycle(loader) is None


def test_no_module_imports_a_module_that_imports_it_back() -> None:
    # Package __init__s re-export their submodules, so they are left out here.
    modules = [m for m in MODULES if not _is_package(m)]
    assert _find_cycle(modules) is None


def test_the_checker_sees_imports() -> None:
    # Guard against a checker that passes because it finds nothing.
    assert "sluice.core.request" in set(imports_of("sluice.runner.sampler"))
    assert "sluice.kernels" in set(imports_of("sluice.layers.fused"))
    assert "sluice.loader.gguf_metadata" in set(imports_of("sluice.loader.gguf_tokenizer"))
    assert part_of("sluice.sampling_params") == "core"


def test_importing_sluice_leaves_the_compiler_unloaded() -> None:
    """`sluice serve`, `generate` and every test server start by importing sluice; the
    torch compiler stack (dynamo, inductor) costs about 2 s to import, so it loads only
    when --compile asks for it (a library importing it at its top level once did)."""
    code = (
        "import sys, sluice.cli, sluice.server.app; print(sorted(m for m in sys.modules "
        "if m.startswith(('torch._inductor', 'torch._dynamo.symbolic_convert'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
