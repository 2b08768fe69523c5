"""Data parallelism on one machine: two replicas with one thread each against one
engine with two threads, in the same run, at 1, 16 and 64 streams.

    python benchmarks/scale_out.py                       # ShareGPT prompts, 3 rounds
    python benchmarks/scale_out.py --concurrency 1 --num-prompts 2 --max-tokens 8 --rounds 1

On two cores the replicas cannot add arithmetic; what they can win is the work around
it running in parallel: each replica's Python step overhead, sampling and
detokenization run in its own process, where one engine does them on one thread
between its parallel matmuls. What they lose: each replica's matmuls use one core (no
OpenMP split), a request is computed in a batch half as large (weights are read twice
per step pair), the front end's extra hop (a pipe, pickling) and two copies of the
weights. The ratio is printed as measured.

Sides run interleaved (single, dp2; dp2, single; ...), each started, warmed up with one
request and stopped per measurement (benchmarks/serve.py's machinery). Results go to
benchmarks/results/scale_out.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import add_output_arg, add_rounds_arg, compare, interleave, write_result
from benchmarks.datasets import sharegpt_prompts
from benchmarks.serve import METRICS, Server, measure, print_report, start_sluice


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def sides(threads: int, extra: list[str]) -> dict[str, list[str]]:
    """`sluice serve` arguments per side: one engine on all threads, or one replica per
    thread."""
    return {
        "single": ["--num-threads", str(threads), *extra],
        f"dp{threads}": [
            "--num-threads", str(threads), "--data-parallel-size", str(threads), *extra
        ],
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--concurrency", default="1,16,64", help="comma-separated levels")
    ap.add_argument("--num-prompts", default="8,32,128", help="one number, or one per level")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-bytes", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2, help="threads in all, on either side")
    ap.add_argument("--server-args", default="", help="more `sluice serve` arguments, both sides")
    ap.add_argument("--seed", type=int, default=0)
    add_rounds_arg(ap)
    add_output_arg(ap, "scale_out")
    args = ap.parse_args()
    levels, counts = _ints(args.concurrency), _ints(args.num_prompts)
    counts = counts * len(levels) if len(counts) == 1 else counts
    if len(counts) != len(levels):
        raise SystemExit("--num-prompts needs one number or one per --concurrency level")
    commands = sides(args.threads, args.server_args.split())
    servers = {
        name: Server(name, lambda _conc, a=argv: start_sluice(a)) for name, argv in commands.items()
    }
    pool = sharegpt_prompts(
        sum(counts),
        seed=args.seed,
        max_prompt_tokens=args.max_prompt_bytes,
        tokenizer_encode=lambda s: list(s.encode("utf-8")),
    )
    sampling = {"temperature": 0.0}
    result: dict[str, Any] = {
        "config": vars(args),
        "servers": {n: {"command": "sluice serve " + " ".join(a)} for n, a in commands.items()},
        "max_tokens": args.max_tokens,
        "levels": [],
    }
    start = 0
    for conc, count in zip(levels, counts, strict=True):
        prompts, start = pool[start : start + count], start + count
        runs = interleave(
            list(servers),
            args.rounds,
            lambda name, p=prompts, c=conc: measure(servers[name], p, c, args.max_tokens, sampling),
            label=f"concurrency {conc}",
        )
        level = {"concurrency": conc, "num_prompts": count}
        result["levels"].append(level | {"comparison": compare(runs, METRICS, baseline="single")})
    print_report(result)
    path = write_result("scale_out", result, args.output, threads=args.threads)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
