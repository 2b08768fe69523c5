"""Serving benchmark: ShareGPT prompts against any OpenAI-compatible /v1/completions.

    python benchmarks/serve.py                                # starts `sluice serve` itself
    python benchmarks/serve.py --url http://127.0.0.1:8080    # llama-server, vLLM, ...

When it starts sluice itself and a llama-server binary is found (`make llama-server`
links one as .venv/bin/llama-server; or --llama-server PATH), llama-server runs on the
same GGUF with as many threads and one slot per stream, and the two are compared.

Each concurrency level sends its prompts through that many concurrent streaming
requests, each asking for exactly --max-tokens output tokens (`ignore_eos`), and measures
output tokens/s, TTFT p50/p99 and TPOT p50/p99. TTFT is measured at the client, from
sending the request to the first chunk with text; TPOT is (last - first token time) /
(output tokens - 1) per request.

Fairness: one server is up at a time. Every level runs --rounds interleaved rounds
(sluice, llama-server; llama-server, sluice; ...); each measurement starts its server,
warms it up with one short request, runs the level and stops the server. The report
gives each side's median and min-max per level and the ratio of the medians. With
--url the script measures that server alone (--rounds rounds per level, left running).
Results go to benchmarks/results/serve.json (--output).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (
    add_output_arg,
    add_rounds_arg,
    compare,
    fmt_spread,
    interleave,
    llama_cpp_build,
    percentile,
    shown_path,
    write_result,
)
from benchmarks.datasets import sharegpt_prompts

# Per level and side: the figures summarized over rounds (median, spread, ratio).
METRICS = (
    "output_tok_per_s",
    "requests_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "errors",
    "duration_s",
)


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


@dataclass
class Server:
    """One side of the comparison: how to start it (None: already running) and talk to it."""

    name: str
    start: Callable[[int], tuple[subprocess.Popen[bytes], str]] | None
    url: str | None = None  # when already running
    headers: dict[str, str] = field(default_factory=dict)
    model: str | None = None  # request `model`; None: the server's first


def measure(
    server: Server,
    prompts: list[str],
    concurrency: int,
    max_tokens: int,
    sampling: dict[str, float],
) -> dict[str, Any]:
    """Start the server (if this script runs it), warm it up, run one level, stop it."""
    proc, url = server.start(concurrency) if server.start else (None, server.url)
    assert url is not None
    try:
        model = server.model
        if model is None:
            models = httpx.get(f"{url}/v1/models", headers=server.headers, timeout=30).json()
            model = models["data"][0]["id"]
        warm = asyncio.run(run_level(url, model, prompts[:1], 1, 8, server.headers))
        if warm.errors:
            raise SystemExit(f"{server.name} warm-up request failed: {warm.error_samples}")
        res = asyncio.run(
            run_level(url, model, prompts, concurrency, max_tokens, server.headers, sampling)
        )
    finally:
        if proc is not None:
            stop(proc)
    print(
        f"  {server.name:<12} concurrency {res.concurrency:>3}: {res.output_tok_per_s:8.1f} tok/s, "
        f"TTFT p50 {res.ttft_p50_ms:.0f} ms, TPOT p50 {res.tpot_p50_ms:.1f} ms "
        f"({res.completed}/{res.num_prompts} ok, {res.duration_s:.1f} s)",
        flush=True,
    )
    return asdict(res) | {"model": model}


def served_model(server_args: list[str], model: str | None) -> str | None:
    """The one model both sides serve: --model, or the --model inside --server-args.

    llama-server is given this file too; a run that named the model only inside
    --server-args once compared an OLMoE sluice against llama-server's default SmolLM2.
    """
    inside = None
    for i, arg in enumerate(server_args):
        if arg == "--model" and i + 1 < len(server_args):
            inside = server_args[i + 1]
        elif arg.startswith("--model="):
            inside = arg.split("=", 1)[1]
    if inside is not None and model is not None and inside != model:
        raise SystemExit(f"--model {model!r} and --server-args' --model {inside!r} disagree")
    return model if model is not None else inside


def _server_threads(server_args: list[str]) -> int:
    """The threads `sluice serve server_args` runs on (its --num-threads, else the default)."""
    from sluice.config import EngineConfig

    for i, arg in enumerate(server_args):
        if arg == "--num-threads" and i + 1 < len(server_args):
            return int(server_args[i + 1])
        if arg.startswith("--num-threads="):
            return int(arg.split("=", 1)[1])
    return EngineConfig().threads()


def print_report(result: dict[str, Any]) -> None:
    for lvl in result["levels"]:
        cmp = lvl["comparison"]
        print(
            f"\n== concurrency {lvl['concurrency']}, {lvl['num_prompts']} prompts: "
            f"median (min-max) of {cmp['rounds']} interleaved rounds =="
        )
        for side in cmp["sides"]:
            s = cmp["summary"][side]
            print(
                f"  {side:<12} {fmt_spread(s['output_tok_per_s'])} tok/s, "
                f"TTFT p50 {fmt_spread(s['ttft_p50_ms'], digits=0)} ms, "
                f"TPOT p50 {fmt_spread(s['tpot_p50_ms'])} ms, "
                f"errors {fmt_spread(s['errors'], digits=0)}"
            )
        for side, r in cmp["ratio_of_medians"].items():
            print(
                f"  {side} / {cmp['baseline']}: {r['output_tok_per_s']:.2f}x output tok/s "
                f"(ratio of medians)"
            )


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
    add_rounds_arg(ap)
    add_output_arg(ap, "serve")
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
        help="llama-server threads (default: sluice's)",
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

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    server_args = args.server_args.split()
    model = served_model(server_args, None if args.url else args.model)
    if model is not None and served_model(server_args, None) is None:
        server_args += ["--model", model]
    sluice_threads = _server_threads(server_args)
    servers: list[Server] = []
    info: dict[str, Any] = {}
    if args.url:
        url = args.url.rstrip("/")
        servers.append(Server(url, None, url, headers, args.model))
        info[url] = {"url": url, "note": "external server: provenance describes the client"}
    else:
        servers.append(
            Server("sluice", lambda _conc: start_sluice(server_args), None, headers, args.model)
        )
        info["sluice"] = {"command": "sluice serve " + args.server_args, "threads": sluice_threads}
        peer_bin = find_llama_server(args.llama_server)
        if peer_bin is not None:
            threads = args.threads or sluice_threads
            # A slot holds a prompt (<= max-prompt-bytes tokens) and the output.
            slot_ctx = args.max_prompt_bytes + args.max_tokens + 64

            def start_peer(conc: int, binary: Path = peer_bin) -> tuple[Any, str]:
                # One slot per stream of this level.
                return start_llama_server(binary, model, threads, conc, slot_ctx)

            servers.append(Server("llama-server", start_peer))
            info["llama-server"] = {
                **llama_cpp_build(peer_bin),  # commit, instruction-set level, CMake options
                "command": f"llama-server -m MODEL -t {threads} -tb {threads} "
                f"-np STREAMS -c STREAMS*{slot_ctx}",
                "threads": threads,
                "slots": "one per stream (the level's concurrency)",
                "slot_ctx": slot_ctx,
            }

    # Bytes bound tokens from above for byte-level BPE: a cheap, tokenizer-free filter.
    pool = sharegpt_prompts(
        sum(counts),
        seed=args.seed,
        max_prompt_tokens=args.max_prompt_bytes,
        tokenizer_encode=lambda s: list(s.encode("utf-8")),
    )
    by_name = {s.name: s for s in servers}
    baseline = "llama-server" if "llama-server" in by_name else None
    result: dict[str, Any] = {
        "config": vars(args),
        "servers": info,
        "max_tokens": args.max_tokens,
        "sampling": sampling,
        "levels": [],
    }
    start = 0
    for conc, count in zip(levels, counts, strict=True):
        prompts = pool[start : start + count]
        start += count
        runs = interleave(
            list(by_name),
            args.rounds,
            lambda name, prompts=prompts, conc=conc: measure(
                by_name[name], prompts, conc, args.max_tokens, sampling
            ),
            label=f"concurrency {conc}",
        )
        level: dict[str, Any] = {
            "concurrency": conc,
            "num_prompts": count,
            "comparison": compare(runs, METRICS, baseline),
        }
        samples = {n: [e for r in rs for e in r["error_samples"]][:3] for n, rs in runs.items()}
        if any(samples.values()):
            level["error_samples"] = samples
        result["levels"].append(level)
        models = {n: rs[0]["model"] for n, rs in runs.items()}
        result["models"] = models

    print_report(result)
    # The client's torch threads say nothing; record the measured sluice server's.
    # An external server (--url) may run anywhere: provenance then describes the client.
    threads = None if args.url else sluice_threads
    path = write_result("serve", result, args.output, threads=threads)
    print(f"\nwrote {shown_path(path)}")


if __name__ == "__main__":
    main()
