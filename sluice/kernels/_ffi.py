"""The one place sluice speaks ctypes: declared C functions and tensor pointers.

The binding rule: each kernel's binding module (`matmul`, `attention`, `fused`,
`decode_stack`) declares the C functions it calls with `c_function`, next to the wrapper
that takes tensors. `sluice.kernels.load()` applies every declaration to each library
it loads (one per instruction-set level), and tests/test_kernel_bindings.py checks them
against the `extern "C"` prototypes in csrc/*.cpp. Nothing outside sluice/kernels
touches ctypes or raw pointers: it annotates with `Library` and passes tensors.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeAlias

import torch

# A loaded kernel library, one per level (tests hold several at once).
Library: TypeAlias = ctypes.CDLL

# The C types of our entry points, as ctypes names them (the signature test maps the
# C++ prototypes onto these).
POINTER = ctypes.c_void_p  # any T*, const or not; a tensor's data or null
INT = ctypes.c_int
INT64 = ctypes.c_int64
FLOAT = ctypes.c_float
STRING = ctypes.c_char_p  # const char*, returned as bytes


@dataclass(frozen=True, slots=True)
class CFunction:
    """One C entry point's name and signature. `fn(lib, *args)` calls `lib`'s copy,
    so a binding names the function once and works with every level's library."""

    name: str
    restype: type[Any] | None  # None: void
    argtypes: tuple[type[Any], ...]

    def __call__(self, lib: Library, *args: Any) -> Any:
        return getattr(lib, self.name)(*args)


_DECLARED: dict[str, CFunction] = {}


def c_function(name: str, restype: type[Any] | None, *argtypes: type[Any]) -> CFunction:
    """Declare the C function `name` (registered for `apply_declarations`)."""
    fn = CFunction(name, restype, argtypes)
    if _DECLARED.setdefault(name, fn) != fn:
        raise RuntimeError(f"{name} is declared twice, with different signatures")
    return fn


def declared() -> Mapping[str, CFunction]:
    """Every declared C function by name (those of the binding modules imported so
    far; importing `sluice.kernels` imports them all)."""
    return MappingProxyType(_DECLARED)


def apply_declarations(lib: Library) -> None:
    """Set restype and argtypes of every declared function on `lib`: without them
    ctypes would pass Python floats as doubles and truncate 64-bit integers and
    pointers to int. A declared function the library lacks raises AttributeError."""
    for fn in _DECLARED.values():
        c_fn = getattr(lib, fn.name)
        c_fn.restype = fn.restype
        c_fn.argtypes = list(fn.argtypes)


def ptr(t: torch.Tensor) -> int:
    """The address of `t`'s first element (the caller keeps `t` alive and checks its
    layout)."""
    return t.data_ptr()


def ptr_or_null(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def is_bf16(t: torch.Tensor) -> int:
    """The kernels' dtype flag: 1 for bf16, 0 for fp32 (the only two they take)."""
    return int(t.dtype == torch.bfloat16)


# glibc's mallopt parameters
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# After a load: a step's transient tensors (a 64-stream step's logits and sampling
# buffers are 12.6 MB each on SmolLM2's vocabulary, 39 MB on Qwen's) come from the heap
# and stay mapped when freed. With glibc's defaults once the mmap threshold is set
# (which also fixes the trim threshold at 128 KB), each step trimmed the freed top of
# the heap and faulted the pages back in: 1-3 million page faults in a 64-stream run,
# whether it happened depending on what else sat at the top of the heap, and 64-stream
# throughput varied 430-650 tok/s from one process to the next.
_STEADY_MMAP_THRESHOLD = 64 << 20
_STEADY_TRIM_THRESHOLD = 256 << 20


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


@contextlib.contextmanager
def large_allocations_mapped() -> Iterator[None]:
    """While loading a model, allocations of 1 MB and more get their own mappings
    (glibc mallopt), so a freed buffer goes back to the OS at once. Otherwise glibc
    raises its mmap threshold as large buffers are freed (up to 32 MB), serves the
    next ones from the heap, and the freed read buffers and decoded chunks of a load
    interleave with the weights kept: the heap fragments and the peak grew by ~20%
    of the model (Qwen2.5-Coder-1.5B: 2040 -> 1738 MB). Afterwards the freed heap is
    handed back and the thresholds are set for serving (_STEADY_*: steps reuse their
    buffers' pages instead of faulting them in again)."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    try:
        yield
    finally:
        release_freed_heap()
        if mallopt is not None:
            mallopt(_M_MMAP_THRESHOLD, _STEADY_MMAP_THRESHOLD)
            mallopt(_M_TRIM_THRESHOLD, _STEADY_TRIM_THRESHOLD)


def release_freed_heap() -> None:
    """Hand freed heap memory back to the OS (glibc's malloc_trim; a no-op elsewhere)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
