"""What this CPU can run, as instruction-set levels: the kernels are built once per level
and the best one the CPU has is loaded, as ggml and ATen do.

The levels, lowest first: `generic` (the architecture's baseline; on x86-64 plain
x86-64, elsewhere whatever the compiler targets by default), `avx2` (x86-64-v3: AVX2,
FMA, F16C), `avx512` (x86-64-v4 with VNNI) and `amx` (avx512 and Intel's AMX-BF16
tiles, which many-row bf16 matmuls on GGUF weights use; the avx512 library has that
kernel, see sluice.kernels). AMX needs the kernel's leave as well as the CPU's flags:
Linux grants a process the tiles' 8 KB of register state on request (arch_prctl), and
without it a tile instruction kills the process, so the level counts only once the
request succeeded. `SLUICE_CPU_ISA` forces
a lower level, as `ATEN_CPU_CAPABILITY` does for torch, so one machine can test every
path; it never raises the level above what the CPU reports.

Forcing a level also makes the rest of sluice behave as on such a CPU: a level below
avx512 has no native bf16 (dtype auto picks fp32, and bf16 matmuls skip oneDNN's
packed path, which needs AVX-512 or AVX-NE-CONVERT).
"""

from __future__ import annotations

import functools
import logging
import platform

from sluice import settings
from sluice.core.choices import CPU_ISAS

logger = logging.getLogger("sluice")

LEVELS = CPU_ISAS  # lowest first
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
# AMX-BF16 for the bf16 many-row kernel (csrc/qblock_amx.h), AMX-INT8 for the int8
# GEMM's tile path (csrc/qblock_gemm_amx.h): every AMX CPU so far has both.
_REQUIRED["amx"] = _REQUIRED["avx512"] | {"amx_tile", "amx_bf16", "amx_int8", "avx512_bf16"}
# arch_prctl's request for an extended state component (asm/prctl.h), and AMX's tile
# data component (XFEATURE_XTILEDATA).
_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


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
    levels = tuple(level for level in LEVELS if _REQUIRED[level] <= flags)
    if "amx" in levels and not _tile_state_granted():
        logger.info("the CPU has AMX but the kernel did not grant its tile state: avx512")
        return levels[:-1]
    return levels


def _tile_state_granted() -> bool:
    """Ask Linux for AMX's tile state for this process (every thread, as torch's oneDNN
    asks for its own AMX kernels); False where it refuses or the call is unknown."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        args = (_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
        return bool(libc.syscall(*map(ctypes.c_long, args)) == 0)
    except (OSError, AttributeError):
        return False


def forced_level() -> str | None:
    """SLUICE_CPU_ISA as one of LEVELS; None when unset. A bad value is an error naming
    the variable (sluice.settings)."""
    return settings.cpu_isa_override()


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
