"""Where a quantized GGUF layer's few-row path should hand over to the compute-bound one.

A step of M rows (a short prompt, M streams decoding, a verifying step) multiplies
each weight by M activation rows. sluice has these paths for a weight kept in its GGUF
blocks (sluice/layers/block_quant.py): the block kernel (int8 activations, each
unpacked weight pair applied to up to 12 rows), the int8 GEMM (the same activations,
a panel of 32 weight rows unpacked once for all rows; where the level has it, see
INT8_GEMM_LEVELS), at the amx level that GEMM on AMX-INT8 tiles ("tiles": the same
sums, csrc/qblock_gemm_amx.h), dequantized tiles + the dense GEMM, and at the amx
level with bf16 activations the AMX kernel (a panel of 32 weight rows dequantized to
bf16 at a time, on the tiles). The row count where a
many-row path starts winning (`dense_min_rows`) depends on the format (integer
K-quant scales or fp16 ones) and the instruction-set level, so this times one layer's
linears (q, k, v, o, gate, up, down as the file stores them) on each path at each M,
the paths' order reversed every round, keeping the median of --rounds, in one process
on --threads threads. The weights come from the
file's layer 0, read into the same layouts the engine uses.

Run from the repo root (a quiet machine):
    .venv/bin/python benchmarks/few_rows.py --model /work/models/qwen2.5-7b-Q4_K_M.gguf \\
        --output docs/results/few_rows-qwen2.5-7b.json
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from benchmarks.common import add_output_arg, add_rounds_arg, format_table, write_result  # noqa: E402
from sluice import kernels  # noqa: E402
from sluice.architectures import spec_of  # noqa: E402
from sluice.core.quantized_tensor import QuantizedTensor  # noqa: E402
from sluice.kernels import qblock  # noqa: E402
from sluice.layers.block_quant import (  # noqa: E402
    INT8_GEMM_LEVELS,
    dense_min_rows,
    quantized_linear,
)
from sluice.loader.gguf_loader import (  # noqa: E402
    load_gguf_header,
    tensor_entries,
    tensors_from_gguf,
)

LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
PATHS = ("block", "gemm", "tiles", "dense", "amx")


def layer_weights(path: Path) -> dict[str, QuantizedTensor]:
    """Layer 0's linears as the loader keeps them (quantized layouts only), under the
    file's names."""
    from gguf import GGUFReader

    config, _ = load_gguf_header(path)
    entries = [e for e in tensor_entries(GGUFReader(path)) if e.name.startswith("blk.0.")]
    by_hf_name = tensors_from_gguf(path, entries, config)
    spec = spec_of(config.architecture)
    out: dict[str, QuantizedTensor] = {}
    for name in LINEARS:
        weight = by_hf_name.get(spec.hf_tensor_name(f"blk.0.{name}.weight") or "")
        if isinstance(weight, QuantizedTensor):
            out[name] = weight
    return out


def _time(fn: Callable[[], Any], reps: int) -> float:
    """Median seconds of reps calls after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _call(lib: Any, w: QuantizedTensor, x: torch.Tensor, path: str) -> Callable[[], Any]:
    if path == "amx":
        return lambda: qblock.qblock_amx(lib, x, *w.parts(), w.bits, w.group)
    if path == "tiles":
        return lambda: qblock.qblock_gemm(lib, x, *w.parts(), w.bits, w.group, tiles=True)
    crossover = 1 << 30 if path == "block" else 0

    def run() -> Any:
        # At the library's own level (avx512 for amx): no AMX tiles in the other paths.
        with kernels.use_variant(kernels.variant()):
            return quantized_linear(lib, w, x, crossover, int8_gemm=path == "gemm")

    return run


def measure(
    weights: dict[str, QuantizedTensor], rows: list[int], rounds: int, dtype: torch.dtype
) -> dict[str, dict[str, list[float]]]:
    """{M: {path: [ms of the layer's linears, a round each]}}, paths alternating (the
    int8 GEMM and the AMX kernel only where the kernels have them)."""
    lib = kernels.load()
    has = {
        "gemm": kernels.variant() in INT8_GEMM_LEVELS,
        "amx": kernels.tiles() and dtype == torch.bfloat16,
        "tiles": kernels.tiles(),
    }
    paths = [p for p in PATHS if has.get(p, True)]
    out: dict[str, dict[str, list[float]]] = {}
    for m in rows:
        xs = {n: torch.randn(m, w.shape[1]).to(dtype) for n, w in weights.items()}
        cell: dict[str, list[float]] = {p: [] for p in paths}
        for r in range(rounds):
            for p in paths if r % 2 == 0 else paths[::-1]:
                total = sum(_time(_call(lib, w, xs[n], p), 5) for n, w in weights.items())
                cell[p].append(total * 1e3)
        out[str(m)] = cell
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--rows", default="1,4,8,12,16,24,32,48,64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    add_rounds_arg(ap, default=3)
    add_output_arg(ap, "few_rows")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    weights = layer_weights(args.model)
    rows = [int(m) for m in args.rows.split(",")]
    times = measure(weights, rows, args.rounds, getattr(torch, args.dtype))
    medians = {m: {p: statistics.median(v) for p, v in c.items()} for m, c in times.items()}
    nan = float("nan")
    table = [[m, *(f"{c.get(p, nan):.2f}" for p in PATHS)] for m, c in medians.items()]
    heads = ["rows", "block ms", "int8 GEMM ms", "int8 tiles ms", "dense ms", "AMX ms"]
    print(format_table(heads, table))
    result = {
        "model": args.model.name,
        "kernels": kernels.level_in_use(),
        "dtype": args.dtype,
        "formats": {n: w.source for n, w in weights.items()},
        "dense_min_rows": {n: dense_min_rows(w) for n, w in weights.items()},
        # Where a model on the int8 GEMM leaves the block kernel (int8 prompts).
        "gemm_min_rows": {
            n: dense_min_rows(w, int8_prompts=True)
            for n, w in weights.items()
            if kernels.variant() in INT8_GEMM_LEVELS
        },
        "median_ms": medians,
        "runs_ms": times,
    }
    print("wrote", write_result("few_rows", result, args.output, threads=args.threads))


if __name__ == "__main__":
    main()
