"""Serving benchmark: ShareGPT prompts against any OpenAI-compatible /v1/completions.

    python benchmarks/serve.py                                # starts `sluice serve` itself
    python benchmarks/serve.py --url http://127.0.0.1:8080    # llama-server, vLLM, ...

When it starts sluice itself and a llama-server binary is found (`make llama-server`
links one as .venv/bin/llama-server; or --llama-server PATH), llama-server is started
on the same GGUF with as many threads and one slot per stream, and every level runs
on both servers back to back with the same prompts, with sluice's ratio printed.

Each concurrency level sends its prompts through that many concurrent streaming
requests, each asking for exactly --max-tokens output tokens (`ignore_eos`), and reports
output tokens/s, TTFT p50/p99 and TPOT p50/p99. TTFT is measured at the client, from
sending the request to the first chunk with text; TPOT is (last - first token time) /
(output tokens - 1) per request. Results go to benchmarks/results/serve.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.datasets import sharegpt_prompts

RESULTS = Path(__file__).resolve().parent / "results" / "serve.json"


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    tpot: float | None = None
    latency: float = 0.0
    output_tokens: int = 0
    error: str = ""


@dataclass
class LevelResult:
    concurrency: int
    num_prompts: int
    duration_s: float
    completed: int
    errors: int
    output_tokens: int
    output_tok_per_s: float
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    error_samples: list[str] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    sampling: dict[str, float],
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        **sampling,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    first: float | None = None
    last = t0
    chunks = 0
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                return RequestResult(False, error=f"HTTP {resp.status_code}: {text[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    return RequestResult(False, error=str(obj["error"])[:200])
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                for choice in obj.get("choices") or []:
                    if choice.get("text"):
                        now = time.perf_counter()
                        if first is None:
                            first = now
                        last = now
                        chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}")
    if first is None:
        return RequestResult(False, error="no tokens received")
    # Servers that do not report usage: one chunk per token is the usual streaming shape.
    n = usage_tokens if usage_tokens is not None else chunks
    tpot = (last - first) / (n - 1) if n > 1 else None
    return RequestResult(True, first - t0, tpot, last - t0, n)


async def run_level(
    url: str,
    model: str,
    prompts: list[str],
    concurrency: int,
    max_tokens: int,
    headers: dict[str, str],
    sampling: dict[str, float] | None = None,
) -> LevelResult:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(None, connect=30)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:

        async def worker() -> None:
            while True:
                try:
                    prompt = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results.append(
                    await one_request(
                        client, url, model, prompt, max_tokens, sampling or {"temperature": 0.0}
                    )
                )

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft * 1000 for r in ok]
    tpots = [r.tpot * 1000 for r in ok if r.tpot is not None]
    return LevelResult(
        concurrency=concurrency,
        num_prompts=len(prompts),
        duration_s=round(duration, 3),
        completed=len(ok),
        errors=len(results) - len(ok),
        output_tokens=out_tokens,
        output_tok_per_s=round(out_tokens / duration, 2),
        requests_per_s=round(len(ok) / duration, 3),
        ttft_p50_ms=round(percentile(ttfts, 50), 1),
        ttft_p99_ms=round(percentile(ttfts, 99), 1),
        tpot_p50_ms=round(percentile(tpots, 50), 1),
        tpot_p99_ms=round(percentile(tpots, 99), 1),
        error_samples=[r.error for r in results if not r.ok][:3],
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_sluice(server_args: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "sluice.cli", "serve", "--port", str(port), *server_args]
    print("starting:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr)
    return proc, wait_healthy(proc, f"http://127.0.0.1:{port}", "sluice serve")


def wait_healthy(proc: subprocess.Popen[bytes], url: str, name: str) -> str:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return url
        except httpx.TransportError:
            pass  # not listening yet: poll again
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{name} did not become healthy in 600 s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()


def print_table(title: str, results: list[LevelResult]) -> None:
    header = (
        f"{'conc':>5} {'prompts':>7} {'ok':>4} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'TPOT p50':>9} {'TPOT p99':>9}"
    )
    print(f"\n{title}")
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.concurrency:>5} {r.num_prompts:>7} {r.completed:>4} {r.output_tok_per_s:>9.1f} "
            f"{r.ttft_p50_ms:>7.0f}ms {r.ttft_p99_ms:>7.0f}ms "
            f"{r.tpot_p50_ms:>7.1f}ms {r.tpot_p99_ms:>7.1f}ms"
        )


def report(name: str, res: LevelResult, count: int) -> None:
    print(
        f"  {name:<12} concurrency {res.concurrency:>3}: {res.output_tok_per_s:8.1f} tok/s, "
        f"TTFT p50 {res.ttft_p50_ms:.0f} ms, TPOT p50 {res.tpot_p50_ms:.1f} ms "
        f"({res.completed}/{count} ok, {res.duration_s:.1f} s)",
        flush=True,
    )


def find_llama_server(option: str) -> Path | None:
    """The llama-server binary: --llama-server PATH, or on PATH / next to this Python."""
    if option == "none":
        return None
    if option != "auto":
        return Path(option)
    found = shutil.which("llama-server") or shutil.which(
        "llama-server", path=str(Path(sys.executable).parent)
    )
    return Path(found) if found else None


def start_llama_server(
    binary: Path, model: str | None, threads: int, slots: int, slot_ctx: int
) -> tuple[subprocess.Popen[bytes], str]:
    """llama-server on the GGUF sluice would serve, one slot of slot_ctx tokens per stream."""
    from sluice.loader.resolve import resolve_model_path

    gguf = resolve_model_path(model)
    if gguf.suffix != ".gguf":
        raise SystemExit(f"llama-server needs a GGUF file; {gguf} is not one")
    port = _free_port()
    cmd = [
        str(binary), "-m", str(gguf), "--port", str(port), "-t", str(threads),
        "-tb", str(threads), "-np", str(slots), "-c", str(slots * slot_ctx),
    ]  # fmt: skip
    print("starting:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, wait_healthy(proc, f"http://127.0.0.1:{port}", "llama-server")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", default=None, help="server base URL (default: start sluice serve)")
    ap.add_argument("--model", default=None, help="model name (default: the server's first)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--concurrency", default="1,16,64", help="comma-separated levels")
    ap.add_argument(
        "--num-prompts",
        default="8,32,128",
        help="prompts per level: one number for all levels or one per level",
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--max-prompt-bytes",
        type=int,
        default=2048,
        help="skip ShareGPT prompts longer than this many UTF-8 bytes",
    )
    ap.add_argument("--seed", type=int, default=0, help="prompt shuffle seed")
    ap.add_argument("--output", type=Path, default=RESULTS)
    ap.add_argument(
        "--server-args",
        default="",
        help="extra arguments for the sluice serve this script starts, e.g. '--dtype float32'",
    )
    ap.add_argument(
        "--llama-server",
        default="auto",
        help="llama-server binary to run side by side: PATH, 'auto' (PATH or .venv/bin) "
        "or 'none'; only when this script starts sluice itself",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="llama-server threads (default: sluice's, the physical cores)",
    )
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default greedy)"
    )
    ap.add_argument("--top-p", type=float, default=None)
    args = ap.parse_args()
    sampling: dict[str, float] = {"temperature": args.temperature}
    if args.top_p is not None:
        sampling["top_p"] = args.top_p

    levels = _ints(args.concurrency)
    counts = _ints(args.num_prompts)
    if len(counts) == 1:
        counts = counts * len(levels)
    if len(counts) != len(levels):
        raise SystemExit("--num-prompts needs one number or one per --concurrency level")

    procs: list[subprocess.Popen[bytes]] = []
    url = args.url.rstrip("/") if args.url else None
    peer_bin = None if url else find_llama_server(args.llama_server)
    peer_url: str | None = None
    if url is None:
        proc, url = start_sluice(args.server_args.split())
        procs.append(proc)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    results: list[LevelResult] = []
    peer_results: list[LevelResult] = []
    try:
        model = args.model
        if model is None:
            models = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()
            model = models["data"][0]["id"]
        if peer_bin is not None:
            from sluice.config import EngineConfig

            threads = args.threads or EngineConfig().threads()
            # A slot holds a prompt (<= max-prompt-bytes tokens) and the output.
            slot_ctx = args.max_prompt_bytes + args.max_tokens + 64
            proc, peer_url = start_llama_server(
                peer_bin, args.model, threads, max(levels), slot_ctx
            )
            procs.append(proc)
            peer_model = httpx.get(f"{peer_url}/v1/models", timeout=30).json()["data"][0]["id"]
        # Bytes bound tokens from above for byte-level BPE: a cheap, tokenizer-free filter.
        pool = sharegpt_prompts(
            sum(counts),
            seed=args.seed,
            max_prompt_tokens=args.max_prompt_bytes,
            tokenizer_encode=lambda s: list(s.encode("utf-8")),
        )
        print(f"model {model} at {url}; {args.max_tokens} output tokens per request", flush=True)
        servers = [("sluice", url, model, headers)]
        if peer_url is not None:
            servers.append(("llama-server", peer_url, peer_model, {}))
        for name, target, target_model, target_headers in servers:
            warm = asyncio.run(run_level(target, target_model, pool[:1], 1, 8, target_headers))
            if warm.errors:
                raise SystemExit(f"{name} warm-up request failed: {warm.error_samples}")
        start = 0
        for conc, count in zip(levels, counts, strict=True):
            prompts = pool[start : start + count]
            start += count
            # Back to back on the same prompts: the machine's speed drifts over minutes.
            res = asyncio.run(
                run_level(url, model, prompts, conc, args.max_tokens, headers, sampling)
            )
            results.append(res)
            report("sluice", res, count)
            if peer_url is not None:
                res = asyncio.run(
                    run_level(peer_url, peer_model, prompts, conc, args.max_tokens, {}, sampling)
                )
                peer_results.append(res)
                report("llama-server", res, count)
    finally:
        for proc in procs:
            stop(proc)

    print_table("sluice" if args.url is None else url, results)
    if peer_results:
        print_table(f"llama-server ({peer_bin})", peer_results)
        print("\nsluice / llama-server:")
        for ours, theirs in zip(results, peer_results, strict=True):
            ratio = ours.output_tok_per_s / theirs.output_tok_per_s
            print(
                f"  concurrency {ours.concurrency:>3}: {ratio:.2f}x output tok/s, "
                f"TTFT p50 {ours.ttft_p50_ms:.0f} vs {theirs.ttft_p50_ms:.0f} ms, "
                f"TPOT p50 {ours.tpot_p50_ms:.1f} vs {theirs.tpot_p50_ms:.1f} ms"
            )
    payload: dict[str, Any] = {
        "url": url if args.url else "sluice serve (started by the script)",
        "server_args": args.server_args if not args.url else None,
        "model": model,
        "max_tokens": args.max_tokens,
        "sampling": sampling,
        "max_prompt_bytes": args.max_prompt_bytes,
        "seed": args.seed,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cpu_count": os.cpu_count(),
        "levels": [asdict(r) for r in results],
    }
    if peer_results:
        payload["llama_server"] = {
            "binary": str(peer_bin),
            "levels": [asdict(r) for r in peer_results],
            "ratio_output_tok_per_s": [
                round(o.output_tok_per_s / t.output_tok_per_s, 3)
                for o, t in zip(results, peer_results, strict=True)
            ],
        }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
