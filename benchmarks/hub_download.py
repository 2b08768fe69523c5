"""Models by Hub name: what fetching one costs against huggingface_hub alone, and what a
later start pays to find it again.

A packaged GGUF is served by a local stand-in for the Hub (benchmarks/hub_stub.py, the
routes huggingface_hub calls) in a process of its own, so the network is this machine's
loopback and the figures are the client's own costs (on 2 cores the server's process
competes with the client for them, alike for both sides). Sides, interleaved (A B,
B A) with a fresh cache each round:
- sluice: `resolve_model_path("org/repo:QUANT")` into an empty cache: the listing, the
  memory check, the resumable transfer, the sha256 against the listing and the GGUF check.
- huggingface_hub: `hf_hub_download` of the same file into an empty cache (no check).
Then, the file cached, the start-up cost of the name against a path (median of 20):
online (the listing is fetched again) and with HF_HUB_OFFLINE.

    python benchmarks/hub_download.py --model qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from huggingface_hub import hf_hub_download

from benchmarks.common import (
    add_output_arg,
    add_rounds_arg,
    compare,
    fmt_spread,
    format_table,
    interleave,
    write_result,
)
from benchmarks.hub_stub import HubProcess, HubRepo, HubStub
from sluice.loader import resolve_model_path

REPO = "bench/model-GGUF"
SIDES = ("sluice", "huggingface_hub")


def _download(side: str, url: str, quant: str, root: Path) -> dict[str, float]:
    cache = Path(tempfile.mkdtemp(dir=root))
    os.environ["HF_HUB_CACHE"] = str(cache)
    t0 = time.perf_counter()
    if side == "sluice":
        path = resolve_model_path(f"{REPO}:{quant}")
    else:
        path = Path(hf_hub_download(REPO, f"model-{quant}.gguf", cache_dir=cache, endpoint=url))
    seconds = time.perf_counter() - t0
    size = path.stat().st_size
    shutil.rmtree(cache)
    return {"seconds": seconds, "mb_per_s": size / seconds / 1e6}


def _start_cost(name: str, n: int = 20) -> float:
    """Median seconds to resolve `name` once its files are cached."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        resolve_model_path(name)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="a packaged model's alias")
    ap.add_argument("--quant", default="Q4_K_M", help="the tag its file is served under")
    add_rounds_arg(ap)
    add_output_arg(ap, "hub_download")
    args = ap.parse_args()

    source = resolve_model_path(args.model)
    filename = f"model-{args.quant}.gguf"
    hub = HubStub(repos={REPO: HubRepo({filename: source})})
    root = Path(tempfile.mkdtemp(prefix="sluice-hub-bench-"))
    hub.sha256(source)  # the stand-in's own hashing stays out of the timings
    with HubProcess(hub) as url:
        os.environ["HF_ENDPOINT"] = url
        runs = interleave(
            SIDES, args.rounds, lambda side: _download(side, url, args.quant, root), "download"
        )
        result: dict[str, Any] = compare(runs, ["seconds", "mb_per_s"], baseline="huggingface_hub")
        os.environ["HF_HUB_CACHE"] = str(root / "kept")
        name = f"{REPO}:{args.quant}"
        resolve_model_path(name)
        start = {"path": _start_cost(str(source)), "hub name, online": _start_cost(name)}
        os.environ["HF_HUB_OFFLINE"] = "1"
        start["hub name, HF_HUB_OFFLINE"] = _start_cost(name)
    shutil.rmtree(root)
    result.update(model=args.model, file_bytes=source.stat().st_size, start_seconds=start)
    print(_table(result))
    print(f"wrote {write_result('hub_download', result, args.output)}")


def _table(result: dict[str, Any]) -> str:
    rows = [
        [
            side,
            fmt_spread(result["summary"][side]["seconds"], digits=2),
            fmt_spread(result["summary"][side]["mb_per_s"], digits=0),
        ]
        for side in result["sides"]
    ]
    starts = [[k, f"{v * 1e3:.1f} ms"] for k, v in result["start_seconds"].items()]
    return (
        format_table(["download", "seconds", "MB/s"], rows)
        + "\n\n"
        + format_table(["start-up: resolve the cached model", "median"], starts)
    )


if __name__ == "__main__":
    main()
