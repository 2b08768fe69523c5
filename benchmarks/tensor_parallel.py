"""Tensor parallelism on one machine: decode step time at TP=1 and TP=2, and the time
of one all-reduce at TP=2 through gloo against shared memory, in the same run.

    python benchmarks/tensor_parallel.py                       # Qwen2.5-Coder-0.5B, 3 rounds
    python benchmarks/tensor_parallel.py --batch 1,8 --steps 32 --rounds 5

The threads are shared out: TP=1 runs one engine on --threads, TP=2 two ranks on
--threads / 2 each, so the comparison is at equal cores. Every side is started, warmed
up, measured and shut down per round, sides interleaved (tp1, tp2-gloo, tp2-shm;
reversed the next round), medians over rounds.

Per side and batch size: the median decode step (ms) over --steps steps after the
prefill, and for TP=2 rank 0's all-reduce time per call (µs: its wait for the slower
rank included, which is what a step pays) and the number of all-reduces per step.
Results go to benchmarks/results/tensor_parallel.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import add_output_arg, add_rounds_arg, compare, interleave, write_result
from sluice import LLM, SamplingParams

SIDES = {"tp1": (1, "auto"), "tp2-gloo": (2, "gloo"), "tp2-shm": (2, "shm")}
PROMPT = "Write a Python function that parses a CSV file and returns the rows as dicts."


def measure(side: str, args: argparse.Namespace, batch: int) -> dict[str, Any]:
    size, allreduce = SIDES[side]
    os.environ["SLUICE_TP_ALLREDUCE"] = allreduce
    llm = LLM(
        args.model,
        tensor_parallel_size=size,
        num_threads=args.threads,
        dtype=args.dtype,
        kv_cache_memory=0.5,
        max_model_len=1024,
    )
    try:
        engine = llm.engine
        llm.generate(PROMPT, SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        sp = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"b{i}", PROMPT, sp)
        while any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
        ) or (engine.scheduler.waiting):
            engine.step()  # prefill
        group = engine.tp_group
        if group is not None:
            group.reset_stats()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        out: dict[str, Any] = {"step_ms": statistics.median(times) * 1e3}
        if group is not None:
            stats = group.reset_stats()
            out["allreduce_us"] = stats.all_reduce_seconds / max(stats.all_reduces, 1) * 1e6
            out["allreduces_per_step"] = stats.all_reduces / args.steps
            out["gather_us"] = stats.gather_seconds / max(stats.gathers, 1) * 1e6
        return out
    finally:
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2, help="threads in all, on every side")
    ap.add_argument("--batch", default="1,8", help="comma-separated decode batch sizes")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per run")
    add_rounds_arg(ap)
    add_output_arg(ap, "tensor_parallel")
    args = ap.parse_args()
    metrics = ["step_ms", "allreduce_us", "allreduces_per_step", "gather_us"]
    levels = []
    for batch in [int(b) for b in args.batch.split(",") if b.strip()]:
        runs = interleave(
            list(SIDES), args.rounds, lambda s, b=batch: measure(s, args, b), f"batch {batch}"
        )
        summary = compare(runs, metrics, baseline="tp1")
        levels.append({"batch": batch, **summary})
        for side in SIDES:
            med = {m: summary["summary"][side][m]["median"] for m in metrics}
            print(
                f"batch {batch:3d} {side:9s} step {med['step_ms']:7.2f} ms  "
                f"all-reduce {med['allreduce_us']:7.1f} us "
                f"x {med['allreduces_per_step']:.0f}/step  "
                f"gather {med['gather_us']:7.1f} us"
            )
    path = write_result(
        "tensor_parallel", {"config": vars(args), "levels": levels}, args.output, args.threads
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
