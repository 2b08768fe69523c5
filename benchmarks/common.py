"""Shared helpers for the benchmark scripts: percentiles, tables, machine info, JSON results."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; NaN if empty."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass  # no /proc/cpuinfo: report the model as unknown
    return platform.processor() or platform.machine()


def _cpu_flags() -> list[str]:
    # Only the flags that change which kernels (and dtype) are fast on this CPU.
    interesting = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma"}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return sorted(interesting & set(line.split(":", 1)[1].split()))
    except OSError:
        pass  # no /proc/cpuinfo: report no flags
    return []


def machine_info() -> dict[str, Any]:
    """What a reader needs to compare two result files: CPU, cores, load, versions, date."""
    import torch

    try:
        load = list(os.getloadavg())
    except OSError:
        load = []
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count() or 0
    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cpu_flags": _cpu_flags(),
        "cpu_count": os.cpu_count(),
        "cpus_available": affinity,
        "torch_threads": torch.get_num_threads(),
        # A busy machine makes every number here pessimistic; record how busy it was.
        "load_average": load,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "argv": sys.argv,
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info


def write_result(name: str, payload: dict[str, Any]) -> Path:
    """Write `benchmarks/results/<name>.json` (machine info added) and return the path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    data = {"benchmark": name, "machine": machine_info(), **payload}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)  # atomic: a reader never sees half a file
    return path


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], left: int = 1) -> str:
    """Plain-text table: the first `left` columns left-aligned (labels), the rest right-aligned."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
        return str(v)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.ljust(w) if i < left else v.rjust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep, *(line(r) for r in cells)])


def ratio(a: float, b: float) -> float:
    """a / b, or NaN when b is zero (so a missing baseline never crashes the report)."""
    return a / b if b else float("nan")


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """The engine options a benchmark may override (unset: the engine's defaults)."""
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--kv-cache-memory", type=float, default=None, help="GiB")
    ap.add_argument(
        "--quantization",
        default=None,
        choices=["auto", "none", "int8", "int4"],
        help="weight-only quantization (default: the engine's, auto)",
    )


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    # Only pass what was set, so the engine's own defaults are what gets measured.
    opts: dict[str, Any] = {"dtype": args.dtype}
    for key in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "quantization"):
        value = getattr(args, key)
        if value is not None:
            opts[key] = value
    return opts
