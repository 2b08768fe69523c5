"""Benchmarks: `sluice bench` summary and plots, the interleaving and provenance helpers,
and docs/benchmarks.md against the committed results (no benchmark is run)."""

from __future__ import annotations

import datetime
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sluice import bench

# benchmarks/ is not an installed package: import it from this checkout.
REPO = bench.benchmarks_dir().parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import common, report, serve  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PROVENANCE = {
    "commit": "0123456789abcdef0123456789abcdef01234567",
    "dirty": False,
    "date": "2026-11-23T10:00:00+00:00",
    "cpu_model": "test cpu",
    "cpu_flags": ["avx2", "fma"],
    "threads": 2,
    "kernel_variant": "avx2",
    "torch": "2.13.0",
    "argv": ["benchmarks/x.py", "--rounds", "3"],
}


def _fake_results() -> dict[str, dict[str, Any]]:
    """Small dicts with the same layout as the scripts' result JSON, built by the same
    helper (common.compare) the scripts use."""

    def level(c: int) -> dict[str, Any]:
        def run(scale: float, tok: float) -> dict[str, float]:
            return {
                "output_tok_per_s": tok,
                "requests_per_s": 0.2 * c,
                "ttft_p50_ms": scale * 80.0 * c,
                "ttft_p99_ms": scale * 100.0 * c,
                "tpot_p50_ms": scale * (30.0 + c),
                "tpot_p99_ms": scale * (35.0 + c),
                "errors": 0,
                "duration_s": 1.0,
            }

        runs = {
            "sluice": [run(1.0, 30.0 * c), run(1.2, 28.0 * c), run(0.9, 32.0 * c)],
            "llama-server": [run(2.5, 10.0 * c), run(2.4, 9.0 * c), run(2.6, 11.0 * c)],
        }
        return {
            "concurrency": c,
            "num_prompts": 4 * c,
            "comparison": common.compare(runs, list(runs["sluice"][0]), "llama-server"),
        }

    def prefix_side(ttft_p50: float, ttft_p99: float, hit: float) -> list[dict[str, float]]:
        one = {"ttft_p50_s": ttft_p50, "ttft_p99_s": ttft_p99, "hit_rate": hit, "total_s": 1.0}
        return [one, {**one, "ttft_p50_s": ttft_p50 * 1.1}, {**one, "ttft_p50_s": ttft_p50 * 0.9}]

    def workload(off: list[dict[str, float]], on: list[dict[str, float]]) -> dict[str, Any]:
        cmp = common.compare({"off": off, "on": on}, list(off[0]), baseline="on")
        return {
            "num_requests": 64,
            "num_streams": 64,
            "concurrency": 8,
            "max_tokens": 32,
            "comparison": cmp,
        }

    tput = {
        "sluice": [{"tokens_per_s": v, "seconds": 1000 / v} for v in (500.0, 450.0, 520.0)],
        "transformers": [{"tokens_per_s": v, "seconds": 1000 / v} for v in (100.0, 90.0, 110.0)],
    }
    single = {
        "int4": [{"decode_tokens_per_s": v, "ttft_s": 0.04} for v in (120.0, 110.0, 125.0)],
        "llama.cpp": [{"decode_tokens_per_s": v, "ttft_s": 0.1} for v in (100.0, 95.0, 105.0)],
    }
    return {
        "throughput": {
            "benchmark": "throughput",
            "provenance": PROVENANCE,
            "time_to_ready": {"cold_total_s": 4.5},
            "workload": {
                "num_prompts": 256,
                "hf_num_prompts": 64,
                "hf_batch_size": 16,
                "max_tokens": 128,
            },
            "comparison": common.compare(tput, ["tokens_per_s", "seconds"], "transformers"),
        },
        "serve": {
            "benchmark": "serve",
            "provenance": PROVENANCE,
            "models": {"sluice": "smollm2-135m", "llama-server": "smollm2.gguf"},
            "levels": [level(c) for c in (16, 1, 4)],  # unsorted on purpose
        },
        "prefix": {
            "benchmark": "prefix_cache",
            "provenance": PROVENANCE,
            "workloads": {
                "shared_prompt": workload(prefix_side(1.6, 13.9, 0.0), prefix_side(0.5, 0.9, 0.97)),
                "chat_replay": workload(prefix_side(1.7, 3.9, 0.0), prefix_side(1.3, 2.0, 0.79)),
            },
        },
        "single": {
            "benchmark": "single_stream",
            "provenance": PROVENANCE,
            "systems": {
                "int4": {"kind": "sluice", "dtype": "bfloat16"},
                "llama.cpp": {"kind": "llama.cpp", "version": "0.3.36", "model": "m.gguf"},
            },
            "comparison": common.compare(single, ["decode_tokens_per_s", "ttft_s"], "llama.cpp"),
        },
        "quantization": {
            "benchmark": "quantization",
            "provenance": PROVENANCE,
            "config": {"prompts": 16},
            "results": {
                "fp32 reference": {"perplexity": 20.5},
                "none": {"perplexity": 20.5, "top1_agreement_vs_fp32": 0.976},
                "int8": {
                    "perplexity": 20.6,
                    "top1_agreement_vs_fp32": 0.946,
                    "greedy_identical_vs_none": 0.0625,
                    "greedy_mean_common_prefix": 17.9,
                },
            },
        },
    }


def _fake_gguf_model() -> dict[str, Any]:
    """One model of a gguf_models.py result: both memory sides, two levels, perplexity."""
    mib = 2**20

    def memory(peak: int, weights: int | None) -> dict[str, Any]:
        base, kv = 300 * mib, 256 * mib
        return {
            "baseline_rss": base,
            "peak_rss": peak * mib,
            "peak_minus_baseline": peak * mib - base,
            "kv_bytes": kv,
            "kv_tokens": 11776,
            "weight_bytes": weights,
            "ratio_to_file": (peak * mib - base - kv) / (100 * mib),
        }

    def level(sluice: float, llama: float) -> list[dict[str, float]]:
        one = {"sluice_tok_s": sluice, "llamacpp_tok_s": llama}
        one["ratio_to_llamacpp"] = sluice / llama
        return [one, one, one]

    runs = {"avx512": level(150.0, 100.0), "avx2": level(90.0, 100.0)}
    metrics = ["sluice_tok_s", "llamacpp_tok_s", "ratio_to_llamacpp"]

    def ppl(p: float, se: float) -> dict[str, Any]:
        return {"perplexity": p, "stderr": se, "scored_tokens": 5100, "tokens_sha256": "ab"}

    return {
        "gguf": "m.Q4_1.gguf",
        "file_bytes": 100 * mib,
        "memory": {"sluice": memory(690, 110 * mib), "llama.cpp": memory(700, None)},
        "speed": {
            "comparison": common.compare(runs, metrics, "avx512"),
            "dtype": {"avx512": "bfloat16", "avx2": "float32"},
            "llamacpp_isa": {"avx512": "avx512", "avx2": "avx2"},
        },
        "perplexity": {
            "chunks": 20,
            "ctx": 512,
            "systems": {
                "sluice": {**ppl(20.512, 0.61), "quantization": "gguf", "dtype": "bfloat16"},
                "llama.cpp": ppl(20.4, 0.6),
            },
        },
    }


# ---- common: interleaving, summaries, provenance ---------------------------------------------


def test_interleave_alternates_order_every_round() -> None:
    seen: list[str] = []

    def measure(side: str) -> int:
        seen.append(side)
        return len(seen)

    runs = common.interleave(["a", "b"], 4, measure)
    # Every round runs every side once; the order flips each round, so a steady drift
    # favours neither side.
    assert seen == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert runs == {"a": [1, 4, 5, 8], "b": [2, 3, 6, 7]}
    assert common.interleave(["only"], 2, measure) == {"only": [9, 10]}
    with pytest.raises(ValueError):
        common.interleave(["a", "b"], 0, measure)
    with pytest.raises(ValueError):
        common.interleave(["a", "a"], 1, measure)


def test_spread_and_compare() -> None:
    s = common.spread([3.0, 1.0, 2.0, 10.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.5, 1.0, 10.0, 4)
    assert s["q1"] == pytest.approx(1.75) and s["q3"] == pytest.approx(4.75)
    assert common.spread([float("nan"), 4.0])["n"] == 1  # a missing figure is not a zero
    assert math.isnan(common.spread([])["median"])

    runs = {
        "sluice": [{"tps": 10.0, "ms": 5.0}, {"tps": 30.0, "ms": 4.0}, {"tps": 20.0, "ms": 6.0}],
        "peer": [{"tps": 5.0, "ms": 10.0}, {"tps": 4.0, "ms": 8.0}, {"tps": 6.0, "ms": None}],
    }
    cmp = common.compare(runs, ["tps", "ms"], baseline="peer")
    assert cmp["rounds"] == 3 and cmp["sides"] == ["sluice", "peer"]
    assert cmp["order"] == [["sluice", "peer"], ["peer", "sluice"], ["sluice", "peer"]]
    assert cmp["runs"]["sluice"]["tps"] == [10.0, 30.0, 20.0]
    assert cmp["summary"]["sluice"]["tps"]["median"] == 20.0
    assert cmp["summary"]["peer"]["ms"]["median"] == 9.0
    # The ratio is of the medians (20 / 5), not a median of per-round ratios.
    assert cmp["ratio_of_medians"] == {"sluice": {"tps": 4.0, "ms": 5.0 / 9.0}}
    assert common.compare(runs, ["tps"])["ratio_of_medians"] == {}
    with pytest.raises(ValueError):
        common.compare(runs, ["tps"], baseline="nobody")
    assert common.fmt_spread(cmp["summary"]["sluice"]["tps"]) == "20.0 (10.0–30.0)"
    assert common.fmt_spread(common.spread([0.5]), 1e3, 0) == "500"


def test_provenance_records_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import sluice.kernels

    # The level the kernels ran at (amx included), not the library's build.
    monkeypatch.setattr(sluice.kernels, "level_in_use", lambda: "amx")
    monkeypatch.setattr(sluice.kernels, "variant", lambda: "avx512")
    started = datetime.datetime(2026, 11, 23, 10, 0, tzinfo=datetime.UTC)
    p = common.provenance(threads=7, started=started)
    assert p["kernel_variant"] == "amx"
    assert p["date"] == "2026-11-23T10:00:00+00:00"
    assert p["threads"] == 7
    if (REPO / ".git").exists():
        assert len(p["commit"]) == 40 and isinstance(p["dirty"], bool)
    for key in ("cpu_model", "cpu_flags", "torch", "finished", "argv", "load_average"):
        assert key in p
    assert set(p["cpu_flags"]) <= set(common.KERNEL_CPU_FLAGS) | {
        f for f in p["cpu_flags"] if f.startswith("amx")
    }


def test_provenance_tree_names_the_files_as_they_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tree` is the commit's tree when the files are the commit's, another when a
    tracked file differs, and the repo's own index stays as it was."""
    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip

    git("init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    monkeypatch.setattr(common, "REPO_ROOT", repo)
    state = common._git_state()
    assert state["dirty"] is False and state["tree"] == git("rev-parse", "HEAD^{tree}")
    (repo / "a.py").write_text("x = 2\n")
    (repo / "new.py").write_text("untracked\n")
    state = common._git_state()
    assert state["dirty"] is True and state["tree"] != git("rev-parse", "HEAD^{tree}")
    assert git("diff", "--cached", "--name-only") == ""  # nothing staged in the repo's index
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "two")
    assert git("rev-parse", "HEAD^{tree}") == state["tree"]  # the files that ran
    assert common.result_commit(state) == git("rev-parse", "HEAD")
    assert common.result_commit({**state, "tree": "0" * 40}) is None


def test_write_result_adds_provenance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sluice.kernels

    # The real level_in_use() may build the kernels first; this test is about the file.
    monkeypatch.setattr(sluice.kernels, "level_in_use", lambda: "generic")
    path = common.write_result("serve", {"levels": []}, tmp_path / "sub" / "x.json", threads=3)
    data = json.loads(path.read_text())
    assert data["benchmark"] == "serve" and data["levels"] == []
    assert data["provenance"]["threads"] == 3
    assert data["provenance"]["kernel_variant"] == "generic"


# ---- sluice bench ----------------------------------------------------------------------------


def test_summary_numbers() -> None:
    summary = bench.summarize(_fake_results())
    t = summary["throughput"]
    assert (t["sluice_tok_s"], t["transformers_tok_s"], t["ratio_vs_transformers"]) == (
        500.0,
        100.0,
        5.0,
    )
    assert t["sluice_tok_s_range"] == [450.0, 520.0] and t["rounds"] == 3
    assert [lvl["concurrency"] for lvl in summary["serve"]] == [16, 1, 4]
    assert summary["serve"][1]["ttft_p99_ms"] == 100.0
    assert summary["serve"][0]["llama_server_tok_per_s"] == 160.0
    assert summary["serve"][0]["vs_llama_server"] == 3.0
    assert summary["prefix"]["shared_prompt"]["ttft_p50_on_s"] == 0.5
    assert summary["prefix"]["shared_prompt"]["ttft_p50_speedup"] == pytest.approx(3.2)
    assert summary["prefix"]["chat_replay"]["hit_rate"] == 0.79
    assert summary["single"]["int4"]["vs_llamacpp"] == 1.2
    assert summary["single"]["llama.cpp"]["decode_tok_s"] == 100.0
    assert summary["quantization"]["fp32 reference"]["top1_agreement_vs_fp32"] is None
    table = bench.format_summary(summary, bench.run_info(_fake_results()))
    assert "sluice_tok_s" in table and "concurrency=16" in table and "chat_replay" in table
    assert "kernel_variant" in table and "avx2" in table


def test_summary_json_and_plots(tmp_path: Path) -> None:
    results = _fake_results()
    summary_path = bench.write_summary(results, tmp_path)
    data = json.loads(summary_path.read_text())
    assert data["provenance"]["throughput"]["cpu_model"] == "test cpu"
    assert data["summary"]["prefix"]["shared_prompt"]["ttft_p99_off_s"] == 13.9

    paths = bench.plot_all(results, tmp_path)
    names = {p.name for p in paths}
    assert names == {
        "throughput.png",
        "serve_throughput.png",
        "serve_latency.png",
        "prefix_cache.png",
    }
    for path in paths:
        assert path.read_bytes()[:8] == PNG_MAGIC, path


def test_partial_results_plot_only_what_exists(tmp_path: Path) -> None:
    # A throughput run with --skip-hf has no transformers side and no ratio.
    throughput = dict(_fake_results()["throughput"])
    only = {"sluice": [{"tokens_per_s": 500.0, "seconds": 2.0}]}
    throughput["comparison"] = common.compare(only, ["tokens_per_s", "seconds"])
    paths = bench.plot_all({"throughput": throughput}, tmp_path)
    assert [p.name for p in paths] == ["throughput.png"]
    summary = bench.summarize({"throughput": throughput})["throughput"]
    assert summary["transformers_tok_s"] is None and summary["ratio_vs_transformers"] is None


def test_old_results_without_provenance_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "throughput.json"
    path.write_text(json.dumps({"benchmark": "throughput", "sluice": {"tokens_per_s": 1.0}}))
    with pytest.raises(bench.BenchError, match="provenance"):
        bench.load_result(path)


def test_plan_quick_args_and_extra(tmp_path: Path) -> None:
    bench_dir = bench.benchmarks_dir()
    step = bench.plan("serve", bench_dir, tmp_path, quick=True, extra=["--url", "http://x"])
    assert step.argv[0] == sys.executable
    assert step.argv[1].endswith("serve.py")
    assert "--concurrency" in step.argv and step.argv[-2:] == ["--url", "http://x"]
    assert step.result == tmp_path / "serve_quick.json"
    # Quick runs must not overwrite the full results.
    assert bench.plan("prefix", bench_dir, tmp_path, quick=True).result.name == (
        "prefix_cache_quick.json"
    )
    for name in bench.BENCHMARKS:  # every script writes where it is told
        step = bench.plan(name, bench_dir, tmp_path, quick=True)
        i = step.argv.index("--output")
        assert Path(step.argv[i + 1]) == step.result and step.result.parent == tmp_path
        if name != "quantization":  # the comparisons still interleave in a smoke run
            assert "--rounds" in step.argv
    with pytest.raises(bench.BenchError):
        bench.plan("nope", bench_dir, tmp_path)


def test_missing_benchmarks_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(bench.sluice, "__file__", str(tmp_path / "site" / "sluice" / "x.py"))
    with pytest.raises(bench.BenchError, match="source checkout"):
        bench.benchmarks_dir()


def test_bench_help() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "bench", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--quick" in proc.stdout and "prefix" in proc.stdout


def test_extra_args_reach_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    from sluice import cli

    seen: dict[str, Any] = {}

    def fake_run(which: str, out: Path | None, **kw: Any) -> int:
        seen.update(which=which, out=out, **kw)
        return 0

    monkeypatch.setattr(bench, "run", fake_run)
    argv = ["bench", "serve", "--quick", "--out", "o", "--", "--url", "http://x"]
    assert cli.main(argv) == 0
    assert seen["which"] == "serve" and seen["quick"] is True and seen["out"] == Path("o")
    assert seen["extra"] == ["--url", "http://x"]


def test_double_dash_keeps_its_meaning_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    from sluice import cli

    seen: dict[str, str] = {}

    def fake_generate(args: Any) -> int:
        seen["prompt"] = args.prompt
        return 0

    monkeypatch.setattr(cli, "_generate", fake_generate)
    assert cli.main(["--log-level", "error", "generate", "--", "-a prompt"]) == 0
    assert seen["prompt"] == "-a prompt"


def test_comparison_scripts_take_rounds_and_output() -> None:
    scripts = [
        "throughput",
        "single_stream",
        "serve",
        "prefix_cache",
        "kv_offload",
        "gguf_models",
        "structured",
        "tensor_parallel",
    ]
    # One interpreter for all of them: torch is imported once.
    code = (
        "import runpy, sys\n"
        "for script in sys.argv[1:]:\n"
        "    sys.argv = [script, '--help']\n"
        "    print('=== ' + script, flush=True)\n"
        "    try:\n"
        "        runpy.run_path(script, run_name='__main__')\n"
        "    except SystemExit:\n"
        "        pass\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *(f"benchmarks/{s}.py" for s in scripts)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    helps = proc.stdout.split("=== ")[1:]
    assert [h.split()[0] for h in helps] == [f"benchmarks/{s}.py" for s in scripts]
    for text in helps:
        assert "--rounds" in text and "--output" in text, text[:200]


# ---- docs/benchmarks.md is generated from docs/results/*.json ---------------------------------

DOC = """# Title

Prose stays.

<!-- results: throughput -->
stale text
<!-- /results -->

More prose.

<!-- results: serve -->
<!-- /results -->
"""


def test_docs_match_committed_results() -> None:
    """No figure in docs/benchmarks.md without its committed run: the doc must be exactly
    what benchmarks/report.py generates from docs/results/*.json."""
    doc = report.DOC.read_text(encoding="utf-8")
    expected = report.render(doc, report.load_results(common.DOC_RESULTS_DIR))
    assert doc == expected, "docs/benchmarks.md is stale: run `python benchmarks/report.py`"


def test_committed_results_name_the_code_they_ran() -> None:
    """Each result under docs/results/ was measured from a clean tree, at a commit that
    holds the script it ran, or from files equal to such a commit's (its `tree`: a GPU
    run from the device tool's copy, whose .git is older than its files). In a shallow
    clone, where old commits are absent, only the clean flag is checked."""
    shallow = common._git("rev-parse", "--is-shallow-repository") == "true"
    for name, data in report.load_results(common.DOC_RESULTS_DIR):
        prov = data["provenance"]
        commit = common.result_commit(prov)
        if shallow:
            assert prov["dirty"] is False or commit, f"{name} was measured from a dirty tree"
            continue
        assert commit, f"{name} was measured from a dirty tree (files of no commit)"
        script = next(a for a in prov["argv"] if a.endswith(".py") or a.startswith("benchmarks."))
        path = script if script.endswith(".py") else script.replace(".", "/") + ".py"
        found = common._git("cat-file", "-e", f"{commit}:{path}")
        assert found is not None, f"{name}: {path} is not in {commit}"


def _numbers(value: Any) -> list[float]:
    """Every number in a JSON value."""
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    return [float(value)] if is_number else []


_DECIMAL = re.compile(r"(?<![\w.\-/])(\d[\d,]*\.\d+)")
_ANY_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
# A figure right after one of these is a target or a bound, not a result.
_NOT_A_RESULT = re.compile(r"(?:[≥≤<>~]|target\w*\W*|bound\W*)\s*$")
# Figures in the prose computed from the sentence they stand in, not measured.
COMPUTED = {
    "15.5": "the offline run's matmul TFLOP, from its token and parameter counts",
    "1.88": "the int8 KV pool's capacity, 128 bytes a row against 68",
}


def _rounds_to(figure: str, value: float) -> bool:
    """Whether `value` shows as `figure` (e.g. "1,950" or "0.27") at its precision."""
    digits = len(figure.split(".")[1]) if "." in figure else 0
    return abs(value - float(figure.replace(",", ""))) <= 0.5 * 10**-digits + 1e-9


def _untraced(section: str) -> list[str]:
    """The decimal figures of a section's prose that are not in its rendered tables or
    its result files (to the figure's precision), nor the ratio of two such figures
    of their own paragraph, nor targets."""
    blocks = re.findall(r"<!-- results: .*? -->(.*?)<!-- /results -->", section, re.S)
    tables = " ".join(blocks)
    known = {float(v.replace(",", "")) for v in _ANY_NUMBER.findall(tables)}
    for name in set(re.findall(r"\(results/([\w.\-]+\.json)\)", tables)):
        known |= set(_numbers(json.loads((common.DOC_RESULTS_DIR / name).read_text())))
    prose = re.sub(r"<!-- results: .*? -->.*?<!-- /results -->", "", section, flags=re.S)
    bad = []
    for paragraph in re.sub(r"`[^`]*`", "", prose).split("\n\n"):
        for m in _DECIMAL.finditer(paragraph):
            figure = m.group(1)
            if figure in COMPUTED or _NOT_A_RESULT.search(paragraph[: m.start()]):
                continue
            if any(_rounds_to(figure, v) for v in known):
                continue
            others = [float(v.replace(",", "")) for v in _ANY_NUMBER.findall(paragraph)]
            others = [v for v in others if v in known and v not in (0, 1)]
            if any(_rounds_to(figure, a / b) for a in others for b in others if a != b):
                continue
            bad.append(figure)
    return bad


def test_prose_figures_come_from_the_results_they_stand_beside() -> None:
    """docs/benchmarks.md's prose quotes its sections' results: each decimal figure of a
    section with results is in its tables or its JSON files, or a ratio of two of its
    paragraph's figures that are; a figure that drifted from its file, or quotes a
    withdrawn one, fails (issue 36)."""
    doc = report.DOC.read_text(encoding="utf-8")
    untraced = {}
    for section in re.split(r"\n(?=## )", doc):
        if "<!-- results: " in section:
            bad = _untraced(section)
            if bad:
                untraced[section.splitlines()[0]] = bad
    assert not untraced, untraced


# A measured-looking figure in architecture.md: a time, a rate or a ratio (1.5x, 2 ×);
# a range's two ends both count.
_MEASURED = re.compile(
    r"(?<![\w.\-/])(\d[\d,]*(?:\.\d+)?)(?:\s?[-–]\s?(\d[\d,]*(?:\.\d+)?))?"
    r"(?:\s?(?:ms|s|tok/s|GB/s)(?![\w/])|x(?!\w)|\s?×)"
)
# architecture.md's figures of that shape that are not measurements.
NOT_MEASURED = {
    "1.88x": "the int8 KV pool's capacity against bf16's, 128 bytes a row against 68",
    "3.76x": "the same against an fp32 pool",
    "4-11x": "an fp32 copy's size against a GGUF's, 32 bits a weight against 3-8.5",
    "10 s": "the constraint fuzz test's bound on one compile",
    "300 s": "a timeout",
    "10 ms": "the engine thread's longest sleep",
    "400s": "HTTP status codes",
}


def test_architecture_figures_come_from_results() -> None:
    """docs/architecture.md's measured figures (times, rates, ratios, and every number of
    a table) are in the JSON of a docs/results file its paragraph, or the one before,
    names (a time in ms or s either way): a development measurement with no committed
    result is said without its numbers (issue 36)."""
    names = {p.name for p in common.DOC_RESULTS_DIR.glob("*.json")}
    doc = re.sub(r"```.*?```", "", (REPO / "docs/architecture.md").read_text(), flags=re.S)
    paragraphs = doc.split("\n\n")
    untraced = []
    for i, paragraph in enumerate(paragraphs):
        near = (paragraphs[i - 1] if i else "") + paragraph
        cited = set(re.findall(r"[\w.\-]+\.json", near)) & names
        known = [
            n for f in cited for n in _numbers(json.loads((common.DOC_RESULTS_DIR / f).read_text()))
        ]
        text = re.sub(r"`[^`]*`", "", paragraph)
        if text.lstrip().startswith("|"):  # a table: every number in its cells
            figures = [(f, f) for f in _DECIMAL.findall(text)]
        else:
            figures = [(m.group(0), g) for m in _MEASURED.finditer(text)
                       for g in m.groups() if g is not None]  # fmt: skip
        for shown, figure in figures:
            if shown in NOT_MEASURED:
                continue
            if not any(_rounds_to(figure, v) or _rounds_to(figure, v / 1000) for v in known):
                untraced.append(f"{shown!r} in {paragraph.strip()[:60]!r}")
    assert not untraced, untraced


def _llama_file_is(model: str, llama_file: str) -> bool:
    """Whether llama-server's GGUF is the file sluice served as `model` (alias or path)."""
    from sluice.loader.resolve import KNOWN_MODELS

    packaged = KNOWN_MODELS.get(model)
    if packaged is None:
        return Path(model).name == Path(llama_file).name
    names = {packaged.assembled_path().name, *(Path(p.relpath).name for p in packaged.parts)}
    return Path(llama_file).name in names


def test_committed_serving_results_ran_one_model_on_both_sides() -> None:
    for name, data in report.load_results(common.DOC_RESULTS_DIR):
        models = data.get("models", {})
        if data["benchmark"] == "serve" and "llama-server" in models:
            sluice_model = models["sluice"] or serve.served_model(
                (data["config"]["server_args"] or "").split(), data["config"]["model"]
            )
            assert _llama_file_is(sluice_model, models["llama-server"]), name


def test_the_served_model_is_one_for_both_sides() -> None:
    assert serve.served_model(["--model", "/m/a.gguf", "--num-threads", "2"], None) == "/m/a.gguf"
    assert serve.served_model(["--model=/m/a.gguf"], "/m/a.gguf") == "/m/a.gguf"
    assert serve.served_model(["--num-threads", "2"], "gemma-3-270m") == "gemma-3-270m"
    assert serve.served_model([], None) is None
    with pytest.raises(SystemExit, match="disagree"):
        serve.served_model(["--model", "/m/a.gguf"], "smollm2-135m")


def test_report_without_results_says_so(tmp_path: Path) -> None:
    assert report.load_results(tmp_path / "absent") == []
    out = report.render(DOC, [])
    assert out.count(report.EMPTY) == 2
    assert "stale text" not in out and "Prose stays." in out and "More prose." in out
    assert report.render(out, []) == out  # regenerating is a fixed point


def test_report_rows_name_their_run(tmp_path: Path) -> None:
    fake = _fake_results()
    for key, name in (("throughput", "throughput.json"), ("serve", "serve-avx2.json")):
        (tmp_path / name).write_text(json.dumps(fake[key]))
    (tmp_path / "summary.json").write_text(json.dumps({"summary": {}}))  # not a result: skipped
    results = report.load_results(tmp_path)
    assert [name for name, _ in results] == ["serve-avx2.json", "throughput.json"]
    out = report.render(DOC, results)
    rows = [line for line in out.splitlines() if line.startswith("| [")]
    assert len(rows) == 1 + 3  # one throughput row, one per serving level
    for row in rows:
        # machine (CPU model, threads), kernel variant, commit and date on every row
        assert "test cpu, 2 threads | avx2 | 0123456789 | 2026-11-23 10:00 |" in row
    assert "| 500.0 (450.0–520.0) | 100.0 (90.0–110.0) | 5.00× | 3 |" in out
    assert "[serve-avx2.json](results/serve-avx2.json)" in out
    assert "`.venv/bin/python benchmarks/x.py --rounds 3`" in out
    # Every kind renders (the doc's own blocks), and the result is stable.
    doc = report.DOC.read_text(encoding="utf-8")
    for key, name in (("prefix", "p.json"), ("single", "s.json"), ("quantization", "q.json")):
        (tmp_path / name).write_text(json.dumps(fake[key]))
    gguf = {"smollm2-135m": _fake_gguf_model()}
    (tmp_path / "g.json").write_text(
        json.dumps({"benchmark": "gguf_models", "provenance": PROVENANCE, "models": gguf})
    )
    paths = {"gguf": [{"tokens_per_s": 350.0}], "int4": [{"tokens_per_s": 400.0}]}
    weight_paths = {
        "benchmark": "weight_paths",
        "provenance": PROVENANCE,
        "comparison": common.compare(paths, ["tokens_per_s"], "int4"),
        "weight_bytes": {"gguf": 94 * 2**20, "int4": 401 * 2**20},
        "dtype": {"gguf": "bfloat16", "int4": "bfloat16"},
    }
    (tmp_path / "w.json").write_text(json.dumps(weight_paths))
    full = report.render(doc, report.load_results(tmp_path))
    assert "| gguf | bfloat16 | 94 | 350.0 | 0.88× of int4 | 1 |" in full
    assert "1.20×" in full and "1/16" in full and "3.20×" in full
    # gguf_models: a memory row per system, a speed row per level, a perplexity row
    row = "| smollm2-135m (m.Q4_1.gguf) | sluice | 100 | 300 | 690 | 390 | 256 (11,776 tokens) "
    assert row in full
    assert "| 110 | 1.34 |" in full and "| – | 1.44 |" in full
    # llama.cpp at the same level as sluice (make llamacpp-levels), and which it was.
    assert (
        "| smollm2-135m | avx2 (float32) | 90.0 (90.0–90.0) | avx2 | 100.0 (100.0–100.0) |" in full
    )
    assert "| 20.512 ± 0.610 | 20.400 ± 0.600 | yes |" in full
    assert report.render(full, report.load_results(tmp_path)) == full


def test_report_refuses_results_it_cannot_place(tmp_path: Path) -> None:
    fake = _fake_results()
    with pytest.raises(report.ReportError, match="no results block"):
        report.render(DOC, [("q.json", fake["quantization"])])
    with pytest.raises(report.ReportError, match="unknown"):
        report.render(DOC, [("x.json", {**fake["serve"], "benchmark": "nope"})])
    (tmp_path / "old.json").write_text(json.dumps({"benchmark": "serve", "levels": []}))
    with pytest.raises(report.ReportError, match="provenance"):
        report.load_results(tmp_path)


def test_gguf_models_scoring_helpers() -> None:
    from benchmarks import gguf_models

    # llama-perplexity: ppl = exp(mean nll), stderr = ppl * sqrt(var / (n - 1))
    s = gguf_models.nll_summary([1.0, 2.0, 3.0, 2.0])
    assert s["perplexity"] == pytest.approx(math.exp(2.0))
    assert s["stderr"] == pytest.approx(math.exp(2.0) * math.sqrt(0.5 / 3))
    assert s["scored_tokens"] == 4
    # Qwen2.5-0.5B: 24 layers, 2 KV heads of 64 (896 / 14), f16 K and V
    meta = {
        "general.architecture": "qwen2",
        "qwen2.block_count": "24",
        "qwen2.embedding_length": "896",
        "qwen2.attention.head_count": "14",
        "qwen2.attention.head_count_kv": "2",
    }
    assert gguf_models.llamacpp_kv_bytes(meta, 1000) == 24 * 1000 * 2 * 128 * 2


def test_report_renders_structured(tmp_path: Path) -> None:
    """benchmarks/structured.py's three parts, each a table of its own."""
    level = {
        "constrained": [{"tpot_p50_ms": v, "decode_step_p50_ms": 30.0} for v in (22, 20, 24)],
        "free": [{"tpot_p50_ms": v, "decode_step_p50_ms": 25.0} for v in (20, 21, 19)],
    }
    metrics = ["tpot_p50_ms", "decode_step_p50_ms"]
    data = {
        "benchmark": "structured",
        "provenance": PROVENANCE,
        "compliance": {
            "total": 180,
            "compiled": 168,
            "valid": 150,
            "length": 18,
            "invalid": 0,
            "max_tokens": 1024,
            "compile": {"p50_ms": 0.71, "p99_ms": 25.5, "max_ms": 263.0, "n": 180},
        },
        "tpot": [
            {
                "concurrency": 16,
                "num_prompts": 32,
                "max_tokens": 128,
                "comparison": common.compare(level, metrics, baseline="free"),
            }
        ],
        "forced": {
            "requests": [{}] * 8,
            "tokens": 260,
            "forced": 110,
            "steps": 150,
            "tokens_per_step": 260 / 150,
        },
    }
    (tmp_path / "structured.json").write_text(json.dumps(data))
    doc = "<!-- results: structured -->\n<!-- /results -->\n"
    out = report.render(doc, report.load_results(tmp_path))
    assert "| 150 / 168 / 180 | 18 (max_tokens 1024) | 0 | 0.71 / 25.5 |" in out
    assert (
        "| 16 (32 requests) | 22.00 (20.00–24.00) | 20.00 (19.00–21.00) | 1.10× | 1.20× | 3 |"
        in out
    )
    assert "| 8 | 260 (110 forced) | 150 | 1.73 |" in out
    assert report.render(out, report.load_results(tmp_path)) == out


def test_report_renders_scale_out_and_tensor_parallel(tmp_path: Path) -> None:
    """Data-parallel levels read dp2 against single; TP levels show every side's step and
    the collectives of the two TP=2 sides (TP=1 has none)."""
    serve_metrics = ["output_tok_per_s", "ttft_p50_ms", "tpot_p50_ms"]
    sides = {
        "single": [{"output_tok_per_s": 600.0, "ttft_p50_ms": 1200.0, "tpot_p50_ms": 88.0}],
        "dp2": [{"output_tok_per_s": 750.0, "ttft_p50_ms": 1900.0, "tpot_p50_ms": 64.0}],
    }
    scale_out = {
        "benchmark": "scale_out",
        "provenance": PROVENANCE,
        "levels": [
            {
                "concurrency": 64,
                "num_prompts": 128,
                "comparison": common.compare(sides, serve_metrics, "single"),
            }
        ],
    }
    tp_metrics = ["step_ms", "allreduce_us", "allreduces_per_step", "gather_us"]
    tp_runs = {
        "tp1": [{"step_ms": 17.8}],
        "tp2-gloo": [
            {"step_ms": 99.8, "allreduce_us": 1394, "allreduces_per_step": 49, "gather_us": 941}
        ],
        "tp2-shm": [
            {"step_ms": 27.5, "allreduce_us": 78, "allreduces_per_step": 49, "gather_us": 358}
        ],
    }
    tp = {
        "benchmark": "tensor_parallel",
        "provenance": PROVENANCE,
        "config": {"model": "qwen2.5-coder-0.5b"},
        "levels": [{"batch": 1, **common.compare(tp_runs, tp_metrics, "tp1")}],
    }
    (tmp_path / "scale_out.json").write_text(json.dumps(scale_out))
    (tmp_path / "tp.json").write_text(json.dumps(tp))
    out = report.render(report.DOC.read_text(encoding="utf-8"), report.load_results(tmp_path))
    assert "| 64 (128 prompts) | 750.0 / 600.0 | 1.25× | 1,900 / 1,200 | 64.0 / 88.0 | 1 |" in out
    tp_row = "qwen2.5-coder-0.5b, batch 1 | 17.8 / 99.8 / 27.5 | 1,394 / 78 | 941 / 358 | 49 | 1 |"
    assert tp_row in out


def test_docs_results_need_a_clean_tree(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A figure the docs cite must name the code it ran: a dirty tree is refused when the
    # arguments are parsed, before the benchmark runs.
    target = str(common.DOCS_RESULTS / "x.json")
    for state in ({"commit": "abc", "dirty": True}, {"commit": None, "dirty": None}):
        monkeypatch.setattr(common, "_git_state", lambda state=state: state)
        with pytest.raises(common.argparse.ArgumentTypeError, match="clean committed tree"):
            common.output_path(target)
        assert common.output_path(str(tmp_path / "x.json")) == tmp_path / "x.json"
    monkeypatch.setattr(common, "_git_state", lambda: {"commit": "abc", "dirty": False})
    assert common.output_path(target) == Path(target)


def test_provenance_names_the_cpu_generation() -> None:
    ident = common.provenance()["cpu"]
    if not Path("/proc/cpuinfo").exists():
        pytest.skip("no /proc/cpuinfo here")
    assert ident["vendor"] and isinstance(ident["family"], int)
    if ident["vendor"] == "AuthenticAMD" and ident["family"] in (25, 26):
        assert ident["microarchitecture"] in ("Zen 3", "Zen 4", "Zen 5")


def test_llama_cpp_build_reads_the_cmake_cache(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    binary = tmp_path / "bin" / "llama-bench"
    binary.write_text("#!/bin/sh\necho 'version: 1 (build 1, commit abc1234)'\n")
    binary.chmod(0o755)
    cache = "GGML_AVX2:BOOL=ON\nGGML_AVX512:BOOL=OFF\nGGML_NATIVE:BOOL=OFF\nOTHER:STRING=x\n"
    (tmp_path / "CMakeCache.txt").write_text(cache)
    build = common.llama_cpp_build(binary)
    assert build["isa"] == "avx2" and "commit abc1234" in build["version"][0]
    assert "OTHER" not in build["cmake"] and build["cmake"]["GGML_AVX2"] == "ON"
