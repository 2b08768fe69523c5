"""`sluice bench`: run the repo's benchmark scripts, then summarize and plot their JSON.

The scripts live in `benchmarks/` next to the package (they are not installed), so this
module finds them relative to the checkout. The summary and plot functions take the
loaded JSON dicts, so they work on saved results without re-running anything.

Every comparison in those files is interleaved (`benchmarks/common.py`): each side has
per-round values summarized as median, min-max and quartiles, and the ratio of the
medians; every file carries a `provenance` record (commit, date, CPU, kernel variant).
The summary reports medians with their range, and the plots draw medians with min-max
error bars.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sluice

BENCHMARKS = ("throughput", "single", "serve", "prefix", "quantization")

# Small sizes for a smoke run: minutes on a laptop CPU instead of an hour. Two rounds,
# so the comparisons still interleave and show a spread.
QUICK_ARGS: dict[str, list[str]] = {
    "throughput": "--num-prompts 16 --max-tokens 16 --hf-num-prompts 16 --skip-ready "
    "--rounds 2".split(),
    "serve": "--concurrency 1,4 --num-prompts 2,8 --max-tokens 16 --rounds 2".split(),
    "prefix": "--num-questions 8 --num-conversations 2 --turns 4 --rounds 2".split(),
    "quantization": ["--windows", "2", "--prompts", "2", "--gen-tokens", "16"],
    "single": ["--methods", "int4", "--max-tokens", "16", "--rounds", "2"],
}

_SCRIPTS = {
    "throughput": "throughput.py",
    "serve": "serve.py",
    "prefix": "prefix_cache.py",
    "quantization": "quantization.py",
    "single": "single_stream.py",
}


class BenchError(RuntimeError):
    """A benchmark could not be run or its results could not be read."""


@dataclass(frozen=True)
class BenchRun:
    """One benchmark script invocation and the JSON file it leaves behind."""

    name: str
    argv: list[str]
    result: Path


def benchmarks_dir() -> Path:
    """The checkout's `benchmarks/` folder; absent when sluice was installed from a wheel."""
    path = Path(sluice.__file__).resolve().parents[1] / "benchmarks"
    if not (path / "throughput.py").is_file():
        raise BenchError(
            f"benchmark scripts not found at {path}; `sluice bench` needs a source checkout "
            "of sluice (git clone, then `pip install -e .`)"
        )
    return path


def plan(
    name: str, bench_dir: Path, out_dir: Path, quick: bool = False, extra: list[str] | None = None
) -> BenchRun:
    """The command line for one benchmark and where its JSON will be (`out_dir/<stem>.json`).

    Quick runs write `<stem>_quick.json` so a smoke run never overwrites full results.
    """
    if name not in BENCHMARKS:
        raise BenchError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
    argv = [sys.executable, str(bench_dir / _SCRIPTS[name])]
    if quick:
        argv += QUICK_ARGS[name]
    stem = Path(_SCRIPTS[name]).stem + ("_quick" if quick else "")
    result = out_dir / f"{stem}.json"
    argv += ["--output", str(result)]
    return BenchRun(name, argv + list(extra or []), result)


def run_benchmark(run: BenchRun, cwd: Path) -> dict[str, Any]:
    """Run one script (its output streams to the terminal) and load the JSON it wrote."""
    print(f"== {run.name}: {' '.join(run.argv[1:])}", flush=True)
    # Remove a stale file first, so a crashed run cannot pass off old numbers as new.
    run.result.unlink(missing_ok=True)
    proc = subprocess.run(run.argv, cwd=cwd, check=False)
    if proc.returncode != 0:
        raise BenchError(f"{run.name} benchmark failed with exit status {proc.returncode}")
    return load_result(run.result)


def load_result(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise BenchError(f"cannot read benchmark results {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise BenchError(f"{path}: expected a JSON object")
    if "provenance" not in data:
        raise BenchError(
            f"{path}: no provenance record (written before results were interleaved and "
            "recorded their commit and machine); run the benchmark again"
        )
    return data


def _median(cmp: dict[str, Any], side: str, metric: str) -> float | None:
    s = cmp["summary"].get(side, {}).get(metric)
    return None if s is None or not s.get("n") else s["median"]


def _range(cmp: dict[str, Any], side: str, metric: str) -> list[float] | None:
    s = cmp["summary"].get(side, {}).get(metric)
    return None if s is None or not s.get("n") else [s["min"], s["max"]]


def _ratio(cmp: dict[str, Any], side: str, metric: str) -> float | None:
    ratio: float | None = cmp.get("ratio_of_medians", {}).get(side, {}).get(metric)
    return ratio


_SERVE_METRICS = (
    "errors",
    "output_tok_per_s",
    "requests_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
)


def _throughput_summary(t: dict[str, Any]) -> dict[str, Any]:
    cmp = t["comparison"]
    return {
        "rounds": cmp["rounds"],
        "sluice_tok_s": _median(cmp, "sluice", "tokens_per_s"),
        "sluice_tok_s_range": _range(cmp, "sluice", "tokens_per_s"),
        "transformers_tok_s": _median(cmp, "transformers", "tokens_per_s"),
        "transformers_tok_s_range": _range(cmp, "transformers", "tokens_per_s"),
        "ratio_vs_transformers": _ratio(cmp, "sluice", "tokens_per_s"),
        "cold_start_s": t.get("time_to_ready", {}).get("cold_total_s"),
    }


def _serve_summary(serve: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per concurrency level."""
    rows = []
    for lvl in serve["levels"]:
        cmp = lvl["comparison"]
        ours, peer = cmp["sides"][0], cmp["baseline"]
        row: dict[str, Any] = {
            "concurrency": lvl["concurrency"],
            "num_prompts": lvl["num_prompts"],
            "rounds": cmp["rounds"],
            "output_tok_per_s_range": _range(cmp, ours, "output_tok_per_s"),
        }
        for metric in _SERVE_METRICS:
            row[metric] = _median(cmp, ours, metric)
        if peer is not None:  # llama-server ran side by side: its rate and our ratio
            row["llama_server_tok_per_s"] = _median(cmp, peer, "output_tok_per_s")
            row["llama_server_ttft_p50_ms"] = _median(cmp, peer, "ttft_p50_ms")
            row["llama_server_tpot_p50_ms"] = _median(cmp, peer, "tpot_p50_ms")
            row["vs_llama_server"] = _ratio(cmp, ours, "output_tok_per_s")
        rows.append(row)
    return rows


def _prefix_summary(prefix: dict[str, Any]) -> dict[str, Any]:
    """Per workload: the prefix cache off against on."""
    summary: dict[str, Any] = {}
    for name, w in prefix["workloads"].items():
        cmp = w["comparison"]
        summary[name] = {
            "rounds": cmp["rounds"],
            "ttft_p50_off_s": _median(cmp, "off", "ttft_p50_s"),
            "ttft_p50_on_s": _median(cmp, "on", "ttft_p50_s"),
            "ttft_p99_off_s": _median(cmp, "off", "ttft_p99_s"),
            "ttft_p99_on_s": _median(cmp, "on", "ttft_p99_s"),
            "hit_rate": _median(cmp, "on", "hit_rate"),
            "ttft_p50_speedup": _ratio(cmp, "off", "ttft_p50_s"),
            "total_speedup": _ratio(cmp, "off", "total_s"),
        }
    return summary


def _single_summary(single: dict[str, Any]) -> dict[str, Any]:
    """Per side (a quantization method, or llama.cpp as the baseline)."""
    cmp = single["comparison"]
    return {
        side: {
            "rounds": cmp["rounds"],
            "decode_tok_s": _median(cmp, side, "decode_tokens_per_s"),
            "decode_tok_s_range": _range(cmp, side, "decode_tokens_per_s"),
            "ttft_s": _median(cmp, side, "ttft_s"),
            "vs_llamacpp": 1.0
            if side == cmp["baseline"]
            else _ratio(cmp, side, "decode_tokens_per_s"),
        }
        for side in cmp["sides"]
    }


def _quantization_summary(quantization: dict[str, Any]) -> dict[str, Any]:
    return {
        mode: {
            "perplexity": row.get("perplexity"),
            "top1_agreement_vs_fp32": row.get("top1_agreement_vs_fp32"),
            "greedy_identical_vs_none": row.get("greedy_identical_vs_none"),
        }
        for mode, row in quantization["results"].items()
    }


# Each benchmark's summarizer, in the order the summary lists them.
_SUMMARIZERS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "throughput": _throughput_summary,
    "serve": _serve_summary,
    "prefix": _prefix_summary,
    "single": _single_summary,
    "quantization": _quantization_summary,
}


def summarize(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The headline numbers (medians over rounds, with min-max ranges) of each result present,
    keyed like BENCHMARKS."""
    return {name: fn(results[name]) for name, fn in _SUMMARIZERS.items() if name in results}


def run_info(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per benchmark: the commit, date, CPU and kernel variant its result came from."""
    keys = ("commit", "dirty", "date", "cpu_model", "threads", "kernel_variant", "torch")
    return {
        name: {k: data.get("provenance", {}).get(k) for k in keys} for name, data in results.items()
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, float) for v in value):
        return f"{value[0]:.4g}-{value[1]:.4g}"
    return str(value)


def format_summary(summary: dict[str, Any], runs: dict[str, dict[str, Any]] | None = None) -> str:
    """One plain-text table: benchmark | case | metric | value (medians over rounds)."""
    rows: list[tuple[str, str, str, str]] = []
    for name, info in (runs or {}).items():
        for key, value in info.items():
            rows.append((name, "run", key, _fmt(value)))
    for metric, value in summary.get("throughput", {}).items():
        rows.append(("throughput", "offline", metric, _fmt(value)))
    for lvl in summary.get("serve", []):
        case = f"concurrency={lvl['concurrency']}"
        for metric, value in lvl.items():
            if metric != "concurrency":
                rows.append(("serve", case, metric, _fmt(value)))
    for section in ("single", "prefix", "quantization"):
        for case, metrics in summary.get(section, {}).items():
            for metric, value in metrics.items():
                rows.append((section, case, metric, _fmt(value)))
    header = ("benchmark", "case", "metric", "value")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header]]
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def _figure(width: float = 6.4, height: float = 4.2) -> Any:
    # The object-oriented Figure renders with Agg and never touches pyplot's global
    # state or a display, so this works headless and inside servers/tests.
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise BenchError(
            "plots need matplotlib: pip install matplotlib (or pip install -e '.[dev]')"
        ) from exc
    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def _bar_data(cmp: dict[str, Any], sides: list[str], metric: str) -> tuple[list[float], Any]:
    """Medians and matplotlib's asymmetric yerr (median - min, max - median) per side."""
    meds, lo, hi = [], [], []
    for side in sides:
        s = cmp["summary"][side][metric]
        meds.append(float(s["median"]))
        lo.append(float(s["median"] - s["min"]))
        hi.append(float(s["max"] - s["median"]))
    return meds, [lo, hi]


def plot_throughput(throughput: dict[str, Any], path: Path) -> Path:
    """Bar chart: offline output tokens/s (median, min-max bars), sluice vs transformers."""
    cmp = throughput["comparison"]
    fig = _figure(5.0, 4.0)
    ax = fig.add_subplot()
    sides = list(cmp["sides"])
    values, err = _bar_data(cmp, sides, "tokens_per_s")
    colors = ["tab:blue", "tab:gray"][: len(values)]
    bars = ax.bar(sides, values, yerr=err, capsize=6, color=colors)
    ax.bar_label(bars, fmt="%.1f", label_type="center")
    ax.set_ylabel("output tokens/s")
    title = f"Offline throughput, median of {cmp['rounds']} rounds"
    r = _ratio(cmp, "sluice", "tokens_per_s")
    if r:
        title += f" ({r:.1f}x)"
    ax.set_title(title)
    ax.margins(y=0.15)
    fig.savefig(path)
    return path


def _concurrency_axis(ax: Any, levels: list[int]) -> None:
    # Concurrency levels are usually geometric (1, 16, 64): a log axis spaces them evenly.
    if len(levels) > 1 and min(levels) > 0:
        ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent requests")
    ax.grid(True, alpha=0.3)


def _serve_series(
    serve: dict[str, Any], side: str, metric: str
) -> tuple[list[int], list[float], list[list[float]]]:
    """x, medians and yerr of one side's metric over the levels (sorted by concurrency)."""
    levels = sorted(serve["levels"], key=lambda lvl: lvl["concurrency"])
    xs: list[int] = []
    ys: list[float] = []
    lo: list[float] = []
    hi: list[float] = []
    for lvl in levels:
        s = lvl["comparison"]["summary"].get(side, {}).get(metric)
        if s is None or not s.get("n"):
            continue
        xs.append(int(lvl["concurrency"]))
        ys.append(s["median"])
        lo.append(s["median"] - s["min"])
        hi.append(s["max"] - s["median"])
    return xs, ys, [lo, hi]


def plot_serve(serve: dict[str, Any], out_dir: Path) -> list[Path]:
    """`serve_throughput.png` (output tok/s vs concurrency) and `serve_latency.png`
    (TTFT and TPOT p50/p99 vs concurrency): medians over rounds, min-max error bars."""
    sides = list(serve["levels"][0]["comparison"]["sides"])
    conc = sorted(int(lvl["concurrency"]) for lvl in serve["levels"])

    fig = _figure()
    ax = fig.add_subplot()
    for side in sides:
        xs, ys, err = _serve_series(serve, side, "output_tok_per_s")
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=4, label=side)
    _concurrency_axis(ax, conc)
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Serving throughput ({', '.join(sorted(set(serve.get('models', {}).values())))})")
    ax.set_ylim(bottom=0)
    if len(sides) > 1:
        ax.legend()
    tput = out_dir / "serve_throughput.png"
    fig.savefig(tput)

    fig = _figure(9.0, 4.0)
    for i, metric in enumerate(("ttft", "tpot")):
        ax = fig.add_subplot(1, 2, i + 1)
        for side in sides:
            prefix = f"{side} " if len(sides) > 1 else ""
            for pct, style in (("p50", "-o"), ("p99", "--s")):
                xs, ys, err = _serve_series(serve, side, f"{metric}_{pct}_ms")
                ax.errorbar(xs, ys, yerr=err, fmt=style, capsize=3, label=prefix + pct)
        _concurrency_axis(ax, conc)
        ax.set_ylabel("ms")
        ax.set_title(metric.upper())
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.suptitle("Serving latency (medians over rounds)")
    lat = out_dir / "serve_latency.png"
    fig.savefig(lat)
    return [tput, lat]


def plot_prefix(prefix: dict[str, Any], path: Path) -> Path:
    """Grouped bars per workload: TTFT p50/p99 with the prefix cache off vs on
    (medians over rounds, min-max error bars)."""
    workloads = list(prefix["workloads"].items())
    fig = _figure(max(5.0, 3.2 * len(workloads)), 4.2)
    ax = fig.add_subplot()
    series = [
        ("p50 off", "off", "ttft_p50_s", "tab:gray"),
        ("p50 on", "on", "ttft_p50_s", "tab:blue"),
        ("p99 off", "off", "ttft_p99_s", "silver"),
        ("p99 on", "on", "ttft_p99_s", "lightsteelblue"),
    ]
    width = 0.8 / len(series)
    for i, (label, mode, key, color) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(workloads))]
        meds, lo, hi = [], [], []
        for _, w in workloads:
            (m,), ((a,), (b,)) = _bar_data(w["comparison"], [mode], key)
            meds.append(m)
            lo.append(a)
            hi.append(b)
        bars = ax.bar(xs, meds, width, yerr=[lo, hi], capsize=3, label=label, color=color)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, label_type="center")
    ax.set_xticks(range(len(workloads)), [name for name, _ in workloads])
    ax.set_ylabel("time to first token (s)")
    ax.set_title("Prefix cache: TTFT off vs on")
    ax.legend()
    ax.margins(y=0.12)
    fig.savefig(path)
    return path


def plot_all(results: dict[str, dict[str, Any]], out_dir: Path) -> list[Path]:
    """Every plot the present results allow; returns the PNG paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    if "throughput" in results:
        paths.append(plot_throughput(results["throughput"], out_dir / "throughput.png"))
    if "serve" in results and results["serve"].get("levels"):
        paths += plot_serve(results["serve"], out_dir)
    if "prefix" in results and results["prefix"].get("workloads"):
        paths.append(plot_prefix(results["prefix"], out_dir / "prefix_cache.png"))
    return paths


def write_summary(results: dict[str, dict[str, Any]], out_dir: Path) -> Path:
    """`summary.json`: the headline numbers plus the run each one came from."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "summary.json"
    payload = {
        "provenance": {name: r.get("provenance") for name, r in results.items()},
        "summary": summarize(results),
    }
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def run(
    which: str = "all",
    out_dir: Path | None = None,
    quick: bool = False,
    extra: list[str] | None = None,
    no_run: bool = False,
) -> int:
    """Run the chosen benchmarks (or, with no_run, reuse their saved JSON), then print
    the summary table and write summary.json and the PNGs. Returns an exit status."""
    bench_dir = benchmarks_dir()
    names = list(BENCHMARKS) if which == "all" else [which]
    if extra and len(names) > 1:
        # The scripts take different flags; passing one set to all of them would fail.
        raise BenchError("extra arguments after `--` need a single benchmark, not `all`")
    out = (out_dir or bench_dir / "results").resolve()
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    failed: list[str] = []
    for name in names:
        step = plan(name, bench_dir, out, quick=quick, extra=extra)
        try:
            if no_run:
                if not step.result.is_file():
                    print(f"sluice bench: no saved {name} results ({step.result})", file=sys.stderr)
                    continue
                results[name] = load_result(step.result)
            else:
                results[name] = run_benchmark(step, bench_dir.parent)
        except BenchError as exc:
            # Keep going: one broken benchmark should not throw away the others' numbers.
            print(f"sluice bench: {exc}", file=sys.stderr)
            failed.append(name)
    if not results:
        print("sluice bench: no results to summarize", file=sys.stderr)
        return 1
    print()
    print(format_summary(summarize(results), run_info(results)))
    written = [write_summary(results, out), *plot_all(results, out)]
    print()
    for path in written:
        print(f"wrote {path}")
    return 1 if failed else 0
