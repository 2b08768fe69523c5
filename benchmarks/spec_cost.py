"""What a draft token costs: the step time against the query tokens of a step.

A wider sweep than the table the engine measures at start-up (sluice/engine/
speculative/step_costs.py), for the architecture notes and for comparing machines.
B decode rows (B = 1, 2, 3, 4, 8, 16) each compute 1 + k tokens (k = 0
to 8 drafts) at a ~200-token context, through the runner and the sampler exactly as a
verifying step does (logits of every verified position, greedy rows). Each (B, k) is
timed once per round, in alternating order, and the median of --rounds rounds is kept.

From the table: c(B) = (t(B, k) - t(B, 0)) / (k t(B, 0)), averaged over k, the cost
of one draft token as a fraction of a decode step with B rows. One draft accepted with
probability a pays only while c(B) < a; max_decode_rows is the largest B up to which
c stays below GOOD_ACCEPTANCE (what n-gram drafts reach where the output copies its
input). step_cost is the step time with k drafts at one row, relative to k = 0 (it
rises in steps where the rows outgrow a kernel's pass: 8 rows for weights in panel
order, csrc/qpanel.h's kQpRows; 12 for the block kernel at AVX-512, 4 below).

Run from the repo root:
    .venv/bin/python benchmarks/spec_cost.py
    .venv/bin/python benchmarks/spec_cost.py --dtype float32 --rounds 15
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import itertools  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    add_output_arg,
    format_table,
    round_order,
    shown_path,
    write_result,
)
from sluice import LLM  # noqa: E402
from sluice.core.request import DraftRow, Request, SamplingRow  # noqa: E402
from sluice.engine.engine import LLMEngine  # noqa: E402
from sluice.sampling_params import SamplingParams  # noqa: E402

ROWS = (1, 2, 3, 4, 8, 16)
DRAFTS = (0, 1, 2, 3, 4, 6, 8)
CONTEXT = 200
GOOD_ACCEPTANCE = 0.8


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="decode rows to measure")
    add_output_arg(ap, "spec_cost")
    return ap.parse_args()


def decoding_requests(llm: LLM, n: int) -> list[Request]:
    """n requests with a CONTEXT-token prompt, prefilled, each about to decode."""
    eng = llm.engine
    text = "The river rose through the night, and the lower streets were under water. " * 20
    prompt = llm.tokenizer.encode(text)[:CONTEXT]
    for i in range(n):
        eng.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=10_000))
    while eng.scheduler.waiting or any(
        r.num_computed_tokens < r.num_tokens - 1 for r in eng.scheduler.running
    ):
        eng.step()
    return list(eng.scheduler.running)[:n]


def time_step(eng: LLMEngine, reqs: list[Request], k: int) -> float:
    """One verifying step of `reqs` with k drafts each (nothing is kept)."""
    for r in reqs:
        r.spec_token_ids = [r.all_token_ids[-1]] * k
        assert eng.kv.allocate_slots(r, 1 + k)
    rows: list[SamplingRow] = []
    for r in reqs:
        rows.append(r)
        rows.extend(DraftRow(r, r.spec_token_ids[:j]) for j in range(1, k + 1))
    t0 = time.perf_counter()
    out = eng.runner.execute([(r, 1 + k) for r in reqs])
    eng.sampler(out.logits, rows, [[] for _ in rows])
    elapsed = time.perf_counter() - t0
    for r in reqs:
        r.spec_token_ids = []
    return elapsed


def measure(
    eng: LLMEngine, reqs: list[Request], rows: list[int], rounds: int
) -> dict[tuple[int, int], float]:
    cases = [(b, k) for b in rows for k in DRAFTS]
    names = [f"{b}x{k}" for b, k in cases]
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(2):  # warm-up
        for b, k in cases:
            time_step(eng, reqs[:b], k)
    for i in range(rounds):
        for name in round_order(names, i):
            b, k = (int(x) for x in name.split("x"))
            times[name].append(time_step(eng, reqs[:b], k))
    return {case: statistics.median(times[n]) for case, n in zip(cases, names, strict=True)}


def draft_cost(t: dict[tuple[int, int], float], b: int) -> float:
    """A draft token's time as a fraction of a decode step with b rows."""
    base = t[(b, 0)]
    return statistics.mean((t[(b, k)] - base) / (k * base) for k in DRAFTS if k)


def main() -> None:
    args = parse_args()
    rows = sorted(int(x) for x in args.rows.split(","))
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory=0.5, num_threads=args.threads)
    eng = llm.engine
    reqs = decoding_requests(llm, max(rows))
    with torch.inference_mode():
        t = measure(eng, reqs, rows, args.rounds)
    costs = {b: draft_cost(t, b) for b in rows}
    paying = list(itertools.takewhile(lambda b: costs[b] < GOOD_ACCEPTANCE, rows))
    max_rows = max(paying, default=0)
    step_cost = [t[(rows[0], k)] / t[(rows[0], 0)] for k in DRAFTS]
    headers = ["rows", *[f"k={k} ms" for k in DRAFTS], "draft cost"]
    table = [[b, *[f"{t[(b, k)] * 1e3:.2f}" for k in DRAFTS], f"{costs[b]:.3f}"] for b in rows]
    print(f"{eng.dtype}, {eng.quantization}, CPU kernels {eng.cpu_kernels}")
    print(format_table(headers, table))
    print(f"max_decode_rows = {max_rows}")
    print(f"step_cost ({rows[0]} row, k = {DRAFTS}) = ({', '.join(f'{c:.2f}' for c in step_cost)})")
    payload: dict[str, Any] = {
        "dtype": str(eng.dtype).removeprefix("torch."),
        "quantization": eng.quantization,
        "context": CONTEXT,
        "rounds": args.rounds,
        "drafts": list(DRAFTS),
        "step_ms": {f"{b}x{k}": t[(b, k)] * 1e3 for b in rows for k in DRAFTS},
        "draft_cost": costs,
        "max_decode_rows": max_rows,
        "step_cost": step_cost,
    }
    print("wrote", shown_path(write_result("spec_cost", payload, args.output)))


if __name__ == "__main__":
    main()
