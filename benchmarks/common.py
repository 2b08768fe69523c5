"""Shared helpers for the benchmark scripts.

- `interleave` runs the sides of a comparison in alternating rounds, and `compare`
  turns those rounds into medians, spreads and ratios of medians: every script that
  compares two systems (or two settings) goes through these two, so no comparison
  depends on which side ran while the machine was fast.
- `provenance` is the record of where and on what a result was measured (commit, date,
  CPU and its flags, torch, threads, kernel variant); `write_result` stores it with
  every result JSON.
- percentiles, plain-text tables and the engine options shared by the scripts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

REPO_ROOT = Path(__file__).resolve().parent.parent
# Scratch output (gitignored). Results that docs/benchmarks.md cites live in docs/results/.
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
DOC_RESULTS_DIR = REPO_ROOT / "docs" / "results"

# When this process started: a result's date is when its measurement began.
STARTED = datetime.datetime.now(datetime.UTC)

# CPU flags that decide which of our kernels (and which dtype) can run fast.
KERNEL_CPU_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
)
# Environment variables that change which kernels or how many threads run.
_ENV_KEYS = ("SLUICE_CPU_ISA", "SLUICE_CPU_KERNELS", "OMP_NUM_THREADS", "ATEN_CPU_CAPABILITY")

T = TypeVar("T")


# ---- statistics ------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; NaN if empty."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ratio(a: float, b: float) -> float:
    """a / b, or NaN when b is zero (so a missing baseline never crashes the report)."""
    return a / b if b else float("nan")


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max and quartiles of one metric over rounds (NaN values dropped)."""
    xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not xs:
        nan = float("nan")
        return {"median": nan, "min": nan, "max": nan, "q1": nan, "q3": nan, "n": 0}
    return {
        "median": statistics.median(xs),
        "min": min(xs),
        "max": max(xs),
        "q1": percentile(xs, 25),
        "q3": percentile(xs, 75),
        "n": len(xs),
    }


# ---- interleaved comparisons -----------------------------------------------------------------


def round_order(sides: Sequence[str], k: int) -> list[str]:
    """Order of the sides in round k: as given in even rounds, reversed in odd ones.

    A B, B A, A B, ...: with a fixed order, a machine that speeds up or slows down
    steadily would favour whichever side runs second; alternating cancels that.
    """
    return list(sides) if k % 2 == 0 else list(reversed(sides))


def interleave(
    sides: Sequence[str], rounds: int, measure: Callable[[str], T], label: str = ""
) -> dict[str, list[T]]:
    """Run `measure(side)` for every side in each of `rounds` rounds, interleaved.

    Round k measures every side once (in `round_order`) before round k + 1 starts, so
    the machine's drift (shared cores: up to 2x over minutes) lands on all sides alike.
    Returns each side's measurements in round order.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if len(set(sides)) != len(sides) or not sides:
        raise ValueError(f"sides must be distinct and non-empty: {list(sides)}")
    runs: dict[str, list[T]] = {side: [] for side in sides}
    prefix = f"{label}: " if label else ""
    for k in range(rounds):
        for side in round_order(sides, k):
            print(f"{prefix}round {k + 1}/{rounds}, {side} ...", flush=True)
            runs[side].append(measure(side))
    return runs


def compare(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    metrics: Sequence[str],
    baseline: str | None = None,
) -> dict[str, Any]:
    """Medians and spreads per side and metric, and each side's ratio of medians to baseline.

    `runs` is what `interleave` returned, each measurement a dict holding every metric.
    The result (stored as is in the JSON) keeps the per-round values, so a reader can
    recompute anything from it.
    """
    sides = list(runs)
    if baseline is not None and baseline not in runs:
        raise ValueError(f"baseline {baseline!r} is not one of {sides}")
    rounds = max((len(rs) for rs in runs.values()), default=0)
    values = {
        side: {m: [float(r[m]) if r.get(m) is not None else math.nan for r in rs] for m in metrics}
        for side, rs in runs.items()
    }
    summary = {side: {m: spread(vs) for m, vs in per.items()} for side, per in values.items()}
    ratios: dict[str, dict[str, float]] = {}
    if baseline is not None:
        base = summary[baseline]
        ratios = {
            side: {m: ratio(summary[side][m]["median"], base[m]["median"]) for m in metrics}
            for side in sides
            if side != baseline
        }
    return {
        "sides": sides,
        "baseline": baseline,
        "rounds": rounds,
        "order": [round_order(sides, k) for k in range(rounds)],
        "runs": values,
        "summary": summary,
        "ratio_of_medians": ratios,
    }


def fmt_spread(s: Mapping[str, float], scale: float = 1.0, digits: int = 1) -> str:
    """'median (min–max)', values times scale; just the median for a single round."""
    if not s or s.get("n", 0) == 0:
        return "-"
    med = f"{s['median'] * scale:,.{digits}f}"
    if s["n"] < 2:
        return med
    return f"{med} ({s['min'] * scale:,.{digits}f}–{s['max'] * scale:,.{digits}f})"


def add_rounds_arg(ap: argparse.ArgumentParser, default: int = 3) -> None:
    ap.add_argument(
        "--rounds",
        type=int,
        default=default,
        help="interleaved rounds (each runs every side once; medians and spreads reported)",
    )


# ---- provenance ------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass  # no /proc/cpuinfo: fall back to what platform knows
    return platform.processor() or platform.machine()


# AMD's Zen generations by CPU family (and, for family 25, model): /proc/cpuinfo's
# "model name" is sometimes only "AMD EPYC" in a VM, which says neither.
_AMD_FAMILIES = {23: "Zen/Zen 2", 26: "Zen 5"}
_ZEN4_MODELS = (range(0x10, 0x20), range(0x60, 0x80), range(0xA0, 0xB0))


def _cpu_identity() -> dict[str, Any]:
    """Vendor, family, model and stepping numbers, and the microarchitecture they name
    where we know it (AMD Zen generations; None otherwise)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("vendor_id", "cpu family", "model", "stepping") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip():
                    break  # the first processor's block is enough
    except OSError:
        return {}
    ident: dict[str, Any] = {"vendor": fields.get("vendor_id")}
    for key, name in (("cpu family", "family"), ("model", "model"), ("stepping", "stepping")):
        ident[name] = int(fields[key]) if fields.get(key, "").isdigit() else None
    uarch = None
    if ident["vendor"] == "AuthenticAMD":
        family, model = ident["family"], ident["model"] or 0
        if family == 25:
            uarch = "Zen 4" if any(model in r for r in _ZEN4_MODELS) else "Zen 3"
        else:
            uarch = _AMD_FAMILIES.get(family)
    ident["microarchitecture"] = uarch
    return ident


def _cpu_flags() -> list[str]:
    """The CPU flags our kernels care about (KERNEL_CPU_FLAGS and every amx_*), sorted."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    wanted = set(KERNEL_CPU_FLAGS) | {x for x in flags if x.startswith("amx")}
                    return sorted(flags & wanted)
    except OSError:
        pass  # no /proc/cpuinfo: report no flags
    return []


def _git(*args: str, env: Mapping[str, str] | None = None) -> str | None:
    """git's output in the repo, or None where git or the repo is missing or it failed."""
    try:
        proc = subprocess.run(
            ["git", "-C", str(REPO_ROOT), *args],
            capture_output=True,
            text=True,
            timeout=30,
            env=None if env is None else {**os.environ, **env},
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _git_state() -> dict[str, Any]:
    """The commit the benchmark code and sluice came from, whether tracked files differ,
    and the tree of the files as they are."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {
        "commit": commit,
        "dirty": None if status is None else bool(status),
        "tree": _files_tree() if commit else None,
    }


def _files_tree() -> str | None:
    """The git tree of the tracked files as they are on disk (written through a scratch
    index: the repo's own is untouched), equal to `git rev-parse C^{tree}` for the
    commit C whose files ran. It names the code where HEAD cannot: a copy whose .git is
    older than its files (the device tool's, for one) or a dirty tree."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        if _git("read-tree", "HEAD", env=env) is None or _git("add", "-u", env=env) is None:
            return None
        return _git("write-tree", env=env)


def result_commit(prov: Mapping[str, Any]) -> str | None:
    """The commit whose files a result ran: the one its provenance names when the tree
    was clean, else the commit in this repo's history whose tree is the result's `tree`
    (a run from a copy whose .git is older than its files); None where neither holds."""
    if prov.get("dirty") is False:
        return prov.get("commit")
    tree = prov.get("tree")
    if not tree:
        return None
    for line in (_git("log", "--all", "--format=%H %T") or "").splitlines():
        commit, _, commit_tree = line.partition(" ")
        if commit_tree == tree:
            return commit
    return None


def _command_line() -> list[str]:
    """sys.argv with the script as a repo-relative path, so the command can be re-run."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(".py"):
        script = Path(argv[0]).resolve()
        if script.is_relative_to(REPO_ROOT):
            argv[0] = script.relative_to(REPO_ROOT).as_posix()
    return argv


def kernel_variant() -> str:
    """The CPU kernel level sluice runs with here ('amx', 'avx512', 'avx2', 'generic',
    'off')."""
    import sluice.kernels

    return sluice.kernels.level_in_use()


def provenance(
    threads: int | None = None, started: datetime.datetime | None = None
) -> dict[str, Any]:
    """Where and on what a result was measured: the one record every result JSON carries.

    threads: the threads the measured engine used, when that is not this process's torch
    setting (serve.py measures a server in another process). started: when the
    measurement began (default: when this process started).
    """
    import torch

    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = []
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:
        available = os.cpu_count() or 0
    try:
        import transformers

        transformers_version: str | None = transformers.__version__
    except ImportError:
        transformers_version = None
    when = started or STARTED
    return {
        **_git_state(),
        "date": when.astimezone(datetime.UTC).isoformat(timespec="seconds"),
        "finished": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_model": _cpu_model(),
        "cpu": _cpu_identity(),
        "cpu_flags": _cpu_flags(),
        "cpu_count": os.cpu_count(),
        "cpus_available": available,
        "threads": threads if threads is not None else torch.get_num_threads(),
        "kernel_variant": kernel_variant(),
        "torch": torch.__version__,
        "transformers": transformers_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "env": {k: os.environ[k] for k in _ENV_KEYS if k in os.environ},
        # A busy machine makes every number pessimistic; record how busy it was at the end.
        "load_average": load,
        "argv": _command_line(),
    }


_GGML_ISA_OPTIONS = ("GGML_AVX", "GGML_NATIVE", "GGML_FMA", "GGML_F16C", "GGML_BMI2", "GGML_AMX")


def llama_cpp_build(binary: Path) -> dict[str, Any]:
    """What a llama.cpp peer was built from and for: its `--version` (commit, compiler),
    the instruction-set options of its CMake cache (the build directory above `bin/`),
    and the level they make ("avx512", "avx2", "native", "generic")."""
    build: dict[str, Any] = {"binary": str(binary)}
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
        build["version"] = (out.stdout + out.stderr).strip().splitlines()[:2]
    except (OSError, subprocess.TimeoutExpired) as exc:
        build["version"] = [f"unknown ({exc})"]
    options: dict[str, str] = {}
    cache = Path(binary).resolve().parent.parent / "CMakeCache.txt"
    if cache.is_file():
        for line in cache.read_text(errors="replace").splitlines():
            name, _, value = line.partition("=")
            key = name.split(":", 1)[0]
            if key.startswith(_GGML_ISA_OPTIONS) or key in ("CMAKE_BUILD_TYPE", "CMAKE_C_FLAGS"):
                options[key] = value
    build["cmake"] = options
    on = {k for k, v in options.items() if v.upper() in ("ON", "TRUE", "1")}
    if "GGML_NATIVE" in on:
        build["isa"] = "native"
    elif "GGML_AVX512" in on:
        build["isa"] = "avx512"
    elif "GGML_AVX2" in on:
        build["isa"] = "avx2"
    else:
        build["isa"] = "generic" if options else "unknown"
    return build


# ---- result files ----------------------------------------------------------------------------


DOCS_RESULTS = REPO_ROOT / "docs" / "results"


def output_path(value: str) -> Path:
    """--output's type: a result for docs/results/ (the figures the docs cite) must be
    measured from a clean, committed tree, so its provenance names the code it ran;
    refused at start, before the run. (Write elsewhere to measure work in progress.)"""
    path = Path(value)
    if path.resolve().is_relative_to(DOCS_RESULTS.resolve()):
        state = _git_state()
        if state["dirty"] is not False:
            raise argparse.ArgumentTypeError(
                f"{value} is under docs/results/, whose results come from a clean committed "
                "tree (their provenance names the commit); `git status` shows what differs: "
                "commit it, or write the result elsewhere"
            )
    return path


def add_output_arg(ap: argparse.ArgumentParser, kind: str) -> None:
    ap.add_argument(
        "--output",
        type=output_path,
        default=RESULTS_DIR / f"{kind}.json",
        help=f"result JSON (default: benchmarks/results/{kind}.json, gitignored; results that "
        "docs/benchmarks.md cites go to docs/results/)",
    )


def write_result(
    kind: str, payload: dict[str, Any], output: Path | None = None, threads: int | None = None
) -> Path:
    """Write the result JSON (provenance added) to `output` and return its path.

    kind names the benchmark ("throughput", "serve", ...): docs/benchmarks.md's
    generator picks the table by it, whatever the file is called.
    """
    path = output or RESULTS_DIR / f"{kind}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"benchmark": kind, "provenance": provenance(threads), **payload}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)  # atomic: a reader never sees half a file
    return path


def shown_path(path: Path) -> str:
    """path relative to the repo root when it is inside it (for messages)."""
    path = path.resolve()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


# ---- tables and engine options ---------------------------------------------------------------


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


# ---- requests --------------------------------------------------------------------------------


def chat_ids(tok: Any, text: str) -> list[int]:
    """`text` as one user turn through the tokenizer's chat template, as token ids."""
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    return list(tok.encode(rendered, add_special_tokens=False))


def tpot(out: Any) -> float | None:
    """A finished RequestOutput's time per output token after the first (None when it
    has fewer than two tokens or no timings)."""
    m, n = out.metrics, len(out.outputs[0].token_ids)
    if m is None or m.first_token_time is None or m.finished_time is None or n < 2:
        return None
    return (m.finished_time - m.first_token_time) / (n - 1)
