"""Offline throughput: sluice vs plain transformers `generate`, interleaved in one run.

256 ShareGPT first turns (rendered with the model's chat template), 128 output tokens each
with ignore_eos; output tokens/s for sluice and for transformers (static batches of 16,
same dtype, same threads), in --rounds interleaved rounds (sluice, transformers;
transformers, sluice; ...), both loaded once. Prints the median and the min-max of each
side and the ratio of the medians (target >= 8x), plus time-to-ready of a fresh process,
KV waste and preemptions. Writes benchmarks/results/throughput.json (--output).

Run from the repo root:
    .venv/bin/python benchmarks/throughput.py
    .venv/bin/python benchmarks/throughput.py --num-prompts 4 --max-tokens 4 --rounds 1  # smoke
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script (`python benchmarks/throughput.py`), `benchmarks` is not importable otherwise.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.common import (  # noqa: E402
    REPO_ROOT,
    add_engine_args,
    add_output_arg,
    add_rounds_arg,
    compare,
    engine_options,
    fmt_spread,
    format_table,
    interleave,
    ratio,
    shown_path,
    spread,
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
    add_rounds_arg(ap)
    add_engine_args(ap)
    add_output_arg(ap, "throughput")
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
    """One timed pass over all prompts (the caller warmed the engine up)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    llm.engine.reset_prefix_cache()  # no run may reuse an earlier run's prompts
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
    return {
        "output_tokens": out_tokens,
        "prompt_tokens": sum(len(x) for x in ids),
        "seconds": seconds,
        "tokens_per_s": out_tokens / seconds,
        # Over this run only: allocated-but-unused KV slots, averaged over steps.
        "kv_waste": 1.0 - ratio(d["used_slots"], d["allocated_slots"])
        if d["allocated_slots"]
        else None,
        "num_preemptions": int(d["preemptions"]),
        "prefix_cache_hit_rate": ratio(d["hit_tokens"], d["queried_tokens"]),
        "mean_ttft_s": sum(ttfts) / len(ttfts),
    }


def _ttft(out: RequestOutput) -> float:
    m = out.metrics
    assert m is not None and m.first_token_time is not None
    return m.first_token_time - m.arrival_time


class HFSide:
    """transformers `generate` on the same rendered prompts, loaded once for every round."""

    def __init__(
        self, model_path: Path, texts: list[str], args: argparse.Namespace, dtype: str, threads: int
    ) -> None:
        import torch

        from benchmarks.hf_baseline import load_hf

        if model_path.suffix != ".gguf" and not any(model_path.glob("*.gguf")):
            raise RuntimeError(f"hf_baseline loads GGUF files only; {model_path} is not one")
        self.model_path, self.dtype, self.threads = str(model_path), getattr(torch, dtype), threads
        self.texts = texts[: args.hf_num_prompts or args.num_prompts]
        self.max_tokens, self.batch_size = args.max_tokens, args.hf_batch_size
        load_hf(self.model_path, self.dtype)  # memoized: the rounds reuse the loaded model

    def run(self) -> dict[str, Any]:
        from benchmarks.hf_baseline import hf_generate_throughput

        # chat_template=False: the texts are already rendered, exactly as sluice got them.
        return hf_generate_throughput(
            self.model_path,
            self.texts,
            self.max_tokens,
            batch_size=self.batch_size,
            dtype=self.dtype,
            chat_template=False,
            threads=self.threads,  # the same number sluice runs on
        )


def main() -> None:
    args = parse_args()
    result: dict[str, Any] = {"config": vars(args)}

    if not args.skip_ready:
        # First, before this process holds a model: the child should not compete for memory.
        print("time-to-ready: 2 fresh processes ...", flush=True)
        result["time_to_ready"] = time_to_ready(args.model, args.dtype)

    import torch

    print("loading sluice ...", flush=True)
    llm = LLM(args.model, **engine_options(args))
    threads = torch.get_num_threads()  # what the engine set
    dtype = str(llm.engine.dtype).removeprefix("torch.")
    result["sluice_startup_s"] = llm.engine.startup_seconds
    texts, ids = render_prompts(llm, args)
    # Warm-up (untimed) on both sides: first calls pay for allocation.
    llm.generate(ids[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    sides: dict[str, Any] = {"sluice": lambda: run_sluice(llm, ids, args.max_tokens)}
    if not args.skip_hf:
        print("loading transformers ...", flush=True)
        sides["transformers"] = HFSide(Path(llm.engine.model_path), texts, args, dtype, threads).run

    n_hf = len(texts[: args.hf_num_prompts or args.num_prompts])
    print(
        f"{len(ids)} prompts (transformers {n_hf}) x {args.max_tokens} tokens, {dtype}, "
        f"{threads} threads, {args.rounds} rounds",
        flush=True,
    )
    runs = interleave(list(sides), args.rounds, lambda side: sides[side]())
    result["comparison"] = compare(
        runs, ["tokens_per_s", "seconds"], baseline=None if args.skip_hf else "transformers"
    )
    # sluice-only figures: median and spread over its rounds.
    result["sluice_details"] = {
        m: spread([r[m] for r in runs["sluice"]])
        for m in ("kv_waste", "num_preemptions", "mean_ttft_s")
    }
    first = runs["sluice"][0]
    result["workload"] = {
        "num_prompts": len(ids),
        "hf_num_prompts": None if args.skip_hf else n_hf,
        "prompt_tokens": first["prompt_tokens"],
        "output_tokens": first["output_tokens"],
        "max_tokens": args.max_tokens,
        "dtype": dtype,
        "hf_batch_size": None if args.skip_hf else args.hf_batch_size,
        "threads": threads,
    }
    result["engine_stats"] = llm.engine.stats()

    report(result)
    path = write_result("throughput", result, args.output, threads=threads)
    print(f"\nwrote {shown_path(path)}")


def report(result: dict[str, Any]) -> None:
    cmp, w = result["comparison"], result["workload"]
    summary = cmp["summary"]
    rows: list[list[Any]] = [
        [
            "sluice",
            w["num_prompts"],
            fmt_spread(summary["sluice"]["seconds"]),
            fmt_spread(summary["sluice"]["tokens_per_s"]),
        ]
    ]
    if "transformers" in summary:
        rows.append(
            [
                f"transformers (bs={w['hf_batch_size']})",
                w["hf_num_prompts"],
                fmt_spread(summary["transformers"]["seconds"]),
                fmt_spread(summary["transformers"]["tokens_per_s"]),
            ]
        )
    print(
        f"\n== Throughput: ShareGPT, {w['max_tokens']} output tokens, ignore_eos, {w['dtype']}, "
        f"{w['threads']} threads; median (min-max) of {cmp['rounds']} interleaved rounds =="
    )
    print(format_table(["system", "prompts", "seconds", "out tok/s"], rows))

    lines: list[list[Any]] = []
    if "transformers" in summary:
        r = cmp["ratio_of_medians"]["sluice"]["tokens_per_s"]
        verdict = "PASS" if r >= TARGET_RATIO else "below target"
        lines.append(
            ["sluice / transformers", f"{r:.2f}x  (target >= {TARGET_RATIO:g}x: {verdict})"]
        )
    ready = result.get("time_to_ready")
    if ready:
        lines.append(
            [
                "time-to-ready (warm)",
                f"{ready['warm_in_process_s']:.2f} s in process, "
                f"{ready['warm_total_s']:.2f} s incl. interpreter "
                f"(cold: {ready['cold_total_s']:.2f} s)",
            ]
        )
    d = result["sluice_details"]
    lines += [
        ["sluice startup (this run)", f"{result['sluice_startup_s']:.2f} s"],
        ["KV waste (median)", fmt_spread(d["kv_waste"], 100.0) + " %"],
        ["preemptions (median)", fmt_spread(d["num_preemptions"], digits=0)],
        ["mean TTFT (batch run)", fmt_spread(d["mean_ttft_s"], digits=2) + " s"],
    ]
    print()
    print(format_table(["metric", "value"], lines, left=2))


if __name__ == "__main__":
    main()
