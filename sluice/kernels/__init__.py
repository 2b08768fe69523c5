"""Our CPU kernels: C++ compiled once per machine with the system compiler, loaded with
ctypes. No torch headers, so a build takes seconds; the .so is cached by a hash of the
sources and flags.

They link OpenMP, and at load time bind to the libgomp torch has already loaded, so
kernels and torch ops share one thread pool instead of fighting over the cores.

Sources (csrc/): the kernels live in headers, each with a .cpp of C entry points:
paged_attention (decode attention over the block pool), q4_matmul and q8_matmul
(4-bit and 8-bit weight x int8 activation matmuls for small batches) and fused_ops
(RMSNorm with the residual add, rotary, SiLU-and-multiply). decode_stack.cpp runs a
whole Llama decoder stack on them in one call, for decode steps.
SLUICE_CPU_KERNELS=0 turns them all off (torch's ops are used instead).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch  # noqa: F401  (loads libgomp first, so the kernels bind to torch's copy)

from sluice.loader.resolve import cache_dir

logger = logging.getLogger("sluice")

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = sorted(_CSRC.glob("*.cpp"))
_HEADERS = sorted(_CSRC.glob("*.h"))
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed = False


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    for name in ("sluice_paged_attention_f32", "sluice_paged_attention_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i32, i32, i32, i32, i32, f32, i64]
        fn.restype = None
    lib.sluice_write_kv.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, i64, i32, i32, i32, i32]
    lib.sluice_write_kv.restype = None
    lib.sluice_q4_matmul.argtypes = [ptr, i32, i32, i32, ptr, ptr, ptr, i32, ptr]
    lib.sluice_q4_matmul.restype = None
    lib.sluice_q8_matmul.argtypes = [ptr, i32, i32, i32, ptr, ptr, i32, ptr]
    lib.sluice_q8_matmul.restype = None
    lib.sluice_q4_matmul_available.argtypes = []
    lib.sluice_q4_matmul_available.restype = i32
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


def _build() -> ctypes.CDLL | None:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        logger.warning("no C++ compiler found: sluice's CPU kernels are off (torch ops instead)")
        return None
    digest = hashlib.sha256(" ".join([cxx, *_FLAGS]).encode())
    for src in _SOURCES + _HEADERS:
        digest.update(src.read_bytes())
    out = cache_dir() / "kernels" / f"sluice-kernels-{digest.hexdigest()[:16]}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_so = Path(tmp) / out.name
            proc = subprocess.run(
                [cxx, *_FLAGS, *map(str, _SOURCES), "-o", str(tmp_so)],
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                logger.warning("building CPU kernels failed, using torch ops:\n%s", proc.stderr)
                return None
            os.replace(tmp_so, out)
    lib = ctypes.CDLL(str(out))
    _declare(lib)
    return lib


def load() -> ctypes.CDLL | None:
    """The kernel library, building it on first use; None if it cannot be built."""
    global _lib, _failed
    if _lib is None and not _failed and os.environ.get("SLUICE_CPU_KERNELS", "1") != "0":
        with _lock:
            if _lib is None and not _failed:
                try:
                    _lib = _build()
                except OSError as e:
                    logger.warning("loading CPU kernels failed, using torch ops: %s", e)
                _failed = _lib is None
    return _lib
