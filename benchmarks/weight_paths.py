"""Offline throughput of many streams per weight path, interleaved in one run.

`gguf` keeps a GGUF's blocks as stored and serves large batches by dequantizing tiles
for the dense GEMM; `int4`/`int8` requantize and keep a dense copy of every weight for
large batches (what `auto` ran before). This prints output tokens/s of each with
--num-prompts ShareGPT first turns submitted at once (64: a 64-stream decode), 128
tokens each with ignore_eos, medians of --rounds interleaved rounds, every engine
loaded once in this process, and each one's weight bytes; the issue-13 target is
gguf >= 0.9x the dense copy. Writes benchmarks/results/weight_paths.json (--output).

Run from the repo root:
    .venv/bin/python benchmarks/weight_paths.py
    .venv/bin/python benchmarks/weight_paths.py --num-prompts 4 --max-tokens 4 --rounds 1
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.common import (  # noqa: E402
    add_output_arg,
    add_rounds_arg,
    compare,
    fmt_spread,
    format_table,
    interleave,
    write_result,
)
from benchmarks.throughput import render_prompts, run_sluice  # noqa: E402
from sluice import LLM, SamplingParams  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="alias or path (default smollm2)")
    ap.add_argument("--methods", default="gguf,int4", help="quantizations, first = baseline")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0, help="ShareGPT shuffle seed")
    ap.add_argument("--kv-cache-memory", type=float, default=2.0)
    add_rounds_arg(ap)
    add_output_arg(ap, "weight_paths")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    methods = args.methods.split(",")
    engines = {
        m: LLM(args.model, quantization=m, kv_cache_memory=args.kv_cache_memory) for m in methods
    }
    _, ids = render_prompts(engines[methods[0]], args)
    for llm in engines.values():  # warm-up: kernels built, first shapes seen
        llm.generate(ids[:2], SamplingParams(max_tokens=4), use_tqdm=False)

    def measure(method: str) -> dict[str, Any]:
        return run_sluice(engines[method], ids, args.max_tokens)

    runs = interleave(methods, args.rounds, measure, label="weights")
    cmp = compare(runs, ["tokens_per_s"], methods[-1])
    info = {m: engines[m].engine.stats() for m in methods}
    ratios = cmp["ratio_of_medians"]
    rows = [
        [
            m,
            info[m]["dtype"],
            f"{info[m]['weight_bytes'] / 2**20:.0f}",
            fmt_spread(cmp["summary"][m]["tokens_per_s"]),
            f"{ratios[m]['tokens_per_s']:.2f}x" if m in ratios else "1.00x (baseline)",
        ]
        for m in methods
    ]
    print(
        f"\n== {args.num_prompts} prompts at once, {args.max_tokens} tokens each; "
        f"median (min-max) of {args.rounds} interleaved rounds =="
    )
    print(format_table(["weights", "dtype", "weight MiB", "output tok/s", "ratio"], rows))
    result = {
        "config": {k: str(v) for k, v in vars(args).items()},
        "comparison": cmp,
        "weight_bytes": {m: info[m]["weight_bytes"] for m in methods},
        "dtype": {m: info[m]["dtype"] for m in methods},
    }
    print(f"wrote {write_result('weight_paths', result, args.output)}")


if __name__ == "__main__":
    main()
