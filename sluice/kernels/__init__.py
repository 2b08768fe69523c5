"""Our CPU kernels: C++ compiled once per machine and instruction-set level with the
system compiler, loaded with ctypes. No torch headers, so a build takes seconds.

Variants: the same sources are built with explicit flags for each level in
`sluice.kernels.cpu.LEVELS` (generic, avx2, avx512), never `-march=native`, and the
best level the CPU has is loaded (`SLUICE_CPU_ISA` forces a lower one). The cached .so
is named by its level and a hash of compiler, flags and sources, so a home directory
shared between machines never loads a kernel built for another CPU.

They link OpenMP, and at load time bind to the libgomp torch has already loaded, so
kernels and torch ops share one thread pool instead of fighting over the cores.

Sources (csrc/): the kernels live in headers, each with a .cpp of C entry points:
paged_attention (decode attention over the block pool), q4_matmul and q8_matmul
(4-bit and 8-bit weight x int8 activation matmuls for small batches) and fused_ops
(RMSNorm with the residual add, rotary, SiLU-and-multiply). decode_stack.cpp runs a
whole Llama decoder stack on them in one call, for decode steps. isa.h says which
level a build is; every kernel has a path for each.
SLUICE_CPU_KERNELS=0 turns them all off (torch's ops are used instead).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import torch  # noqa: F401  (loads libgomp first, so the kernels bind to torch's copy)

from sluice.kernels import cpu
from sluice.settings import cache_dir

logger = logging.getLogger("sluice")

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = sorted(_CSRC.glob("*.cpp"))
_HEADERS = sorted(_CSRC.glob("*.h"))
_COMMON_FLAGS = ["-O3", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
# Explicit targets per level (x86-64 micro-architecture levels), never -march=native.
_X86_FLAGS = {
    "generic": ["-march=x86-64", "-mtune=generic"],
    "avx2": ["-march=x86-64-v3", "-mtune=generic"],
    "avx512": ["-march=x86-64-v4", "-mavx512vnni", "-mtune=generic"],
}
_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}
_override: str | None = None  # use_variant()


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    for name in ("sluice_paged_attention_f32", "sluice_paged_attention_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i32, i32, i32, i32, i32, f32, i64]
        fn.restype = None
    lib.sluice_attention_vectorized.argtypes = [i32]
    lib.sluice_attention_vectorized.restype = i32
    lib.sluice_write_kv.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, i64, i32, i32, i32, i32]
    lib.sluice_write_kv.restype = None
    lib.sluice_q4_matmul.argtypes = [ptr, i32, i32, i32, ptr, ptr, ptr, i32, ptr]
    lib.sluice_q4_matmul.restype = None
    lib.sluice_q8_matmul.argtypes = [ptr, i32, i32, i32, ptr, ptr, i32, ptr]
    lib.sluice_q8_matmul.restype = None
    lib.sluice_variant.argtypes = []
    lib.sluice_variant.restype = ctypes.c_char_p
    lib.sluice_add_rms_norm.argtypes = [i32, ptr, ptr, ptr, ptr, i64, i32, f32]
    lib.sluice_rotary.argtypes = [i32, ptr, i64, i64, i32, i32, ptr, ptr]
    lib.sluice_silu_and_mul.argtypes = [i32, ptr, ptr, i64, i32]
    for name in ("sluice_add_rms_norm", "sluice_rotary", "sluice_silu_and_mul"):
        getattr(lib, name).restype = None
    lib.sluice_fused_max_dim.argtypes = []
    lib.sluice_fused_max_dim.restype = i32
    lib.sluice_decode_stack_fields.argtypes = []
    lib.sluice_decode_stack_fields.restype = i32
    lib.sluice_decode_stack.argtypes = [i32, i32, ptr, *[i32] * 7, f32, f32, ptr, ptr, ptr, i32]
    lib.sluice_decode_stack.argtypes += [ptr, ptr, i64, ptr, ptr, i32]
    lib.sluice_decode_stack.restype = None


def _flags(level: str) -> list[str]:
    return [*_COMMON_FLAGS, *(_X86_FLAGS[level] if cpu.is_x86() else [])]


def _build(level: str) -> ctypes.CDLL | None:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        logger.warning("no C++ compiler found: sluice's CPU kernels are off (torch ops instead)")
        return None
    flags = _flags(level)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256("\0".join([cxx, version, *flags]).encode())
    for src in _SOURCES + _HEADERS:
        digest.update(src.read_bytes())
    out = cache_dir() / "kernels" / f"sluice-kernels-{level}-{digest.hexdigest()[:16]}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_so = Path(tmp) / out.name
            proc = subprocess.run(
                [cxx, *flags, *map(str, _SOURCES), "-o", str(tmp_so)],
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                logger.warning("building CPU kernels (%s) failed, using torch ops:\n%s", level,
                               proc.stderr)
                return None
            os.replace(tmp_so, out)
    lib = ctypes.CDLL(str(out))
    _declare(lib)
    built = lib.sluice_variant().decode()
    if built != level:  # the compiler ignored a flag: never run what we did not ask for
        logger.warning("CPU kernels built for %s report %s; using torch ops", level, built)
        return None
    return lib


def load(level: str | None = None) -> ctypes.CDLL | None:
    """The kernel library for `level` (default: the active one, see `variant()`),
    building it on first use; None if kernels are off or cannot be built."""
    if os.environ.get("SLUICE_CPU_KERNELS", "1") == "0":
        return None
    level = level or _override or cpu.level()
    if level not in _libs:
        with _lock:
            if level not in _libs:
                if level not in cpu.supported_levels():
                    raise ValueError(f"this CPU cannot run the {level} kernels")
                try:
                    _libs[level] = _build(level)
                except OSError as e:
                    logger.warning("loading CPU kernels failed, using torch ops: %s", e)
                    _libs[level] = None
                if _libs[level] is not None and level == (_override or cpu.level()):
                    logger.info("CPU kernels: %s (this CPU supports: %s)", level,
                                ", ".join(cpu.supported_levels()))
    return _libs[level]


def variant() -> str:
    """The instruction-set level of the kernels in use, or "off" when none load."""
    lib = load()
    return "off" if lib is None else lib.sluice_variant().decode()


@contextlib.contextmanager
def use_variant(level: str) -> Iterator[ctypes.CDLL | None]:
    """Make `load()` return the `level` kernels while in the block (for tests that run
    every level this CPU supports in one process). Layers pick their kernels when the
    model is built, so build the model inside the block."""
    global _override
    saved = _override
    _override = level
    try:
        yield load(level)
    finally:
        _override = saved
