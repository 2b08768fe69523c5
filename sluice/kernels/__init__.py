"""Our CPU kernels: C++ compiled once per machine and instruction-set level with the
system compiler, loaded with ctypes. No torch headers, so a build takes seconds.

Variants: the same sources are built with explicit flags for each level in
`sluice.kernels.cpu.LEVELS` (generic, avx2, avx512), never `-march=native`, and the
best level the CPU has is loaded (`SLUICE_CPU_ISA` forces a lower one). The `amx` level
runs the avx512 library and lets many-row bf16 matmuls take its AMX kernel (`tiles()`,
csrc/qblock_amx.h), compiled in with function target attributes: a library of its own
would cost a whole build (over a minute on 2 cores) for one kernel. The cached .so
is named by its level and a hash of compiler, flags and sources, so a home directory
shared between machines never loads a kernel built for another CPU.

They link OpenMP, and at load time bind to the libgomp torch has already loaded, so
kernels and torch ops share one thread pool instead of fighting over the cores.

Sources (csrc/): the kernels live in headers, each with a .cpp of C entry points:
paged_attention (decode attention over the block pool), q4_matmul and q8_matmul
(4-bit and 8-bit weight x int8 activation matmuls for small batches), qblock (GGUF
block-quantized weights kept quantized: matmuls, dequantization, embedding rows; its
many-row GEMMs in qblock_gemm, int8 VNNI, and qblock_amx, bf16 AMX tiles), qpanel
(K-quant expert stacks stored in the int8 GEMM's panel order, one kernel for every
row count) and
fused_ops (RMSNorm with the residual add, rotary, SiLU-and-multiply), lora (each row's
LoRA adapter product, gathered by its slot), gguf_repack (a GGUF file's blocks into
the qblock layout, at load); kv_int8.h is the int8 KV cache's row format (quantized
writes; the attention kernel widens its rows).
decode_stack.cpp runs a whole Llama decoder stack on them in one call, for decode steps.
isa.h says which level a build is; every kernel has a path for each.
SLUICE_CPU_KERNELS=0 turns them all off (torch's ops are used instead).

Bindings: one Python module per kernel (matmul, qblock, qpanel, attention, fused, lora,
decode_stack, repack) declares its C functions' signatures next to wrappers that take and
return tensors;
`load()` applies them all (_ffi.py). ctypes and raw pointers stay inside this package:
callers hold a `Library` and pass tensors.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch  # noqa: F401  (loads libgomp first, so the kernels bind to torch's copy)
from filelock import FileLock

from sluice import settings

# The binding modules, one per kernel: importing them declares their C functions, which
# `_build` applies to every library it loads.
from sluice.kernels import (
    attention,
    cpu,
    decode_stack,
    fused,
    lora,
    matmul,
    qblock,
    qpanel,
    repack,
)
from sluice.kernels._ffi import (
    STRING,
    Library,
    apply_declarations,
    c_function,
    large_allocations_mapped,
    release_freed_heap,
)
from sluice.settings import cache_dir

__all__ = [
    "Library",
    "active_level",
    "attention",
    "build",
    "built_level",
    "cpu",
    "decode_stack",
    "fused",
    "large_allocations_mapped",
    "level_in_use",
    "library_level",
    "load",
    "lora",
    "matmul",
    "qblock",
    "qpanel",
    "release_freed_heap",
    "repack",
    "tiles",
    "use_variant",
    "variant",
]

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
# Levels that run another level's library.
_LIBRARY_OF = {"amx": "avx512"}
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None  # _compiler_pool()
_pool_lock = threading.Lock()  # not _lock: load() holds that while it builds
_libs: dict[str, Library | None] = {}
_override: str | None = None  # use_variant()

# The level a library was compiled for (isa.h's SLUICE_ISA_NAME), defined in q4_matmul.cpp.
_VARIANT = c_function("sluice_variant", STRING)


def built_level(lib: Library) -> str:
    """The instruction-set level `lib` was compiled for, as it reports it."""
    name: bytes = _VARIANT(lib)
    return name.decode()


def _flags(level: str) -> list[str]:
    return [*_COMMON_FLAGS, *(_X86_FLAGS[level] if cpu.is_x86() else [])]


def _compiler_pool() -> ThreadPoolExecutor:
    """One compiler process per core for the whole process: levels built at once
    (`build()`) queue their sources here instead of each starting a process per core."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1)
        return _pool


def _compile(cxx: str, flags: list[str], tmp: Path, so: Path) -> str | None:
    """Each source to an object on the compiler pool (qblock.cpp, which holds the one
    copy of the qblock entry points that decode_stack.cpp calls too, is the longest at
    avx512, the rest seconds; the largest files start first), then one link.
    Returns the compiler's messages on failure."""
    sources = sorted(_SOURCES, key=lambda src: -src.stat().st_size)
    objects = [tmp / f"{src.stem}.o" for src in sources]

    def run(command: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(command, capture_output=True, text=True)

    commands = [
        [cxx, *flags, "-c", str(s), "-o", str(o)] for s, o in zip(sources, objects, strict=True)
    ]
    steps = list(_compiler_pool().map(run, commands))
    if all(step.returncode == 0 for step in steps):
        steps.append(run([cxx, *flags, *map(str, objects), "-o", str(so)]))
    failed = [step.stderr for step in steps if step.returncode != 0]
    return "\n".join(failed) if failed else None


def _compile_into(cxx: str, flags: list[str], level: str, out: Path) -> bool:
    """Compile `level`'s library to `out` (whole or not at all); False, with a warning
    naming the compiler's messages, if it fails."""
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        error = _compile(cxx, flags, Path(tmp), tmp_so)
        if error is not None:
            logger.warning("building CPU kernels (%s) failed, using torch ops:\n%s", level, error)
            return False
        os.replace(tmp_so, out)
    return True


def _build(level: str) -> Library | None:
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
        # Processes starting together (test workers, data-parallel replicas) build a
        # level once: the others wait here and load what the first wrote.
        with FileLock(out.with_name(out.name + ".lock")):
            if not out.exists() and not _compile_into(cxx, flags, level, out):
                return None
    lib = Library(str(out))
    apply_declarations(lib)
    built = built_level(lib)
    if built != level:  # the compiler ignored a flag: never run what we did not ask for
        logger.warning("CPU kernels built for %s report %s; using torch ops", level, built)
        return None
    return lib


def load(level: str | None = None) -> Library | None:
    """The kernel library for `level` (default: the active one, see `variant()`),
    building it on first use; None if kernels are off or cannot be built."""
    if not settings.cpu_kernels_enabled():
        return None
    level = level or active_level()
    if level not in cpu.supported_levels():
        raise ValueError(f"this CPU cannot run the {level} kernels")
    level = library_level(level)
    if level not in _libs:
        with _lock:
            if level not in _libs:
                try:
                    _libs[level] = _build(level)
                except OSError as e:
                    logger.warning("loading CPU kernels failed, using torch ops: %s", e)
                    _libs[level] = None
                if _libs[level] is not None and level == library_level(active_level()):
                    logger.info(
                        "CPU kernels: %s (this CPU supports: %s)",
                        active_level(),
                        ", ".join(cpu.supported_levels()),
                    )
    return _libs[level]


def build(levels: list[str] | None = None) -> dict[str, bool]:
    """Build (or find cached) the libraries of `levels` (default: every level this
    process runs, cpu.available_levels()) at once, their sources sharing the compiler
    pool: what `make test` does first, so test workers load the kernels of every level
    instead of each compiling them. Returns whether each library level built."""
    supported = cpu.supported_levels()
    for level in levels or ():
        if level not in supported:
            raise ValueError(f"this CPU cannot run the {level} kernels (it runs {supported})")
    wanted_levels = levels or cpu.available_levels()
    # The slowest build (the highest level) queues its sources first.
    wanted = [x for x in reversed(supported) if x in wanted_levels]
    wanted = list(dict.fromkeys(library_level(x) for x in wanted))
    with ThreadPoolExecutor(max_workers=len(wanted)) as pool:
        libs = list(pool.map(_build, wanted))
    return {x: lib is not None for x, lib in zip(wanted, libs, strict=True)}


def library_level(level: str) -> str:
    """The level whose library `level` runs (itself, but avx512 for amx)."""
    return _LIBRARY_OF.get(level, level)


def active_level() -> str:
    """The level in use: use_variant()'s, else the CPU's (or SLUICE_CPU_ISA's)."""
    return _override or cpu.level()


def variant() -> str:
    """The instruction-set level the library in use was built for (avx512 at the amx
    level), or "off" when none load. What the kernels' row-count crossovers key on."""
    lib = load()
    return "off" if lib is None else built_level(lib)


def level_in_use() -> str:
    """The level our kernels run at (amx included), or "off" when none load: what the
    engine reports (/stats, /metrics) and benchmarks record."""
    return "off" if load() is None else active_level()


def tiles(lib: Library | None = None) -> bool:
    """Whether GGUF weights' matmuls may run on AMX tiles (many bf16 rows on
    qblock.qblock_amx; the int8 GEMM and the head's first level on AMX-INT8 tiles): at
    the amx level, on `lib` (default: the one in use) if it has those paths."""
    lib = lib if lib is not None else load()
    return lib is not None and active_level() == "amx" and qblock.has_amx(lib)


def build_id() -> str:
    """The kernels in use as built: their file's name, which holds the level and a digest
    of compiler, flags and sources ("off" when none load). Anything measured of the
    kernels and cached (the speculator's step costs) keys on it: a kernel change must
    not be judged by the table of the code before it."""
    lib = load()
    return "off" if lib is None else Path(lib._name).name + ("+amx" if tiles() else "")


@contextlib.contextmanager
def use_variant(level: str) -> Iterator[Library | None]:
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
