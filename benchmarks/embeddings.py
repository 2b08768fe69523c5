"""Embedding throughput beside sentence-transformers, and one short query's latency
through `sluice serve`.

Throughput: the first human turns of ShareGPT (the first --num), each cut at
--max-tokens tokens, embedded whole by each side in the same process and threads,
interleaved (A B, B A), medians:
- sluice: `LLM(model).embed(texts, PoolingParams(truncate_prompt_tokens=...))`, which
  tokenizes and batches them in the engine's scheduler;
- sentence-transformers: `SentenceTransformer(folder).encode(texts)`, its default
  batching (32 a batch, sorted by length), max_seq_length set to --max-tokens.
Both load once before the rounds (start-up is not counted), tokenizing is counted. The
two sides' vectors are compared (cosine) so a fast wrong answer shows.

Latency (--latency N): N sequential requests of one 16-token query to
/v1/embeddings of a `sluice serve` started for it, after the throughput rounds (no
other side runs then); p50 and p90 of the client's round trip.

    python benchmarks/embeddings.py --model all-minilm-l6-v2 --latency 200
    python benchmarks/embeddings.py --model embeddinggemma-300m
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import numpy as np
import torch

from benchmarks.common import (
    add_output_arg,
    add_rounds_arg,
    compare,
    fmt_spread,
    format_table,
    interleave,
    percentile,
    write_result,
)
from benchmarks.datasets import sharegpt_first_turns
from sluice import LLM, PoolingParams
from sluice.loader import resolve_model_path

SIDES = ("sluice", "sentence-transformers")
# "The capital of France is Paris; what is the capital of Italy?": 16 tokens with
# MiniLM's specials.
QUERY = "The capital of France is Paris; what is the capital of Italy?"


def _texts(num: int) -> list[str]:
    turns = [t for t in sharegpt_first_turns() if t.strip()]
    if len(turns) < num:
        raise SystemExit(f"ShareGPT has {len(turns)} first turns, fewer than --num {num}")
    return turns[:num]


def _measure(side: str, sides: dict[str, Any], texts: list[str], max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    if side == "sluice":
        outs = sides[side].embed(
            texts, PoolingParams(truncate_prompt_tokens=max_tokens), use_tqdm=False
        )
        vectors = np.array([o.outputs.embedding for o in outs], dtype=np.float32)
        tokens = sum(len(o.prompt_token_ids) for o in outs)
    else:
        vectors = sides[side].encode(texts, convert_to_numpy=True)
        tokens = 0
    seconds = time.perf_counter() - t0
    sides[f"{side} vectors"] = vectors
    return {"seconds": seconds, "texts_per_s": len(texts) / seconds, "tokens": tokens}


def _agreement(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return {"min": float(cos.min()), "mean": float(cos.mean())}


def _latency(model: str, dtype: str, n: int) -> dict[str, float]:
    """p50/p90 seconds of one short query through a `sluice serve` of `model`."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from serving import serve  # the test harness's real server process

    with serve("--model", model, "--dtype", dtype) as srv:
        url, headers = f"{srv.url}/v1/embeddings", srv.headers
        with httpx.Client(headers=headers, timeout=30) as client:
            body = {"model": model, "input": QUERY, "encoding_format": "float"}
            for _ in range(20):  # warm-up
                client.post(url, json=body).raise_for_status()
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                client.post(url, json=body).raise_for_status()
                times.append(time.perf_counter() - t0)
    return {"p50": percentile(times, 50), "p90": percentile(times, 90), "n": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="all-minilm-l6-v2", help="an embedding model's alias")
    ap.add_argument("--num", type=int, default=1000, help="texts (ShareGPT first turns)")
    ap.add_argument("--max-tokens", type=int, default=256, help="each text cut at this many")
    ap.add_argument("--dtype", default="auto", help="sluice's dtype (auto: bf16 where native)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--latency", type=int, default=0, help="queries through the server")
    add_rounds_arg(ap)
    add_output_arg(ap, "embeddings")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    texts = _texts(args.num)
    path = resolve_model_path(args.model)
    reference = SentenceTransformer(str(path), device="cpu")
    reference.max_seq_length = min(reference.max_seq_length, args.max_tokens)
    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads)
    sides: dict[str, Any] = {"sluice": llm, "sentence-transformers": reference}
    for side in SIDES:  # warm-up: first calls allocate and pick kernels
        _measure(side, sides, texts[:64], args.max_tokens)
    runs = interleave(
        SIDES, args.rounds, lambda side: _measure(side, sides, texts, args.max_tokens)
    )
    result: dict[str, Any] = compare(
        runs, ["seconds", "texts_per_s"], baseline="sentence-transformers"
    )
    agreement = _agreement(sides["sluice vectors"], sides["sentence-transformers vectors"])
    result.update(
        model=args.model,
        num_texts=len(texts),
        max_tokens=args.max_tokens,
        tokens=runs["sluice"][0]["tokens"],
        dtype=str(llm.engine.dtype).removeprefix("torch."),
        cosine_to_reference=agreement,
    )
    del llm, sides
    if args.latency:
        result["latency_seconds"] = _latency(args.model, args.dtype, args.latency)
    print(_table(result))
    print(f"wrote {write_result('embeddings', result, args.output, threads=args.threads)}")


def _table(result: dict[str, Any]) -> str:
    rows = [
        [
            side,
            fmt_spread(result["summary"][side]["seconds"], digits=2),
            fmt_spread(result["summary"][side]["texts_per_s"], digits=0),
        ]
        for side in result["sides"]
    ]
    ratio = result["ratio_of_medians"]["sluice"]["texts_per_s"]
    cos = result["cosine_to_reference"]
    lines = [
        format_table(["side", "seconds", "texts/s"], rows),
        f"sluice / sentence-transformers: {ratio:.2f}x texts/s ({result['dtype']}); "
        f"cosine to the reference min {cos['min']:.5f}, mean {cos['mean']:.6f}",
    ]
    lat = result.get("latency_seconds")
    if lat:
        lines.append(
            f"one 16-token query through sluice serve: p50 {lat['p50'] * 1e3:.1f} ms, "
            f"p90 {lat['p90'] * 1e3:.1f} ms ({lat['n']} requests)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
