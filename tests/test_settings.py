"""sluice.settings: every SLUICE_* variable read one way, a bad value an error naming it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from sluice import loader, settings
from sluice.core.errors import SettingsError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sluice"


def test_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SLUICE_CACHE_DIR", raising=False)
    assert settings.cache_dir() == Path.home() / ".cache" / "sluice"
    monkeypatch.setenv("SLUICE_CACHE_DIR", "")
    assert settings.cache_dir() == Path.home() / ".cache" / "sluice"
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    assert settings.cache_dir() == tmp_path
    monkeypatch.setenv("SLUICE_CACHE_DIR", "~/x")
    assert settings.cache_dir() == Path.home() / "x"
    # benchmarks/ import it from the loader too.
    assert loader.cache_dir is settings.cache_dir


@pytest.mark.parametrize(
    ("accessor", "name"),
    [
        (settings.cpu_kernels_enabled, "SLUICE_CPU_KERNELS"),
    ],
)
def test_flags(accessor: object, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert callable(accessor)
    monkeypatch.delenv(name, raising=False)
    assert accessor() is True  # default on
    for value, expected in [("0", False), ("1", True), ("false", False), ("Off", False),
                            ("yes", True), ("ON", True), ("", True)]:  # fmt: skip
        monkeypatch.setenv(name, value)
        assert accessor() is expected, value
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(SettingsError, match=name) as err:
        accessor()
    assert err.value.param == name and isinstance(err.value, ValueError)


def test_cpu_isa_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLUICE_CPU_ISA", raising=False)
    assert settings.cpu_isa_override() is None
    for isa in ("generic", "avx2", "avx512", "amx"):
        monkeypatch.setenv("SLUICE_CPU_ISA", isa)
        assert settings.cpu_isa_override() == isa
    monkeypatch.setenv("SLUICE_CPU_ISA", " AVX2 ")
    assert settings.cpu_isa_override() == "avx2"
    monkeypatch.setenv("SLUICE_CPU_ISA", "sse2")
    with pytest.raises(SettingsError, match=r"SLUICE_CPU_ISA must be one of generic, avx2, "):
        settings.cpu_isa_override()


def _sluice_names_read(path: Path) -> set[str]:
    """SLUICE_* names written as string constants in a module."""
    tree = ast.parse(path.read_text(), str(path))
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and re.fullmatch(r"SLUICE_[A-Z0-9_]+", node.value)
    }


def test_only_settings_reads_sluice_variables() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "sluice/settings.py":
            continue
        names = _sluice_names_read(path)
        if names:
            offenders[rel] = sorted(names)
    assert not offenders, f"read these through sluice.settings instead: {offenders}"


def test_the_scan_finds_a_planted_read(tmp_path: Path) -> None:
    # The rule above passes on a clean tree; this shows its scan sees a direct read
    # (its list of tolerated modules, now gone, was empty and could not fail).
    planted = tmp_path / "planted.py"
    planted.write_text('import os\nflag = os.environ.get("SLUICE_PLANTED", "")\n')
    assert _sluice_names_read(planted) == {"SLUICE_PLANTED"}


def test_every_setting_is_read_and_documented() -> None:
    source = (PACKAGE / "settings.py").read_text()
    docs = (ROOT / "docs" / "architecture.md").read_text()
    for name in settings.SETTINGS:
        assert source.count(f'"{name}"') >= 2, f"{name} has no accessor"
        assert f"`{name}`" in docs, f"{name} is not in docs/architecture.md"
