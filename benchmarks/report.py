"""Regenerate the result tables in docs/benchmarks.md from the JSON in docs/results/.

docs/benchmarks.md is hand-written prose around generated blocks:

    <!-- results: throughput -->
    (generated: one table row per case of every docs/results/*.json of that benchmark)
    <!-- /results -->

The name after `results:` is a benchmark kind (the `benchmark` field that
`common.write_result` stores): throughput, single_stream, serve, prefix_cache, kv_offload,
quantization, cpu_levels, gguf_models, weight_paths, structured, speculative, kv_cache,
pd_disagg, scale_out, tensor_parallel, swa_pool. Every
row names its result file, machine (CPU model, threads), kernel variant, commit and
date, so no figure in the doc stands without the run behind it; tests/test_bench.py
checks that the committed doc equals what this script generates.

Run from the repo root:
    .venv/bin/python benchmarks/report.py            # rewrite docs/benchmarks.md
    .venv/bin/python benchmarks/report.py --check    # exit 1 if it is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import difflib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.common import DOC_RESULTS_DIR, REPO_ROOT, fmt_spread, result_commit  # noqa: E402

DOC = REPO_ROOT / "docs" / "benchmarks.md"
BLOCK = re.compile(r"(<!-- results: (\w+) -->\n)(.*?)(<!-- /results -->)", re.DOTALL)
EMPTY = "_No committed results yet._\n"

Result = tuple[str, dict[str, Any]]  # (file name, loaded JSON)
Row = list[str]


class ReportError(ValueError):
    """A result file or a marker in the doc that the generator cannot use."""


def load_results(directory: Path = DOC_RESULTS_DIR) -> list[Result]:
    """Every benchmark result JSON in `directory`, sorted by file name (none if it is absent).

    JSON files without a `benchmark` field (a `sluice bench` summary.json) are skipped;
    a result without provenance is an error: it cannot say where its figures came from.
    """
    if not directory.is_dir():
        return []
    results: list[Result] = []
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or "benchmark" not in data:
            continue
        if "provenance" not in data:
            raise ReportError(f"{path}: no provenance record; re-run the benchmark")
        results.append((path.name, data))
    return results


# ---- cells -----------------------------------------------------------------------------------


def _run_cells(name: str, data: dict[str, Any]) -> Row:
    """The columns every row starts with: result file, machine, kernel variant, commit, date."""
    p = data["provenance"]
    clean = result_commit(p)  # a device's copy: its files' commit, from `tree`
    commit = clean[:10] if clean else (p.get("commit") or "unknown")[:10] + "+dirty"
    date = (p.get("date") or "?")[:16].replace("T", " ")
    uarch = (p.get("cpu") or {}).get("microarchitecture")
    cpu = f"{p.get('cpu_model', '?')} ({uarch})" if uarch else p.get("cpu_model", "?")
    machine = f"{cpu}, {p.get('threads', '?')} threads"
    return [f"[{name}](results/{name})", machine, p.get("kernel_variant", "?"), commit, date]


RUN_HEADERS = ["result", "machine", "kernels", "commit", "date (UTC)"]


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}×"


def _table(headers: Sequence[str], rows: Sequence[Row]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _runs_list(results: Sequence[Result]) -> str:
    """Under each table: how each result was produced, and on which CPU flags and torch."""
    lines = []
    for name, data in results:
        p = data["provenance"]
        argv = p.get("argv") or []
        command = ".venv/bin/python " + shlex.join(argv) if argv else "unknown command"
        flags = " ".join(p.get("cpu_flags") or []) or "none recorded"
        lines.append(
            f"- `{name}`: `{command}`; torch {p.get('torch', '?')}; CPU flags: {flags}"
            + (f"; env {p['env']}" if p.get("env") else "")
        )
    return "\n".join(lines) + "\n"


def _spread(
    cmp: dict[str, Any], side: str, metric: str, scale: float = 1.0, digits: int = 1
) -> str:
    return fmt_spread(cmp["summary"].get(side, {}).get(metric, {}), scale, digits)


def _rmed(cmp: dict[str, Any], side: str, metric: str) -> float | None:
    return cmp.get("ratio_of_medians", {}).get(side, {}).get(metric)


def _pair(cmp: dict[str, Any], ours: str, peer: str | None, metric: str, digits: int) -> str:
    """'ours / peer' for one metric (just ours when nothing ran beside it)."""
    mine = _spread(cmp, ours, metric, digits=digits)
    return mine if peer is None else f"{mine} / {_spread(cmp, peer, metric, digits=digits)}"


def _arrow(cmp: dict[str, Any], metric: str, scale: float, digits: int) -> str:
    """'off → on' for one metric of a prefix-cache comparison."""
    off = _spread(cmp, "off", metric, scale, digits)
    return f"{off} → {_spread(cmp, 'on', metric, scale, digits)}"


def _cell(r: dict[str, Any], key: str, fmt: Callable[[float], str]) -> str:
    return fmt(r[key]) if r.get(key) is not None else "–"


# ---- one table per benchmark kind ------------------------------------------------------------


def _throughput(results: Sequence[Result]) -> str:
    rows = []
    for name, d in results:
        cmp, w = d["comparison"], d["workload"]
        prompts = str(w["num_prompts"])
        if w.get("hf_num_prompts") is not None:
            prompts += f" (transformers {w['hf_num_prompts']}, bs {w['hf_batch_size']})"
        rows.append(
            [
                *_run_cells(name, d),
                f"{prompts} × {w['max_tokens']}",
                _spread(cmp, "sluice", "tokens_per_s"),
                _spread(cmp, "transformers", "tokens_per_s"),
                _ratio(_rmed(cmp, "sluice", "tokens_per_s")),
                str(cmp["rounds"]),
            ]
        )
    headers = ["prompts × output tokens", "sluice tok/s", "transformers tok/s", "ratio", "rounds"]
    return _table(RUN_HEADERS + headers, rows)


def _single_stream(results: Sequence[Result]) -> str:
    rows = []
    for name, d in results:
        cmp = d["comparison"]
        for side in cmp["sides"]:
            info = d["systems"][side]
            if info["kind"] == "sluice":
                label = f"sluice {side} ({info['dtype']})"
            else:
                label = f"llama.cpp {info['version']} ({info['model']})"
            vs = _ratio(_rmed(cmp, side, "decode_tokens_per_s"))
            rows.append(
                [
                    *_run_cells(name, d),
                    label,
                    _spread(cmp, side, "decode_tokens_per_s"),
                    _spread(cmp, side, "ttft_s", 1e3, 0),
                    "1.00×" if side == cmp["baseline"] else vs,
                    str(cmp["rounds"]),
                ]
            )
    headers = ["system", "decode tok/s", "TTFT ms", "vs llama.cpp", "rounds"]
    return _table(RUN_HEADERS + headers, rows)


def _serve(results: Sequence[Result]) -> str:
    rows = []
    for name, d in results:
        for lvl in d["levels"]:
            cmp = lvl["comparison"]
            ours, peer = cmp["sides"][0], cmp["baseline"]
            label = "" if ours == "sluice" else f"{ours}: "  # --url: some other server
            rows.append(
                [
                    *_run_cells(name, d),
                    f"{lvl['concurrency']} ({lvl['num_prompts']} prompts)",
                    label + _spread(cmp, ours, "output_tok_per_s"),
                    "-" if peer is None else _spread(cmp, peer, "output_tok_per_s"),
                    _ratio(_rmed(cmp, ours, "output_tok_per_s")),
                    _pair(cmp, ours, peer, "ttft_p50_ms", 0),
                    _pair(cmp, ours, peer, "tpot_p50_ms", 1),
                    str(cmp["rounds"]),
                ]
            )
    headers = [
        "streams",
        "sluice tok/s",
        "llama-server tok/s",
        "ratio",
        "TTFT p50 ms (sluice / llama-server)",
        "TPOT p50 ms (sluice / llama-server)",
        "rounds",
    ]
    return _table(RUN_HEADERS + headers, rows)


def _prefix_cache(results: Sequence[Result]) -> str:
    rows = []
    for name, d in results:
        for workload, w in d["workloads"].items():
            cmp = w["comparison"]
            rows.append(
                [
                    *_run_cells(name, d),
                    f"{workload}: {w['num_requests']} requests, {w['num_streams']} streams, "
                    f"concurrency {w['concurrency']}",
                    _arrow(cmp, "ttft_p50_s", 1e3, 0),
                    _ratio(_rmed(cmp, "off", "ttft_p50_s")),
                    _arrow(cmp, "ttft_p99_s", 1e3, 0),
                    _arrow(cmp, "total_s", 1.0, 1),
                    _spread(cmp, "on", "hit_rate", 100.0) + " %",
                    str(cmp["rounds"]),
                ]
            )
    headers = [
        "workload",
        "TTFT p50 ms off → on",
        "p50 off/on",
        "TTFT p99 ms off → on",
        "total s off → on",
        "hit rate",
        "rounds",
    ]
    return _table(RUN_HEADERS + headers, rows)


def _kv_offload(results: Sequence[Result]) -> str:
    rows = []
    for name, d in results:
        rep, rp = d["repeat"], d["replay"]
        rows.append(
            [
                *_run_cells(name, d),
                str(rep["prompt_tokens"]),
                f"{_spread(rep, 'ram', 'ttft_s', 1e3, 0)} → "
                f"{_spread(rep, 'disk', 'ttft_s', 1e3, 0)}",
                _ratio(_rmed(rep, "disk", "ttft_s")),
                f"{rp['num_requests']} requests, {d['config']['kv_blocks']} RAM blocks",
                f"{_spread(rp, 'ram', 'cached_token_fraction', 100.0)} → "
                f"{_spread(rp, 'disk', 'cached_token_fraction', 100.0)} %",
                str(rep["rounds"]),
            ]
        )
    headers = [
        "prompt tokens",
        "TTFT ms recompute → disk",
        "disk/recompute",
        "chat replay",
        "not recomputed, RAM → RAM + disk",
        "rounds",
    ]
    return _table(RUN_HEADERS + headers, rows)


def _quantization(results: Sequence[Result]) -> str:
    rows = []
    for name, d in results:
        n = d.get("config", {}).get("prompts")

        def identical(x: float, n: int | None = n) -> str:
            return f"{round(x * n)}/{n}" if n else f"{x:.1%}"

        for method, r in d["results"].items():
            rows.append(
                [
                    *_run_cells(name, d),
                    method,
                    _cell(r, "perplexity", lambda x: f"{x:.2f}"),
                    _cell(r, "top1_agreement_vs_fp32", lambda x: f"{x:.1%}"),
                    _cell(r, "greedy_identical_vs_none", identical),
                    _cell(r, "greedy_mean_common_prefix", lambda x: f"{x:.1f}"),
                ]
            )
    headers = ["method", "perplexity", "top-1 vs fp32", "greedy identical", "mean common prefix"]
    return _table(RUN_HEADERS + headers, rows)


def _cpu_levels(results: Sequence[Result]) -> str:
    rows = []
    for name, d in results:
        cmp = d["comparison"]
        top = cmp["baseline"]
        for level in cmp["sides"]:
            vs_top = 1.0 if level == top else _rmed(cmp, level, "sluice_tok_s")
            rows.append(
                [
                    *_run_cells(name, d),
                    level,
                    _spread(cmp, level, "sluice_tok_s"),
                    _spread(cmp, level, "llamacpp_tok_s"),
                    _spread(cmp, level, "ratio_to_llamacpp", digits=2),
                    f"{_ratio(vs_top)} of {top}",
                    str(cmp["rounds"]),
                ]
            )
    headers = [
        "level",
        "sluice tok/s",
        "llama.cpp tok/s",
        "sluice / llama.cpp",
        "vs best",
        "rounds",
    ]
    return _table(RUN_HEADERS + headers, rows)


def _weight_paths(results: Sequence[Result]) -> str:
    """Many streams per weight path: GGUF blocks as stored against a dense copy."""
    rows = []
    for name, d in results:
        cmp = d["comparison"]
        base = cmp["baseline"]
        for side in cmp["sides"]:
            vs = 1.0 if side == base else _rmed(cmp, side, "tokens_per_s")
            rows.append(
                [
                    *_run_cells(name, d),
                    side,
                    d["dtype"][side],
                    _mib(d["weight_bytes"][side]),
                    _spread(cmp, side, "tokens_per_s"),
                    f"{_ratio(vs)} of {base}",
                    str(cmp["rounds"]),
                ]
            )
    headers = ["weights", "dtype", "weight MiB", "output tok/s", "ratio", "rounds"]
    return _table(RUN_HEADERS + headers, rows)


def _mib(x: float | None) -> str:
    return "–" if x is None else f"{x / 2**20:,.0f}"


def _gguf_memory(results: Sequence[Result]) -> str:
    rows = []
    for name, d in results:
        for alias, m in d["models"].items():
            for system, s in m.get("memory", {}).items():
                rows.append(
                    [
                        *_run_cells(name, d),
                        f"{alias} ({m['gguf']})",
                        system,
                        _mib(m["file_bytes"]),
                        _mib(s["baseline_rss"]),
                        _mib(s["peak_rss"]),
                        _mib(s["peak_minus_baseline"]),
                        f"{_mib(s['kv_bytes'])} ({s['kv_tokens']:,} tokens)",
                        _mib(s.get("weight_bytes")),
                        f"{s['ratio_to_file']:.2f}",
                    ]
                )
    headers = [
        "model",
        "system",
        "file MiB",
        "baseline RSS MiB",
        "peak RSS MiB",
        "peak − baseline",
        "KV MiB",
        "weights MiB",
        "(peak − baseline − KV) / file",
    ]
    return _table(RUN_HEADERS + headers, rows) if rows else ""


def _gguf_speed(results: Sequence[Result]) -> str:
    rows = []
    for name, d in results:
        for alias, m in d["models"].items():
            if "speed" not in m:
                continue
            cmp = m["speed"]["comparison"]
            # Older results did not record llama.cpp's level: it was the machine's own.
            peer_isa = m["speed"].get("llamacpp_isa", {})
            for level in cmp["sides"]:
                rows.append(
                    [
                        *_run_cells(name, d),
                        alias,
                        f"{level} ({m['speed']['dtype'][level]})",
                        _spread(cmp, level, "sluice_tok_s"),
                        peer_isa.get(level) or "this CPU's",
                        _spread(cmp, level, "llamacpp_tok_s"),
                        _spread(cmp, level, "ratio_to_llamacpp", digits=2),
                        str(cmp["rounds"]),
                    ]
                )
    headers = [
        *("model", "level", "sluice tok/s", "llama.cpp built for", "llama.cpp tok/s"),
        *("sluice / llama.cpp", "rounds"),
    ]
    return _table(RUN_HEADERS + headers, rows) if rows else ""


def _ppl(p: dict[str, Any] | None) -> str:
    return "–" if p is None else f"{p['perplexity']:.3f} ± {p['stderr']:.3f}"


def _gguf_perplexity(results: Sequence[Result]) -> str:
    rows = []
    for name, d in results:
        for alias, m in d["models"].items():
            if "perplexity" not in m:
                continue
            p = m["perplexity"]
            ours, peer = p["systems"]["sluice"], p["systems"].get("llama.cpp")
            same = peer is not None and peer["tokens_sha256"] == ours["tokens_sha256"]
            rows.append(
                [
                    *_run_cells(name, d),
                    alias,
                    f"{p['chunks']} × {p['ctx']} ({ours['scored_tokens']:,} scored)",
                    f"{ours['quantization']}, {ours['dtype']}",
                    _ppl(ours),
                    _ppl(peer),
                    "yes" if same else "–",
                ]
            )
    headers = ["model", "chunks", "sluice weights", "sluice ppl", "llama.cpp ppl", "same tokens"]
    return _table(RUN_HEADERS + headers, rows) if rows else ""


def _gguf_models(results: Sequence[Result]) -> str:
    """Issue 13: memory, then decode speed per level, then perplexity (each when it ran)."""
    tables = [t(results) for t in (_gguf_memory, _gguf_speed, _gguf_perplexity)]
    return "\n".join(t for t in tables if t)


def _structured(results: Sequence[Result]) -> str:
    """Schema compliance, then TPOT constrained against free per level, then forced tokens."""
    compliance, tpot, forced = [], [], []
    for name, d in results:
        c = d.get("compliance")
        if c:
            cp = c["compile"]
            compliance.append(
                [
                    *_run_cells(name, d),
                    f"{c['valid']} / {c['compiled']} / {c['total']}",
                    f"{c['length']} (max_tokens {c['max_tokens']})",
                    str(c["invalid"]),
                    f"{cp['p50_ms']:.2f} / {cp['p99_ms']:.1f}",
                ]
            )
        for lvl in d.get("tpot", []):
            cmp = lvl["comparison"]
            tpot.append(
                [
                    *_run_cells(name, d),
                    f"{lvl['concurrency']} ({lvl['num_prompts']} requests)",
                    _spread(cmp, "constrained", "tpot_p50_ms", digits=2),
                    _spread(cmp, "free", "tpot_p50_ms", digits=2),
                    _ratio(_rmed(cmp, "constrained", "tpot_p50_ms")),
                    _ratio(_rmed(cmp, "constrained", "decode_step_p50_ms")),
                    str(cmp["rounds"]),
                ]
            )
        f = d.get("forced")
        if f:
            forced.append(
                [
                    *_run_cells(name, d),
                    f"{len(f['requests'])}",
                    f"{f['tokens']} ({f['forced']} forced)",
                    str(f["steps"]),
                    f"{f['tokens_per_step']:.2f}",
                ]
            )
    tables = []
    if compliance:
        headers = [
            "valid / compiled / schemas",
            "hit max_tokens",
            "invalid",
            "compile ms p50 / p99",
        ]
        tables.append(_table(RUN_HEADERS + headers, compliance))
    if tpot:
        headers = [
            "streams",
            "TPOT p50 ms constrained",
            "TPOT p50 ms free",
            "ratio",
            "decode step p50, ratio",
            "rounds",
        ]
        tables.append(_table(RUN_HEADERS + headers, tpot))
    if forced:
        headers = ["requests", "output tokens", "steps", "tokens per forward pass"]
        tables.append(_table(RUN_HEADERS + headers, forced))
    return "\n".join(tables)


def _speculative(results: Sequence[Result]) -> str:
    """Per workload and level, each side's output tok/s against `off` and its time per
    output token after the first (where prefill dominates tok/s, TPOT shows the
    decode gain) (issue 14)."""
    rows = []
    for name, d in results:
        model = d["model"] + (f" (draft {d['draft_model']})" if d.get("draft_model") else "")
        for lvl in d["levels"]:
            cmp = lvl["comparison"]
            for side in cmp["sides"]:
                rows.append(
                    [
                        *_run_cells(name, d),
                        model,
                        f"{lvl['workload']}, {lvl['streams']}",
                        side,
                        _spread(cmp, side, "tok_s"),
                        "1.00×" if side == "off" else _ratio(_rmed(cmp, side, "tok_s")),
                        _spread(cmp, side, "tpot_p50_ms", digits=1),
                        _spread(cmp, side, "acceptance", digits=2),
                        _spread(cmp, side, "tokens_per_verify", digits=2),
                        _spread(cmp, side, "same_tokens", digits=2),
                    ]
                )
    headers = [
        "model",
        "workload, streams",
        "side",
        "output tok/s",
        "vs off",
        "TPOT p50 ms",
        "acceptance",
        "tokens / verify",
        "same tokens",
    ]
    return _table(RUN_HEADERS + headers, rows)


def _kv_cache(results: Sequence[Result]) -> str:
    acc_rows, speed_rows = [], []
    for name, d in results:
        cfg, cap = d.get("config", {}), d["capacity"]
        dtype = cfg.get("dtype", "?")
        acc = d.get("accuracy")
        if acc:
            a, q = acc["auto"], acc["int8"]
            n = cfg.get("prompts")
            ident = q.get("greedy_identical")
            acc_rows.append(
                [
                    *_run_cells(name, d),
                    dtype,
                    f"{cfg.get('windows')} × {cfg.get('window')}",
                    f"{a['perplexity']:.3f} → {q['perplexity']:.3f} "
                    f"({q['perplexity'] / a['perplexity'] - 1:+.2%})",
                    f"{q['mean_kld_vs_auto']:.5f}",
                    f"{q['top1_agreement_vs_auto']:.1%}",
                    "–" if ident is None else f"{round(ident * n)}/{n}" if n else f"{ident:.0%}",
                    _cell(q, "greedy_mean_common_prefix", lambda x: f"{x:.1f}"),
                ]
            )
        for streams, sp in d.get("speed", {}).items():
            speed_rows.append(
                [
                    *_run_cells(name, d),
                    dtype,
                    f"{streams} × {cfg.get('context')}",
                    " / ".join(f"{cap[kv]['kv_tokens']:,}" for kv in ("auto", "int8")),
                    " / ".join(f"{sp['step_ms'][kv]:.1f}" for kv in ("auto", "int8")),
                    " / ".join(f"{sp['tok_per_s'][kv]:.0f}" for kv in ("auto", "int8")),
                    _ratio(sp["speedup_int8"]),
                    str(len(sp["step_ms_rounds"]["auto"])),
                ]
            )
    acc_headers = [
        "dtype",
        "windows × tokens",
        "perplexity auto → int8",
        "mean KLD",
        "top-1 same",
        "greedy identical",
        "mean common prefix",
    ]
    speed_headers = [
        "dtype",
        "streams × context",
        "KV tokens auto / int8",
        "step ms auto / int8",
        "tok/s auto / int8",
        "int8 speed-up",
        "bursts",
    ]
    out = _table(RUN_HEADERS + acc_headers, acc_rows) if acc_rows else ""
    if speed_rows:
        out += ("\n" if out else "") + _table(RUN_HEADERS + speed_headers, speed_rows)
    return out


def _pd_disagg(results: Sequence[Result]) -> str:
    rows = []
    for name, d in results:
        cmp, c = d["comparison"], d["config"]
        rows.append(
            [
                *_run_cells(name, d),
                f"{c['streams']} streams, {c['num_prompts'] or c['streams']} × "
                f"{c['prompt_tokens']} tokens, {c['max_tokens']} out",
                _pair(cmp, "disagg", "colocated", "ttft_p50_ms", 0),
                _pair(cmp, "disagg", "colocated", "ttft_p99_ms", 0),
                _pair(cmp, "disagg", "colocated", "tpot_p50_ms", 1),
                _pair(cmp, "disagg", "colocated", "tpot_p99_ms", 1),
                _pair(cmp, "disagg", "colocated", "output_tok_per_s", 1),
                str(cmp["rounds"]),
            ]
        )
    headers = [
        "workload",
        "TTFT p50 ms (disagg / colocated)",
        "TTFT p99 ms",
        "TPOT p50 ms",
        "TPOT p99 ms",
        "output tok/s",
        "rounds",
    ]
    return _table(RUN_HEADERS + headers, rows)


def _scale_out(results: Sequence[Result]) -> str:
    rows = []
    for name, d in results:
        for lvl in d["levels"]:
            cmp = lvl["comparison"]
            rows.append(
                [
                    *_run_cells(name, d),
                    f"{lvl['concurrency']} ({lvl['num_prompts']} prompts)",
                    _pair(cmp, "dp2", "single", "output_tok_per_s", 1),
                    _ratio(_rmed(cmp, "dp2", "output_tok_per_s")),
                    _pair(cmp, "dp2", "single", "ttft_p50_ms", 0),
                    _pair(cmp, "dp2", "single", "tpot_p50_ms", 1),
                    str(cmp["rounds"]),
                ]
            )
    headers = [
        "streams",
        "output tok/s (dp2 / single)",
        "dp2 / single",
        "TTFT p50 ms",
        "TPOT p50 ms",
        "rounds",
    ]
    return _table(RUN_HEADERS + headers, rows)


def _tensor_parallel(results: Sequence[Result]) -> str:
    rows = []
    for name, d in results:
        for lvl in d["levels"]:
            rows.append(
                [
                    *_run_cells(name, d),
                    f"{d['config']['model']}, batch {lvl['batch']}",
                    " / ".join(_spread(lvl, s, "step_ms") for s in ("tp1", "tp2-gloo", "tp2-shm")),
                    _pair(lvl, "tp2-gloo", "tp2-shm", "allreduce_us", 0),
                    _pair(lvl, "tp2-gloo", "tp2-shm", "gather_us", 0),
                    _spread(lvl, "tp2-shm", "allreduces_per_step", digits=0),
                    str(lvl["rounds"]),
                ]
            )
    headers = [
        "model, decode batch",
        "step ms TP=1 / TP=2 gloo / TP=2 shm",
        "all-reduce µs per call (gloo / shm)",
        "gather µs per call (gloo / shm)",
        "all-reduces per step",
        "rounds",
    ]
    return _table(RUN_HEADERS + headers, rows)


def _short_prompt(d: Result) -> list[str]:
    """moe.py's short-prompt cells (results from before it measured one: none)."""
    cmp = d["comparison"]
    if "pp_short_tok_s" not in cmp["summary"]["sluice"]:
        return ["–", "–"]
    tokens = d.get("short_prompt_tokens", "")
    pair = _pair(cmp, "sluice", "llama.cpp", "pp_short_tok_s", 1)
    return [f"{tokens}: {pair}", _ratio(_rmed(cmp, "sluice", "pp_short_tok_s"))]


def _moe(results: Sequence[Result]) -> str:
    rows = []
    for name, d in results:
        cmp, b, bw = d["comparison"], d["bytes"], d["read_bandwidth_gb_s"]
        share = []
        for side in ("sluice", "llama.cpp"):
            tg = cmp["summary"][side]["tg_tok_s"]["median"]
            share.append(f"{tg * b['decode_step_bytes'] / 1e9 / bw:.0%}")
        mem = [
            r["peak_rss_bytes"] / (b["file_bytes"] + r["kv_pool_bytes"])
            for r in d["runs"]["sluice"]
        ]
        rows.append(
            [
                *_run_cells(name, d),
                d["model"],
                _pair(cmp, "sluice", "llama.cpp", "pp_tok_s", 1),
                _ratio(_rmed(cmp, "sluice", "pp_tok_s")),
                *_short_prompt(d),
                _pair(cmp, "sluice", "llama.cpp", "tg_tok_s", 1),
                _ratio(_rmed(cmp, "sluice", "tg_tok_s")),
                f"{b['decode_step_bytes'] / 1e9:.2f} GB, {bw:.1f} GB/s: " + " / ".join(share),
                f"{max(mem):.2f}×",
                str(cmp["rounds"]),
            ]
        )
    headers = [
        "model (random weights)",
        "prompt tok/s sluice / llama.cpp",
        "ratio",
        "short prompt: tokens, tok/s sluice / llama.cpp",
        "ratio",
        "decode tok/s sluice / llama.cpp",
        "ratio",
        "bytes a token reads, read bandwidth: share reached sluice / llama.cpp",
        "peak RSS / (file + KV pool)",
        "rounds",
    ]
    return _table(RUN_HEADERS + headers, rows)


def _few_rows(results: Sequence[Result]) -> str:
    rows = []
    for name, d in results:
        for m, cell in d["median_ms"].items():
            block, dense = cell["block"], cell["dense"]
            gemm = cell.get("gemm")  # results before the int8 GEMM have none
            amx = cell.get("amx")  # only at the amx level
            tiles = cell.get("tiles")  # the int8 GEMM on AMX-INT8 tiles: the amx level
            crossover = "/".join(map(str, sorted(set(d["dense_min_rows"].values()))))
            if d.get("gemm_min_rows"):
                gemm_from = sorted(set(d["gemm_min_rows"].values()))
                crossover += f" (int8 GEMM: {'/'.join(map(str, gemm_from))})"
            rows.append(
                [
                    *_run_cells(name, d),
                    d["model"],
                    m,
                    f"{block:.2f}",
                    "–" if gemm is None else f"{gemm:.2f}",
                    "–" if tiles is None else f"{tiles:.2f}",
                    f"{dense:.2f}",
                    "–" if amx is None else f"{amx:.2f}",
                    f"{block / dense:.2f}",
                    "–" if gemm is None else f"{block / gemm:.2f}",
                    "–" if tiles is None or gemm is None else f"{tiles / gemm:.2f}",
                    "–" if amx is None else f"{amx / dense:.2f}",
                    crossover,
                ]
            )
    headers = [
        "model",
        "rows",
        "block kernel ms",
        "int8 GEMM ms",
        "int8 GEMM on AMX-INT8 ms",
        "dequantized tiles + GEMM ms",
        "AMX ms",
        "block / dense",
        "block / int8 GEMM",
        "AMX-INT8 / int8 GEMM",
        "AMX / dense",
        "dense_min_rows",
    ]
    return _table(RUN_HEADERS + headers, rows)


def _huge_pages(results: Sequence[Result]) -> str:
    rows = []
    for name, d in results:
        ms, sums, mb = d["median"]["layer_ms"], d["median"]["sum_gb_s"], d["layer_bytes"] / 1e6
        rows.append(
            [
                *_run_cells(name, d),
                d["model"],
                f"{mb:.1f}",
                f"{ms['4k']:.2f} / {ms['huge']:.2f}",
                f"{mb / ms['4k']:.1f} / {mb / ms['huge']:.1f}",
                f"{sums['4k']:.1f} / {sums['huge']:.1f}",
                f"{ms['4k'] / ms['huge']:.2f}×",
            ]
        )
    headers = [
        "model",
        "layer 0's linears, MB",
        "1-row ms, 4 KiB / 2 MiB pages",
        "kernel GB/s",
        "torch sum GB/s",
        "speed-up",
    ]
    return _table(RUN_HEADERS + headers, rows)


def _tool_calls(results: Sequence[Result]) -> str:
    rows = []
    for name, d in results:
        for cell_name, cell in d["cells"].items():
            api, choice = cell_name.split("/")
            right = f"{cell['right']}/{cell['asked']}"
            rows.append(
                [
                    *_run_cells(name, d),
                    d["model"],
                    api,
                    choice,
                    right,
                    f"{cell['median_seconds']:.2f}",
                ]
            )
    headers = ["model", "API", "tool_choice", "right call, valid arguments", "median s a reply"]
    return _table(RUN_HEADERS + headers, rows)


def _hub_download(results: Sequence[Result]) -> str:
    rows = []
    for name, d in results:
        summary, start = d["summary"], d["start_seconds"]
        rows.append(
            [
                *_run_cells(name, d),
                f"{d['model']} ({d['file_bytes'] / 1e6:,.0f} MB)",
                fmt_spread(summary["sluice"]["seconds"], digits=2),
                fmt_spread(summary["huggingface_hub"]["seconds"], digits=2),
                f"{start['path'] * 1e3:.1f}",
                f"{start['hub name, online'] * 1e3:.1f}",
                f"{start['hub name, HF_HUB_OFFLINE'] * 1e3:.1f}",
                str(d["rounds"]),
            ]
        )
    headers = [
        "model file",
        "download s: sluice (checked)",
        "download s: hf_hub_download",
        "cached start ms: path",
        "hub name, online",
        "hub name, offline",
        "rounds",
    ]
    return _table(RUN_HEADERS + headers, rows)


def _embeddings(results: Sequence[Result]) -> str:
    rows = []
    for name, d in results:
        summary, ratio = d["summary"], d["ratio_of_medians"]["sluice"]["texts_per_s"]
        servers, lat = d.get("servers"), d.get("latency_seconds")
        server_cells = ["-", "-", "-"]
        if servers:
            s = servers["summary"]
            server_cells = [
                fmt_spread(s["sluice serve"]["texts_per_s"], digits=1),
                fmt_spread(s["llama-server"]["texts_per_s"], digits=1),
                f"{servers['ratio_of_medians']['sluice serve']['texts_per_s']:.2f}x",
            ]
        rows.append(
            [
                *_run_cells(name, d),
                f"{d['model']} ({d['dtype']})",
                f"{d['num_texts']:,} cut at {d['max_tokens']}",
                fmt_spread(summary["sluice"]["texts_per_s"], digits=1),
                fmt_spread(summary["sentence-transformers"]["texts_per_s"], digits=1),
                f"{ratio:.2f}x",
                f"{d['cosine_to_reference']['min']:.5f}",
                *server_cells,
                f"{lat['p50'] * 1e3:.1f} / {lat['p90'] * 1e3:.1f}" if lat else "-",
                str(d["rounds"]),
            ]
        )
    headers = [
        "model",
        "ShareGPT first turns",
        "texts/s: sluice",
        "sentence-transformers",
        "ratio",
        "min cosine",
        "texts/s: sluice serve",
        "llama-server",
        "ratio",
        "16-token query p50 / p90 ms",
        "rounds",
    ]
    return _table(RUN_HEADERS + headers, rows)


def _paired_median(sides: dict[str, Any], a: str, b: str) -> float:
    """The median over rounds of a / b, where round i of both sides ran on one server
    (benchmarks/lora.py's one stream): steadier than the ratio of the two medians on a
    machine whose speed drifts between rounds."""
    return statistics.median(x / y for x, y in zip(sides[a]["runs"], sides[b]["runs"], strict=True))


def _lora(results: Sequence[Result]) -> str:
    rows = []
    for name, d in results:
        t, s = d["throughput"], {k: v["median"] for k, v in d["single_stream"].items()}
        llama = s.get("llama_adapter")
        gguf = d.get("gguf_adapter")
        rows.append(
            [
                *_run_cells(name, d),
                f"{d['model']}, {d['adapters']} adapters of rank {d['rank']}",
                fmt_spread(t["summary"]["base"]["output_tok_per_s"], digits=1),
                fmt_spread(t["summary"]["mixed"]["output_tok_per_s"], digits=1),
                f"{t['ratio_of_medians']['mixed']['output_tok_per_s']:.2f}x",
                f"{s['sluice_base']:.1f}",
                f"{s['sluice_adapter']:.1f}",
                f"{s['sluice_adapter'] / s['sluice_base']:.2f}x",
                f"{_paired_median(d['single_stream'], 'sluice_adapter', 'sluice_base'):.2f}x",
                "-" if llama is None else f"{llama:.1f}",
                "-" if llama is None else f"{s['sluice_adapter'] / llama:.2f}x",
                "-" if gguf is None else ("yes" if gguf["tokens_equal"] else "NO"),
                f"{d['load_ms']['median']:.0f}",
                str(t["rounds"]),
            ]
        )
    headers = [
        "model, adapters",
        f"{results[0][1]['streams']} streams tok/s: base only",
        "mixed (adapters + base)",
        "ratio",
        "1 stream tok/s: base",
        "adapter",
        "ratio",
        "per round (median)",
        "llama-server --lora",
        "sluice / llama",
        "llama.cpp's GGUF adapter = PEFT",
        "load ms",
        "rounds",
    ]
    return _table(RUN_HEADERS + headers, rows)


def _spec_cost(results: Sequence[Result]) -> str:
    """A verifying step's time by decode rows and drafts k (benchmarks/spec_cost.py)."""
    rows = []
    for name, d in results:
        argv = d["provenance"].get("argv", [])
        model = argv[argv.index("--model") + 1] if "--model" in argv else "smollm2-135m"
        steps = sorted({int(key.split("x")[0]) for key in d["step_ms"]})
        for b in steps:
            times = [f"{d['step_ms'][f'{b}x{k}']:.1f}" for k in d["drafts"]]
            cost = f"{d['draft_cost'][str(b)]:.2f}"
            rows.append([*_run_cells(name, d), model, str(b), *times, cost, str(d["rounds"])])
    drafts = results[0][1]["drafts"] if results else []
    headers = ["model", "decode rows", *[f"k = {k} ms" for k in drafts]]
    return _table(RUN_HEADERS + headers + ["one draft, in decode steps", "rounds"], rows)


def _swa_pool(results: Sequence[Result]) -> str:
    rows = []
    for name, d in results:
        mem, dec = d["memory"], d["decode"]
        for side in ("split", "single"):
            m, ms = mem[side], dec[side]["ms_per_token"]
            rows.append(
                [
                    *_run_cells(name, d),
                    side,
                    f"{m['tokens']:,}",
                    str(m["global_blocks"]),
                    str(m["local_blocks"]) if side == "split" else "-",
                    f"{m['bytes'] / 1e6:.1f}",
                    f"{m['bytes'] / mem['single']['bytes']:.2f}",
                    f"{dec[side]['median']:.2f} ({min(ms):.2f}–{max(ms):.2f})",
                    str(len(ms)),
                ]
            )
    headers = [
        "KV pools",
        "tokens held",
        "global blocks",
        "local blocks",
        "MB held",
        "of single",
        "decode ms / token",
        "rounds",
    ]
    return _table(RUN_HEADERS + headers, rows)


def _cuda_check(results: Sequence[Result]) -> str:
    rows = []
    for name, d in results:
        cells = _run_cells(name, d)
        cells[1] = f"{d.get('gpu') or '?'} (torch {d['provenance'].get('torch', '?')})"
        checks = d.get("correctness")
        ok = (
            f"{sum(c['ok'] for c in checks)} of {len(checks)}"
            if isinstance(checks, list)
            else "not run"
        )
        single = (d.get("figures") or {}).get("single_stream")
        compiled = (d.get("compile") or {}).get("single_stream")
        server = d.get("server") or {}
        rows.append(
            [
                *cells,
                ok,
                _pair(single, "sluice", "transformers", "output_tok_s", 0) if single else "-",
                _pair(compiled, "eager", "compiled", "output_tok_s", 0) if compiled else "-",
                "-" if not server else ("answers" if server.get("ok") else "failed to start"),
            ]
        )
    headers = [
        "greedy = transformers (model × speculation)",
        "single stream tok/s: sluice / transformers",
        "single stream tok/s: eager / compiled",
        "server",
    ]
    return _table(RUN_HEADERS + headers, rows)


RENDERERS: dict[str, Callable[[Sequence[Result]], str]] = {
    "cpu_levels": _cpu_levels,
    "throughput": _throughput,
    "single_stream": _single_stream,
    "serve": _serve,
    "prefix_cache": _prefix_cache,
    "kv_offload": _kv_offload,
    "quantization": _quantization,
    "gguf_models": _gguf_models,
    "weight_paths": _weight_paths,
    "structured": _structured,
    "speculative": _speculative,
    "kv_cache": _kv_cache,
    "pd_disagg": _pd_disagg,
    "scale_out": _scale_out,
    "tensor_parallel": _tensor_parallel,
    "swa_pool": _swa_pool,
    "spec_cost": _spec_cost,
    "moe": _moe,
    "few_rows": _few_rows,
    "huge_pages": _huge_pages,
    "tool_calls": _tool_calls,
    "hub_download": _hub_download,
    "embeddings": _embeddings,
    "lora": _lora,
    "cuda_check": _cuda_check,
}


def render_block(kind: str, results: Sequence[Result]) -> str:
    """The generated text for one block: a table and how each row's result was produced."""
    if kind not in RENDERERS:
        raise ReportError(f"unknown results block {kind!r}; known: {', '.join(RENDERERS)}")
    mine = [(name, data) for name, data in results if data["benchmark"] == kind]
    if not mine:
        return EMPTY
    return RENDERERS[kind](mine) + "\n" + _runs_list(mine)


def render(doc: str, results: Sequence[Result]) -> str:
    """`doc` with every results block regenerated from `results`; the prose is untouched."""
    kinds = {data["benchmark"] for _, data in results}
    unknown = kinds - set(RENDERERS)
    if unknown:
        raise ReportError(f"results of unknown benchmark kind(s): {', '.join(sorted(unknown))}")
    blocks = {m.group(2) for m in BLOCK.finditer(doc)}
    missing = kinds - blocks
    if missing:
        # A committed result no table shows would be a figure without a place in the doc.
        raise ReportError(f"docs/benchmarks.md has no results block for {sorted(missing)}")
    return BLOCK.sub(lambda m: m.group(1) + render_block(m.group(2), results) + m.group(4), doc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if the doc is out of date")
    ap.add_argument("--results", type=Path, default=DOC_RESULTS_DIR)
    ap.add_argument("--doc", type=Path, default=DOC)
    args = ap.parse_args()
    doc = args.doc.read_text(encoding="utf-8")
    new = render(doc, load_results(args.results))
    if args.check:
        if new != doc:
            sys.stdout.writelines(
                difflib.unified_diff(
                    doc.splitlines(True), new.splitlines(True), str(args.doc), "generated"
                )
            )
            print(f"\n{args.doc} is out of date: run benchmarks/report.py", file=sys.stderr)
            return 1
        return 0
    if new != doc:
        args.doc.write_text(new, encoding="utf-8")
        print(f"rewrote {args.doc}")
    else:
        print(f"{args.doc} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
