"""`sluice bench`: summary and plots from synthetic results (no benchmark is run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sluice import bench

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _fake_results() -> dict[str, dict[str, Any]]:
    """Small dicts with the same layout as benchmarks/results/*.json."""
    machine = {"cpu_model": "test cpu", "cpu_count": 2}

    def side(ttft_p50: float, ttft_p99: float, hit: float) -> dict[str, float]:
        return {"ttft_p50_s": ttft_p50, "ttft_p99_s": ttft_p99, "hit_rate": hit, "total_s": 1.0}

    return {
        "throughput": {
            "benchmark": "throughput",
            "machine": machine,
            "time_to_ready": {"cold_total_s": 4.5},
            "sluice": {"tokens_per_s": 500.0, "output_tokens": 1000},
            "single_stream": {"ttft_s": 0.05, "decode_tokens_per_s": 50.0},
            "transformers": {"tokens_per_s": 100.0},
            "ratio_vs_transformers": 5.0,
        },
        "serve": {
            "model": "smollm2-135m",
            "levels": [
                {
                    "concurrency": c,
                    "num_prompts": 4 * c,
                    "errors": 0,
                    "output_tok_per_s": 30.0 * c,
                    "requests_per_s": 0.2 * c,
                    "ttft_p50_ms": 80.0 * c,
                    "ttft_p99_ms": 100.0 * c,
                    "tpot_p50_ms": 30.0 + c,
                    "tpot_p99_ms": 35.0 + c,
                    "error_samples": [],
                }
                for c in (16, 1, 4)  # unsorted on purpose
            ],
            "llama_server": {  # serve.py ran llama-server side by side
                "levels": [
                    {
                        "concurrency": c,
                        "output_tok_per_s": 10.0 * c,
                        "ttft_p50_ms": 200.0 * c,
                        "ttft_p99_ms": 300.0 * c,
                        "tpot_p50_ms": 50.0 + c,
                        "tpot_p99_ms": 60.0 + c,
                    }
                    for c in (1, 4, 16)
                ]
            },
        },
        "prefix": {
            "benchmark": "prefix_cache",
            "machine": machine,
            "workloads": {
                "shared_prompt": {
                    "off": side(1.6, 13.9, 0.0),
                    "on": side(0.5, 0.9, 0.97),
                    "total_ratio": 6.5,
                },
                "chat_replay": {
                    "off": side(1.7, 3.9, 0.0),
                    "on": side(1.3, 2.0, 0.79),
                    "total_ratio": 3.0,
                },
            },
        },
        "single": {
            "benchmark": "single_stream",
            "machine": machine,
            "sluice": {"int4": {"decode_tokens_per_s": 120.0, "ttft_s": 0.04}},
            "llamacpp": {"decode_tokens_per_s": 100.0, "ttft_s": 0.1},
        },
        "quantization": {
            "benchmark": "quantization",
            "machine": machine,
            "results": {
                "fp32 reference": {"perplexity": 20.5},
                "int8": {"perplexity": 20.6, "single_stream_tok_s": 78.0},
            },
        },
    }


def test_summary_numbers() -> None:
    summary = bench.summarize(_fake_results())
    assert summary["throughput"]["sluice_tok_s"] == 500.0
    assert summary["throughput"]["transformers_tok_s"] == 100.0
    assert summary["throughput"]["ratio_vs_transformers"] == 5.0
    assert [lvl["concurrency"] for lvl in summary["serve"]] == [16, 1, 4]
    assert summary["serve"][1]["ttft_p99_ms"] == 100.0
    assert summary["serve"][0]["llama_server_tok_per_s"] == 160.0
    assert summary["serve"][0]["vs_llama_server"] == 3.0
    assert summary["prefix"]["shared_prompt"]["ttft_p50_on_s"] == 0.5
    assert summary["prefix"]["chat_replay"]["hit_rate"] == 0.79
    assert summary["quantization"]["int8"]["single_stream_tok_s"] == 78.0
    assert summary["single"]["int4"]["vs_llamacpp"] == 1.2
    assert summary["single"]["llama.cpp"]["decode_tok_s"] == 100.0
    assert summary["quantization"]["fp32 reference"]["top1_agreement_vs_fp32"] is None
    table = bench.format_summary(summary)
    assert "sluice_tok_s" in table and "concurrency=16" in table and "chat_replay" in table


def test_summary_json_and_plots(tmp_path: Path) -> None:
    results = _fake_results()
    summary_path = bench.write_summary(results, tmp_path)
    data = json.loads(summary_path.read_text())
    assert data["machine"]["cpu_model"] == "test cpu"
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
    # A throughput run with --skip-hf has no transformers baseline.
    throughput = dict(_fake_results()["throughput"])
    del throughput["transformers"]
    del throughput["ratio_vs_transformers"]
    paths = bench.plot_all({"throughput": throughput}, tmp_path)
    assert [p.name for p in paths] == ["throughput.png"]
    assert bench.summarize({"throughput": throughput})["throughput"]["transformers_tok_s"] is None


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
