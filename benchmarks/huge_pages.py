"""What transparent huge pages do for a decode step's weight reads (sluice/core/host_memory.py).

One-row matmuls are how a decode step reads its weights: each byte once, from memory,
since a layer's weights are far larger than the cache. This times the block kernel
over one layer's linears of a GGUF file (q, k, v, o, gate, up, down, in the layouts the
engine uses) with the same bytes in two places: memory from torch's allocator (4 KiB
pages where THP is `madvise`, most distributions' default) and host_memory's huge-page
mappings. Beside it, the machine's read bandwidth measured both ways: torch's sum over a
1 GiB fp32 tensor. Both sides in one process, on --threads threads, alternating which
goes first each round, medians of --rounds (each round the median of --reps calls).

Run from the repo root (a quiet machine):
    .venv/bin/python benchmarks/huge_pages.py --model /work/models/qwen2.5-7b-Q4_K_M.gguf \\
        --output docs/results/huge_pages-qwen2.5-7b.json
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from benchmarks.common import add_output_arg, add_rounds_arg, format_table, write_result  # noqa: E402
from benchmarks.few_rows import layer_weights  # noqa: E402
from sluice import kernels  # noqa: E402
from sluice.core import host_memory  # noqa: E402
from sluice.core.quantized_tensor import QuantizedTensor  # noqa: E402
from sluice.kernels import qblock  # noqa: E402

SIDES = ("4k", "huge")
GIB = 1 << 30


def placed(w: QuantizedTensor, side: str) -> QuantizedTensor:
    """w's tensors copied into memory of that kind (4k: torch's allocator)."""

    def copy(t: torch.Tensor) -> torch.Tensor:
        if not t.numel():
            return t
        out = host_memory.zeroed(tuple(t.shape), t.dtype) if side == "huge" else torch.empty_like(t)
        return out.copy_(t)

    return dataclasses.replace(
        w,
        packed=copy(w.packed),
        hbits=copy(w.hbits),
        scale=copy(w.scale),
        minimum=copy(w.minimum),
        super_scale=copy(w.super_scale),
    )


def _median_seconds(fn: Callable[[], Any], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _matmul(lib: Any, x: torch.Tensor, w: QuantizedTensor) -> Callable[[], Any]:
    args = (w.packed, w.hbits, w.scale, w.minimum, w.super_scale, w.bits, w.group)
    return lambda: qblock.qblock_matmul(lib, x, *args)


def measure(
    weights: dict[str, QuantizedTensor], rounds: int, reps: int, dtype: torch.dtype
) -> dict[str, dict[str, list[float]]]:
    """{"layer_ms"|"sum_gb_s": {side: [a value per round]}}."""
    lib = kernels.load()
    layers = {side: {n: placed(w, side) for n, w in weights.items()} for side in SIDES}
    xs = {n: torch.randn(1, w.shape[1]).to(dtype) for n, w in weights.items()}
    # Random values: pages of one repeated value are what a host's page merging takes.
    big = {"4k": torch.rand(GIB // 4), "huge": host_memory.zeroed((GIB // 4,), torch.float32)}
    big["huge"].copy_(big["4k"])
    out: dict[str, dict[str, list[float]]] = {"layer_ms": {}, "sum_gb_s": {}}
    for r in range(rounds):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            ms = 0.0
            for n, w in layers[side].items():
                ms += 1e3 * _median_seconds(_matmul(lib, xs[n], w), reps)
            out["layer_ms"].setdefault(side, []).append(ms)
            t = big[side]
            out["sum_gb_s"].setdefault(side, []).append(GIB / _median_seconds(t.sum, 5) / 1e9)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    add_rounds_arg(ap, default=8)
    add_output_arg(ap, "huge_pages")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    weights = layer_weights(args.model)
    nbytes = sum(w.nbytes for w in weights.values())
    times = measure(weights, args.rounds, args.reps, getattr(torch, args.dtype))
    med = {k: {s: statistics.median(v) for s, v in c.items()} for k, c in times.items()}
    ms, sums = med["layer_ms"], med["sum_gb_s"]
    rows = [
        [side, f"{ms[side]:.2f}", f"{nbytes / ms[side] / 1e6:.1f}", f"{sums[side]:.1f}"]
        for side in SIDES
    ]
    print(f"{args.model.name}: layer 0's linears, {nbytes / 1e6:.1f} MB, 1 row")
    print(format_table(["pages", "ms", "kernel GB/s", "sum GB/s"], rows))
    result = {
        "model": args.model.name,
        "kernels": kernels.variant(),
        "dtype": args.dtype,
        "layer_bytes": nbytes,
        "formats": {n: w.source for n, w in weights.items()},
        "median": med,
        "runs": times,
        "speedup": med["layer_ms"]["4k"] / med["layer_ms"]["huge"],
    }
    write_result("huge_pages", result, args.output, args.threads)


if __name__ == "__main__":
    main()
