"""`sluice bench`: run the repo's benchmark scripts, then summarize and plot their JSON.

The scripts live in `benchmarks/` next to the package (they are not installed), so this
module finds them relative to the checkout. The summary and plot functions take the
loaded JSON dicts, so they work on saved results without re-running anything.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sluice

BENCHMARKS = ("throughput", "single", "serve", "prefix", "quantization")

# Small sizes for a smoke run: minutes on a laptop CPU instead of an hour.
QUICK_ARGS: dict[str, list[str]] = {
    "throughput": "--num-prompts 16 --max-tokens 16 --hf-num-prompts 16 --skip-ready".split(),
    "serve": ["--concurrency", "1,4", "--num-prompts", "2,8", "--max-tokens", "16"],
    "prefix": ["--num-questions", "8", "--num-conversations", "2", "--turns", "4"],
    "quantization": ["--windows", "2", "--prompts", "2", "--gen-tokens", "16"],
    "single": ["--methods", "int4", "--max-tokens", "16", "--repeats", "1"],
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
    """The command line for one benchmark and where its JSON will be.

    Quick runs write `<name>_quick.json` so a smoke run never overwrites full results.
    """
    if name not in BENCHMARKS:
        raise BenchError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
    argv = [sys.executable, str(bench_dir / _SCRIPTS[name])]
    if quick:
        argv += QUICK_ARGS[name]
    results = bench_dir / "results"
    stem = {"prefix": "prefix_cache", "single": "single_stream"}.get(name, name) + (
        "_quick" if quick else ""
    )
    if name == "serve":
        # serve.py is the only script that takes an output path.
        result = out_dir / f"{stem}.json"
        argv += ["--output", str(result)]
    elif name == "quantization":
        # quantization.py always writes results/quantization.json.
        result = results / "quantization.json"
    else:
        result = results / f"{stem}.json"
        argv += ["--name", stem]
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
    return data


def summarize(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The headline numbers of each benchmark result present, keyed like BENCHMARKS."""
    summary: dict[str, Any] = {}
    if "throughput" in results:
        t = results["throughput"]
        single = t.get("single_stream", {})
        summary["throughput"] = {
            "sluice_tok_s": t["sluice"]["tokens_per_s"],
            "transformers_tok_s": t.get("transformers", {}).get("tokens_per_s"),
            "ratio_vs_transformers": t.get("ratio_vs_transformers"),
            "single_stream_tok_s": single.get("decode_tokens_per_s"),
            "single_stream_ttft_s": single.get("ttft_s"),
            "cold_start_s": t.get("time_to_ready", {}).get("cold_total_s"),
        }
    if "serve" in results:
        keys = (
            "concurrency",
            "num_prompts",
            "errors",
            "output_tok_per_s",
            "requests_per_s",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "tpot_p50_ms",
            "tpot_p99_ms",
        )
        serve = results["serve"]
        summary["serve"] = [{k: lvl.get(k) for k in keys} for lvl in serve["levels"]]
        # llama-server, when serve.py ran it side by side: its rate and our ratio per level.
        peer = {lvl["concurrency"]: lvl for lvl in serve.get("llama_server", {}).get("levels", [])}
        for row in summary["serve"]:
            theirs = peer.get(row["concurrency"])
            if theirs is not None:
                row["llama_server_tok_per_s"] = theirs["output_tok_per_s"]
                row["llama_server_ttft_p50_ms"] = theirs["ttft_p50_ms"]
                row["llama_server_tpot_p50_ms"] = theirs["tpot_p50_ms"]
                row["vs_llama_server"] = row["output_tok_per_s"] / theirs["output_tok_per_s"]
    if "prefix" in results:
        summary["prefix"] = {
            name: {
                "ttft_p50_off_s": w["off"]["ttft_p50_s"],
                "ttft_p50_on_s": w["on"]["ttft_p50_s"],
                "ttft_p99_off_s": w["off"]["ttft_p99_s"],
                "ttft_p99_on_s": w["on"]["ttft_p99_s"],
                "hit_rate": w["on"]["hit_rate"],
                "total_speedup": w.get("total_ratio"),
            }
            for name, w in results["prefix"]["workloads"].items()
        }
    if "single" in results:
        single = results["single"]
        lc = single.get("llamacpp")
        summary["single"] = {
            label: {
                "decode_tok_s": r["decode_tokens_per_s"],
                "ttft_s": r["ttft_s"],
                "vs_llamacpp": (r["decode_tokens_per_s"] / lc["decode_tokens_per_s"])
                if lc
                else None,
            }
            for label, r in single["sluice"].items()
        }
        if lc:
            summary["single"]["llama.cpp"] = {
                "decode_tok_s": lc["decode_tokens_per_s"],
                "ttft_s": lc["ttft_s"],
                "vs_llamacpp": 1.0,
            }
    if "quantization" in results:
        summary["quantization"] = {
            mode: {
                "perplexity": row.get("perplexity"),
                "top1_agreement_vs_fp32": row.get("top1_agreement_vs_fp32"),
                "single_stream_tok_s": row.get("single_stream_tok_s"),
            }
            for mode, row in results["quantization"]["results"].items()
        }
    return summary


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_summary(summary: dict[str, Any]) -> str:
    """One plain-text table: benchmark | case | metric | value."""
    rows: list[tuple[str, str, str, str]] = []
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


def plot_throughput(throughput: dict[str, Any], path: Path) -> Path:
    """Bar chart: offline output tokens/s, sluice vs the transformers baseline."""
    fig = _figure(5.0, 4.0)
    ax = fig.add_subplot()
    labels = ["sluice"]
    values = [float(throughput["sluice"]["tokens_per_s"])]
    if "transformers" in throughput:
        labels.append("transformers")
        values.append(float(throughput["transformers"]["tokens_per_s"]))
    bars = ax.bar(labels, values, color=["tab:blue", "tab:gray"][: len(values)])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("output tokens/s")
    title = "Offline throughput"
    if throughput.get("ratio_vs_transformers"):
        title += f" ({throughput['ratio_vs_transformers']:.1f}x transformers)"
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


def plot_serve(serve: dict[str, Any], out_dir: Path) -> list[Path]:
    """`serve_throughput.png` (output tok/s vs concurrency) and `serve_latency.png`
    (TTFT and TPOT p50/p99 vs concurrency)."""
    systems = [("sluice", serve["levels"])]
    if serve.get("llama_server", {}).get("levels"):
        systems.append(("llama-server", serve["llama_server"]["levels"]))
    series = [(name, sorted(lv, key=lambda lvl: lvl["concurrency"])) for name, lv in systems]
    conc = [int(lvl["concurrency"]) for lvl in series[0][1]]

    fig = _figure()
    ax = fig.add_subplot()
    for name, levels in series:
        xs = [int(lvl["concurrency"]) for lvl in levels]
        ax.plot(xs, [lvl["output_tok_per_s"] for lvl in levels], marker="o", label=name)
    _concurrency_axis(ax, conc)
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Serving throughput ({serve.get('model', 'model')})")
    ax.set_ylim(bottom=0)
    if len(series) > 1:
        ax.legend()
    tput = out_dir / "serve_throughput.png"
    fig.savefig(tput)

    fig = _figure(9.0, 4.0)
    for i, metric in enumerate(("ttft", "tpot")):
        ax = fig.add_subplot(1, 2, i + 1)
        for name, levels in series:
            xs = [int(lvl["concurrency"]) for lvl in levels]
            prefix = f"{name} " if len(series) > 1 else ""
            for pct, style in (("p50", "-o"), ("p99", "--s")):
                ys = [lvl[f"{metric}_{pct}_ms"] for lvl in levels]
                ax.plot(xs, ys, style, label=prefix + pct)
        _concurrency_axis(ax, conc)
        ax.set_ylabel("ms")
        ax.set_title(metric.upper())
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.suptitle("Serving latency")
    lat = out_dir / "serve_latency.png"
    fig.savefig(lat)
    return [tput, lat]


def plot_prefix(prefix: dict[str, Any], path: Path) -> Path:
    """Grouped bars per workload: TTFT p50/p99 with the prefix cache off vs on."""
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
        bars = ax.bar(xs, [w[mode][key] for _, w in workloads], width, label=label, color=color)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
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
    """`summary.json`: the headline numbers plus which machine they came from."""
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = next((r["machine"] for r in results.values() if "machine" in r), None)
    path = out_dir / "summary.json"
    payload = {"machine": machine, "summary": summarize(results)}
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
                # serve.json lands in the out dir; the other scripts write to results/.
                saved = [step.result, bench_dir / "results" / step.result.name]
                found = next((p for p in saved if p.is_file()), None)
                if found is None:
                    print(f"sluice bench: no saved {name} results ({step.result})", file=sys.stderr)
                    continue
                step = BenchRun(step.name, step.argv, found)
                results[name] = load_result(found)
            else:
                results[name] = run_benchmark(step, bench_dir.parent)
        except BenchError as exc:
            # Keep going: one broken benchmark should not throw away the others' numbers.
            print(f"sluice bench: {exc}", file=sys.stderr)
            failed.append(name)
            continue
        copy = out / step.result.name
        if step.result.resolve() != copy:
            shutil.copyfile(step.result, copy)  # out dir holds the raw JSON next to the plots
    if not results:
        print("sluice bench: no results to summarize", file=sys.stderr)
        return 1
    print()
    print(format_summary(summarize(results)))
    written = [write_summary(results, out), *plot_all(results, out)]
    print()
    for path in written:
        print(f"wrote {path}")
    return 1 if failed else 0
