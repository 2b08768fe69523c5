"""Offline throughput: sluice vs plain transformers `generate`, in the same run.

256 ShareGPT first turns (rendered with the model's chat template), 128 output tokens each
with ignore_eos; prints output tokens/s for sluice and for transformers (static batches of
16, same dtype) and their ratio (target >= 5x), plus single-stream decode tokens/s,
time-to-ready of a fresh process, KV waste and preemptions. Writes
benchmarks/results/throughput.json.

Run from the repo root:
    .venv/bin/python benchmarks/throughput.py
    .venv/bin/python benchmarks/throughput.py --num-prompts 16 --max-tokens 16  # smoke test
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script (`python benchmarks/throughput.py`), `benchmarks` is not importable otherwise.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import gc  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.common import (  # noqa: E402
    REPO_ROOT,
    add_engine_args,
    engine_options,
    format_table,
    ratio,
    write_result,
)
from benchmarks.datasets import sharegpt_prompts  # noqa: E402
from sluice import LLM  # noqa: E402
from sluice.outputs import RequestOutput  # noqa: E402
from sluice.sampling_params import SamplingParams  # noqa: E402

TARGET_RATIO = 8.0  # issue 5 (issue 2 asked for 5x)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="sluice model (alias/path; default smollm2)")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument(
        "--hf-num-prompts",
        type=int,
        default=None,
        help="prompts for transformers (default: --num-prompts); tokens/s is a rate, "
        "so fewer saves time",
    )
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-ready", action="store_true", help="skip the time-to-ready subprocess")
    ap.add_argument("--seed", type=int, default=0, help="ShareGPT shuffle seed")
    add_engine_args(ap)
    ap.add_argument("--name", default="throughput", help="results/<name>.json")
    return ap.parse_args()


def time_to_ready(model: str | None, dtype: str) -> dict[str, float]:
    """Seconds for a fresh process to import sluice and build LLM(): in-process and total.

    Run twice: the first pays for cold file caches (and any warm-start cache being
    written), the second is what a restarted server sees, and is the one reported.
    """
    code = (
        "import time; t=time.perf_counter(); from sluice import LLM; "
        f"LLM(model={model!r}, dtype={dtype!r}); print(time.perf_counter()-t)"
    )
    runs = []
    for _ in range(2):
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True
        )
        total = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"time-to-ready subprocess failed:\n{proc.stderr[-2000:]}")
        in_process = float(proc.stdout.strip().splitlines()[-1])
        runs.append({"in_process_s": in_process, "total_s": total})
    return {
        "cold_in_process_s": runs[0]["in_process_s"],
        "cold_total_s": runs[0]["total_s"],
        "warm_in_process_s": runs[1]["in_process_s"],
        "warm_total_s": runs[1]["total_s"],
    }


def render_prompts(llm: LLM, args: argparse.Namespace) -> tuple[list[str], list[list[int]]]:
    """ShareGPT first turns through the chat template: (texts for transformers, ids for sluice).

    Both sides get the very same rendered text, tokenized without extra specials (the
    template already has them), as `hf_generate_throughput` does with its texts.
    """
    tok = llm.tokenizer
    raw = sharegpt_prompts(
        args.num_prompts,
        seed=args.seed,
        max_prompt_tokens=args.max_prompt_tokens,
        tokenizer_encode=lambda s: tok.encode(s, add_special_tokens=False),
    )
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        for p in raw
    ]
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    return texts, ids


def engine_counters(llm: LLM) -> dict[str, float]:
    """Cumulative counters, so a phase's share can be taken as a difference."""
    stats = llm.engine.stats()
    waste = getattr(llm.engine, "waste", None)
    return {
        "preemptions": stats.get("num_preemptions", 0),
        "allocated_slots": getattr(waste, "allocated_slots", 0),
        "used_slots": getattr(waste, "used_slots", 0),
        "hit_tokens": stats.get("prefix_cache_hit_tokens", 0),
        "queried_tokens": stats.get("prefix_cache_queried_tokens", 0),
    }


def run_sluice(llm: LLM, ids: list[list[int]], max_tokens: int) -> dict[str, Any]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    # Warm-up (untimed), like the transformers side: first calls pay for allocation.
    llm.generate(
        ids[: min(2, len(ids))], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    llm.engine.reset_prefix_cache()  # the timed run must not reuse the warm-up's prompts
    before = engine_counters(llm)
    t0 = time.perf_counter()
    outs = llm.generate(ids, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = engine_counters(llm)
    d = {k: after[k] - before[k] for k in before}

    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    expected = max_tokens * len(ids)
    if out_tokens != expected:
        raise RuntimeError(f"sluice generated {out_tokens} tokens, expected {expected}")
    ttfts = [_ttft(o) for o in outs]
    stats = llm.engine.stats()
    return {
        "output_tokens": out_tokens,
        "prompt_tokens": sum(len(x) for x in ids),
        "seconds": seconds,
        "tokens_per_s": out_tokens / seconds,
        "num_prompts": len(ids),
        "max_tokens": max_tokens,
        "dtype": stats.get("dtype"),
        # Over the timed run only: allocated-but-unused KV slots, averaged over steps.
        "kv_waste": 1.0 - ratio(d["used_slots"], d["allocated_slots"])
        if d["allocated_slots"]
        else stats.get("kv_waste"),
        "kv_waste_engine_cumulative": stats.get("kv_waste"),
        "num_preemptions": int(d["preemptions"]),
        "prefix_cache_hit_rate": ratio(d["hit_tokens"], d["queried_tokens"]),
        "mean_ttft_s": sum(ttfts) / len(ttfts),
    }


def _ttft(out: RequestOutput) -> float:
    m = out.metrics
    assert m is not None and m.first_token_time is not None
    return m.first_token_time - m.arrival_time


def single_stream(llm: LLM, prompt_ids: list[int], max_tokens: int) -> dict[str, float]:
    """One request alone: decode tokens/s from its first token to its last (prefill excluded)."""
    llm.engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    (out,) = llm.generate([prompt_ids], params, use_tqdm=False)
    m = out.metrics
    assert m is not None and m.first_token_time is not None and m.finished_time is not None
    n = len(out.outputs[0].token_ids)
    decode_s = m.finished_time - m.first_token_time
    # The first token comes from the prefill; the remaining n-1 are the decode steps.
    return {
        "prompt_tokens": len(prompt_ids),
        "output_tokens": n,
        "ttft_s": m.first_token_time - m.arrival_time,
        "decode_seconds": decode_s,
        "decode_tokens_per_s": (n - 1) / decode_s if decode_s > 0 else float("nan"),
    }


def run_hf(model_path: Path, texts: list[str], args: argparse.Namespace, dtype: str) -> dict:
    import torch

    from benchmarks.hf_baseline import hf_generate_throughput

    if model_path.suffix != ".gguf" and not any(model_path.glob("*.gguf")):
        raise RuntimeError(f"hf_baseline loads GGUF files only; {model_path} is not one")
    n = args.hf_num_prompts or args.num_prompts
    # chat_template=False: the texts are already rendered, exactly as sluice received them.
    return hf_generate_throughput(
        str(model_path),
        texts[:n],
        args.max_tokens,
        batch_size=args.hf_batch_size,
        dtype=getattr(torch, dtype),
        chat_template=False,
    )


def main() -> None:
    args = parse_args()
    result: dict[str, Any] = {"config": vars(args)}

    if not args.skip_ready:
        # First, before this process holds a model: the child should not compete for memory.
        print("time-to-ready: 2 fresh processes ...", flush=True)
        result["time_to_ready"] = time_to_ready(args.model, args.dtype)

    print("loading sluice ...", flush=True)
    llm = LLM(args.model, **engine_options(args))
    dtype = str(llm.engine.dtype).removeprefix("torch.")
    model_path = Path(llm.engine.model_path)
    result["sluice_startup_s"] = llm.engine.startup_seconds
    texts, ids = render_prompts(llm, args)

    print(f"sluice: {len(ids)} prompts x {args.max_tokens} tokens ({dtype}) ...", flush=True)
    result["sluice"] = run_sluice(llm, ids, args.max_tokens)
    print("sluice: single-stream decode ...", flush=True)
    result["single_stream"] = single_stream(llm, ids[0], args.max_tokens)
    result["engine_stats"] = llm.engine.stats()
    del llm
    gc.collect()  # free the engine's KV pool before transformers loads its copy

    if not args.skip_hf:
        n = args.hf_num_prompts or args.num_prompts
        print(f"transformers: {n} prompts x {args.max_tokens} tokens ({dtype}) ...", flush=True)
        result["transformers"] = run_hf(model_path, texts, args, dtype)

    report(result, args, dtype)
    path = write_result(args.name, result)
    print(f"\nwrote {path.relative_to(REPO_ROOT)}")


def report(result: dict[str, Any], args: argparse.Namespace, dtype: str) -> None:
    s = result["sluice"]
    rows: list[list[Any]] = [
        [
            "sluice",
            s["num_prompts"],
            s["prompt_tokens"],
            s["output_tokens"],
            s["seconds"],
            s["tokens_per_s"],
        ],
    ]
    hf = result.get("transformers")
    if hf:
        rows.append(
            [
                f"transformers (bs={hf['batch_size']})",
                hf["num_prompts"],
                hf["prompt_tokens"],
                hf["output_tokens"],
                hf["seconds"],
                hf["tokens_per_s"],
            ]
        )
    print(f"\n== Throughput: ShareGPT, {args.max_tokens} output tokens, ignore_eos, {dtype} ==")
    print(
        format_table(
            ["system", "prompts", "prompt tok", "output tok", "seconds", "out tok/s"], rows
        )
    )

    ss = result["single_stream"]
    summary: list[list[Any]] = []
    if hf:
        r = ratio(s["tokens_per_s"], hf["tokens_per_s"])
        result["ratio_vs_transformers"] = r
        verdict = "PASS" if r >= TARGET_RATIO else "below target"
        summary.append(
            ["sluice / transformers", f"{r:.2f}x  (target >= {TARGET_RATIO:g}x: {verdict})"]
        )
    summary += [
        [
            "single-stream decode",
            f"{ss['decode_tokens_per_s']:.1f} tok/s "
            f"({ss['output_tokens']} tokens, prompt {ss['prompt_tokens']}, "
            f"TTFT {ss['ttft_s'] * 1000:.0f} ms)",
        ],
    ]
    ready = result.get("time_to_ready")
    if ready:
        summary.append(
            [
                "time-to-ready (warm)",
                f"{ready['warm_in_process_s']:.2f} s in process, "
                f"{ready['warm_total_s']:.2f} s incl. interpreter "
                f"(cold: {ready['cold_total_s']:.2f} s)",
            ]
        )
    summary += [
        ["sluice startup (this run)", f"{result['sluice_startup_s']:.2f} s"],
        ["KV waste (timed run)", f"{s['kv_waste'] * 100:.1f}%"],
        ["preemptions (timed run)", str(s["num_preemptions"])],
        ["prefix-cache hit rate", f"{s['prefix_cache_hit_rate'] * 100:.1f}%"],
        ["mean TTFT (batch run)", f"{s['mean_ttft_s']:.2f} s"],
    ]
    print()
    print(format_table(["metric", "value"], summary, left=2))


if __name__ == "__main__":
    main()
