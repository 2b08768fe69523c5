"""What this CPU can run, as instruction-set levels: the kernels are built once per level
and the best one the CPU has is loaded, as ggml and ATen do.

The levels, lowest first: `generic` (the architecture's baseline; on x86-64 plain
x86-64, elsewhere whatever the compiler targets by default), `avx2` (x86-64-v3: AVX2,
FMA, F16C) and `avx512` (x86-64-v4 with VNNI). `SLUICE_CPU_ISA` forces a lower level,
as `ATEN_CPU_CAPABILITY` does for torch, so one machine can test every path; it never
raises the level above what the CPU reports. `amx` is accepted there too and means the
avx512 kernels: ours have no AMX path (torch's oneDNN uses AMX on its own for dense
bf16 matmuls).

Forcing a level also makes the rest of sluice behave as on such a CPU: a level below
avx512 has no native bf16 (dtype auto picks fp32, and bf16 matmuls skip oneDNN's
packed path, which needs AVX-512 or AVX-NE-CONVERT).
"""

from __future__ import annotations

import functools
import logging
import platform

from sluice import settings

logger = logging.getLogger("sluice")

LEVELS = ("generic", "avx2", "avx512")  # lowest first
# The CPU flags (as /proc/cpuinfo names them) each level's compiler flags assume.
_REQUIRED = {
    "generic": frozenset(),
    "avx2": frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}),
    "avx512": frozenset(
        {
            "avx2",
            "fma",
            "f16c",
            "avx512f",
            "avx512bw",
            "avx512vl",
            "avx512dq",
            "avx512cd",
            "avx512_vnni",
        }
    ),
}
_ALIASES = {"amx": "avx512"}


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The feature flags the kernel reports for the first CPU (empty where unknown)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def supported_levels() -> tuple[str, ...]:
    """Every level this CPU can run, lowest first (always at least generic)."""
    if not is_x86():
        return ("generic",)
    flags = cpu_flags()
    return tuple(level for level in LEVELS if _REQUIRED[level] <= flags)


def forced_level() -> str | None:
    """SLUICE_CPU_ISA as one of LEVELS (amx means avx512); None when unset. A bad value
    is an error naming the variable (sluice.settings)."""
    value = settings.cpu_isa_override()
    return None if value is None else _ALIASES.get(value, value)


@functools.cache
def level() -> str:
    """The level the kernels run at: the CPU's best, or lower where SLUICE_CPU_ISA says.
    Read once per process (kernels.load() asks on every kernel call of an eager step)."""
    supported = supported_levels()
    best = supported[-1]
    forced = forced_level()
    if forced is None:
        return best
    if forced not in supported:
        logger.warning(
            "SLUICE_CPU_ISA=%s is beyond this CPU (best: %s); using %s", forced, best, best
        )
        return best
    return forced


def available_levels() -> tuple[str, ...]:
    """The levels up to the one in use: what this machine runs under SLUICE_CPU_ISA."""
    return LEVELS[: LEVELS.index(level()) + 1]


def at_least(name: str) -> bool:
    return LEVELS.index(level()) >= LEVELS.index(name)


def has_native_bf16() -> bool:
    """AMX or AVX512-BF16, at a level that may use them: bf16 matmuls several times
    faster than fp32. Without them bf16 is converted in software and fp32 is faster."""
    flags = cpu_flags()
    return at_least("avx512") and ("amx_bf16" in flags or "avx512_bf16" in flags)
