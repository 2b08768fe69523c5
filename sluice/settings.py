"""Every `SLUICE_*` environment variable, read one way.

Each variable has one typed accessor here and an entry in `SETTINGS` (its name,
default and meaning; docs/architecture.md lists them). Accessors read the environment at
each call, so a test can set a variable with monkeypatch. An empty value means the
default; a value outside what the variable takes raises `SettingsError` naming the
variable, rather than being read as something else.

Booleans take 1/true/yes/on and 0/false/no/off (any case).

Nothing else in sluice reads a `SLUICE_*` variable (tests/test_settings.py checks), and
this module imports only the core layer, so every layer, the kernels included, may use it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from sluice.core.choices import CPU_ISAS, TP_ALLREDUCES, CpuIsa, TPAllReduce, choice_error
from sluice.core.errors import SettingsError


@dataclass(frozen=True)
class Setting:
    name: str
    default: str  # as documented
    meaning: str


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting(
            "SLUICE_CACHE_DIR",
            "~/.cache/sluice",
            "root of everything sluice writes: assembled models, compiled kernels",
        ),
        Setting(
            "SLUICE_CPU_KERNELS",
            "1",
            "0 turns off sluice's C++ CPU kernels (torch's ops are used instead)",
        ),
        Setting(
            "SLUICE_CPU_ISA",
            "unset (the best the CPU supports)",
            f"force the CPU kernels' instruction-set level, one of {', '.join(CPU_ISAS)}",
        ),
        Setting(
            "SLUICE_TP_ALLREDUCE",
            "auto (shm on one CPU host, gloo otherwise; nccl on CUDA)",
            "the tensor-parallel all-reduce on CPU: shm (shared memory) or gloo",
        ),
        Setting(
            "SLUICE_LLAMA_VOCAB_DIR",
            "unset",
            "tests only: llama.cpp's models/ folder of ggml-vocab-*.gguf files, for the "
            "tokenizer comparison tests",
        ),
    )
}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _raw(name: str) -> str | None:
    """The variable's value, None when unset or empty."""
    if name not in SETTINGS:
        raise KeyError(f"{name} is not a sluice setting (add it to SETTINGS)")
    value = os.environ.get(name, "").strip()
    return value or None


def _flag(name: str, default: bool) -> bool:
    value = _raw(name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise SettingsError(name, f"{name} must be one of {', '.join(_TRUE + _FALSE)}; got {value!r}")


def _path(name: str) -> Path | None:
    value = _raw(name)
    return None if value is None else Path(value).expanduser()


def cache_dir() -> Path:
    """Root of everything sluice writes: `$SLUICE_CACHE_DIR` or `~/.cache/sluice`."""
    return _path("SLUICE_CACHE_DIR") or Path.home() / ".cache" / "sluice"


def cpu_kernels_enabled() -> bool:
    """Whether sluice's C++ CPU kernels may be used (`SLUICE_CPU_KERNELS`, default on)."""
    return _flag("SLUICE_CPU_KERNELS", True)


def cpu_isa_override() -> CpuIsa | None:
    """The kernel instruction-set level forced by `SLUICE_CPU_ISA` (any case), None
    when unset."""
    value = _raw("SLUICE_CPU_ISA")
    if value is None:
        return None
    for isa in CPU_ISAS:
        if value.lower() == isa:
            return isa
    raise SettingsError("SLUICE_CPU_ISA", choice_error("SLUICE_CPU_ISA", value, CPU_ISAS))


def tp_allreduce() -> TPAllReduce:
    """How tensor-parallel ranks on CPU all-reduce (`SLUICE_TP_ALLREDUCE`): "auto"
    (unset), "shm" or "gloo"."""
    value = _raw("SLUICE_TP_ALLREDUCE")
    if value is None:
        return "auto"
    for choice in TP_ALLREDUCES:
        if value.lower() == choice:
            return choice
    raise SettingsError(
        "SLUICE_TP_ALLREDUCE", choice_error("SLUICE_TP_ALLREDUCE", value, TP_ALLREDUCES)
    )


def llama_vocab_dir() -> Path | None:
    """`SLUICE_LLAMA_VOCAB_DIR` (tests only), None when unset."""
    return _path("SLUICE_LLAMA_VOCAB_DIR")


__all__ = [
    "SETTINGS",
    "Setting",
    "cache_dir",
    "cpu_isa_override",
    "cpu_kernels_enabled",
    "llama_vocab_dir",
    "tp_allreduce",
]
