"""Our CPU kernels: C++ compiled once per machine with the system compiler, loaded with
ctypes. No torch headers, so a build takes about a second; the .so is cached.

They link OpenMP, and at load time bind to the libgomp torch has already loaded, so
kernels and torch ops share one thread pool instead of fighting over the cores.
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

import torch

from sluice.loader.resolve import cache_dir

logger = logging.getLogger("sluice")

_SRC = Path(__file__).with_name("csrc") / "paged_attention.cpp"
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed = False


def _build() -> ctypes.CDLL | None:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        logger.warning("no C++ compiler found: CPU decode attention falls back to SDPA")
        return None
    src = _SRC.read_bytes()
    key = hashlib.sha256(src + " ".join([cxx, *_FLAGS]).encode()).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"paged_attention-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_so = Path(tmp) / out.name
            proc = subprocess.run(
                [cxx, *_FLAGS, str(_SRC), "-o", str(tmp_so)], capture_output=True, text=True
            )
            if proc.returncode != 0:
                logger.warning("building CPU kernels failed, using SDPA:\n%s", proc.stderr)
                return None
            os.replace(tmp_so, out)
    lib = ctypes.CDLL(str(out))
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    for name in ("sluice_paged_attention_f32", "sluice_paged_attention_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i32, i32, i32, i32, i32, f32]
        fn.restype = None
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
                    logger.warning("loading CPU kernels failed, using SDPA: %s", e)
                _failed = _lib is None
    return _lib


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    return dtype in (torch.float32, torch.bfloat16) and head_dim <= 256


def paged_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [num_queries, heads, d], contiguous
    k_cache: torch.Tensor,  # [blocks, block_size, kv_heads, d], contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int64, contiguous
    query_start: torch.Tensor,  # [S + 1] int64: sequence s owns queries qs[s] .. qs[s+1]-1
    ctx_end: torch.Tensor,  # [S] int64: context length seen by each sequence's last query
    scale: float,
) -> torch.Tensor:
    heads, d = q.shape[1], q.shape[2]
    out = torch.empty_like(q)
    bf16 = q.dtype == torch.bfloat16
    fn = lib.sluice_paged_attention_bf16 if bf16 else lib.sluice_paged_attention_f32
    fn(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        query_start.data_ptr(),
        ctx_end.data_ptr(),
        out.data_ptr(),
        block_tables.shape[0],
        heads,
        k_cache.shape[2],
        d,
        k_cache.shape[1],
        scale,
    )
    return out
