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

Servers (--llama-server PATH --gguf FILE): `sluice serve` and llama-server
(`--embeddings`, the same model converted to GGUF by llama.cpp's own converter), one up
at a time, interleaved, each sent the same token ids (the texts tokenized and cut once,
beforehand) as requests of 16 inputs from 4 concurrent clients to /v1/embeddings.

Latency (--latency N): N sequential requests of one 16-token query to
/v1/embeddings of a `sluice serve` started for it, after the throughput rounds (no
other side runs then); p50 and p90 of the client's round trip.

    python benchmarks/embeddings.py --model all-minilm-l6-v2 --latency 200
    python benchmarks/embeddings.py --model embeddinggemma-300m \
        --llama-server PATH --gguf embeddinggemma-300m-bf16.gguf

The GGUF: `python convert_hf_to_gguf.py FOLDER --sentence-transformers-dense-modules
--outtype bf16` from llama.cpp's source (without that flag the dense projections are
left out and its vectors are unrelated to the model's).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
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
    llama_cpp_build,
    percentile,
    write_result,
)
from benchmarks.datasets import sharegpt_first_turns
from benchmarks.serve import _free_port, start_sluice, stop, wait_healthy
from sluice import LLM, PoolingParams
from sluice.loader import resolve_model_path

SIDES = ("sluice", "sentence-transformers")
SERVER_SIDES = ("sluice serve", "llama-server")
# The servers' load: inputs a request, clients at once.
PER_REQUEST = 16
CLIENTS = 4
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
    proc, base = start_sluice(["--model", model, "--dtype", dtype])
    try:
        url = f"{base}/v1/embeddings"
        with httpx.Client(timeout=30) as client:
            body = {"model": model, "input": QUERY, "encoding_format": "float"}
            for _ in range(20):  # warm-up
                client.post(url, json=body).raise_for_status()
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                client.post(url, json=body).raise_for_status()
                times.append(time.perf_counter() - t0)
    finally:
        stop(proc)
    return {"p50": percentile(times, 50), "p90": percentile(times, 90), "n": n}


def _token_inputs(reference: Any, texts: list[str], max_tokens: int) -> list[list[int]]:
    """Each text's token ids as sentence-transformers makes them, cut at max_tokens."""
    encoded = reference.tokenizer(texts, truncation=True, max_length=max_tokens)
    return [list(ids) for ids in encoded["input_ids"]]


def _post_all(url: str, inputs: list[list[int]], headers: dict[str, str]) -> np.ndarray:
    """Every input's vector through /v1/embeddings: PER_REQUEST a request, CLIENTS at once."""
    batches = [inputs[i : i + PER_REQUEST] for i in range(0, len(inputs), PER_REQUEST)]

    def send(batch: list[list[int]]) -> list[list[float]]:
        body = {"input": batch, "encoding_format": "float"}
        resp = httpx.post(f"{url}/v1/embeddings", json=body, headers=headers, timeout=600)
        resp.raise_for_status()
        return [d["embedding"] for d in sorted(resp.json()["data"], key=lambda d: d["index"])]

    with ThreadPoolExecutor(CLIENTS) as pool:
        return np.array([v for vs in pool.map(send, batches) for v in vs], dtype=np.float32)


def _server_round(
    side: str, args: argparse.Namespace, inputs: list[list[int]], vectors: dict[str, np.ndarray]
) -> dict[str, float]:
    """Start one side's server, warm it up, time every input through it, stop it."""
    if side == "sluice serve":
        proc, url = start_sluice(
            ["--model", args.model, "--dtype", args.dtype, "--num-threads", str(args.threads)]
        )
    else:
        port = _free_port()
        cmd = [
            str(args.llama_server), "-m", str(args.gguf), "--embeddings", "--port", str(port),
            "-t", str(args.threads), "-tb", str(args.threads), "-np", "8", "-c", "8192",
            "-b", "2048", "-ub", "2048",
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = wait_healthy(proc, f"http://127.0.0.1:{port}", "llama-server")
    try:
        _post_all(url, inputs[:64], {})
        t0 = time.perf_counter()
        vectors[side] = _post_all(url, inputs, {})
        seconds = time.perf_counter() - t0
    finally:
        stop(proc)
    return {"seconds": seconds, "texts_per_s": len(inputs) / seconds}


def _servers(args: argparse.Namespace, reference: Any, texts: list[str]) -> dict[str, Any]:
    inputs = _token_inputs(reference, texts, args.max_tokens)
    vectors: dict[str, np.ndarray] = {}
    runs = interleave(
        SERVER_SIDES, args.rounds, lambda side: _server_round(side, args, inputs, vectors)
    )
    result = compare(runs, ["seconds", "texts_per_s"], baseline="llama-server")
    ref = reference.encode(texts, convert_to_numpy=True)
    result["cosine_to_reference"] = {side: _agreement(v, ref) for side, v in vectors.items()}
    result["llama_cpp"] = {**llama_cpp_build(args.llama_server), "gguf": Path(args.gguf).name}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="all-minilm-l6-v2", help="an embedding model's alias")
    ap.add_argument("--num", type=int, default=1000, help="texts (ShareGPT first turns)")
    ap.add_argument("--max-tokens", type=int, default=256, help="each text cut at this many")
    ap.add_argument("--dtype", default="auto", help="sluice's dtype (auto: bf16 where native)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--latency", type=int, default=0, help="queries through the server")
    ap.add_argument("--llama-server", type=Path, default=None, help="its binary, for --gguf")
    ap.add_argument("--gguf", default=None, help="the model as llama.cpp converts it")
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
    sides.clear()  # the in-process engine goes before the servers start
    del llm
    if args.llama_server is not None:
        if args.gguf is None:
            raise SystemExit("--llama-server needs --gguf (the model as llama.cpp runs it)")
        result["servers"] = _servers(args, reference, texts)
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
    servers = result.get("servers")
    if servers:
        rows = [
            [
                side,
                fmt_spread(servers["summary"][side]["seconds"], digits=2),
                fmt_spread(servers["summary"][side]["texts_per_s"], digits=0),
                f"{servers['cosine_to_reference'][side]['min']:.5f}",
            ]
            for side in servers["sides"]
        ]
        lines.append(format_table(["server", "seconds", "texts/s", "min cosine"], rows))
        ratio = servers["ratio_of_medians"]["sluice serve"]["texts_per_s"]
        lines.append(f"sluice serve / llama-server: {ratio:.2f}x texts/s")
    lat = result.get("latency_seconds")
    if lat:
        lines.append(
            f"one 16-token query through sluice serve: p50 {lat['p50'] * 1e3:.1f} ms, "
            f"p90 {lat['p90'] * 1e3:.1f} ms ({lat['n']} requests)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
