"""Prefill/decode disaggregation against one colocated instance, on the same cores, in
the same run.

    python benchmarks/pd_disagg.py                     # 16 streams, 2000-token prompts, 3 rounds
    python benchmarks/pd_disagg.py --rounds 1 --num-prompts 4 --streams 4 --prompt-tokens 256

Sides:
- colocated: one `sluice serve` with 2 threads, pinned to CPUs {a, b};
- disagg: `sluice serve --role prefill` with 1 thread pinned to CPU a, `--role decode`
  with 1 thread pinned to CPU b, and `--role proxy` in front (a plain HTTP relay, not
  pinned: it and this client share the cores with both sides alike).

Every request is a distinct slice of the packaged Shakespeare plays, --prompt-tokens
long (shared-nothing: no prefix-cache hits), streamed with exactly --max-tokens output
tokens (`ignore_eos`), --streams at a time. Measured at the client, as in
benchmarks/serve.py: TTFT (sending to the first text chunk) and TPOT ((last - first
token time) / (tokens - 1)), p50 and p99, and output tokens/s. Sides run interleaved
(colocated, disagg; disagg, colocated; ...), each started cold, warmed up with one
short request of its own and stopped per measurement; the report gives medians with
min-max over rounds and the ratios of medians. Results go to
benchmarks/results/pd_disagg.json (--output), with the commit, CPU and kernel variant.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
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
    write_result,
)
from benchmarks.datasets import long_text
from benchmarks.serve import METRICS, _free_port, run_level, stop, wait_healthy


class Processes:
    """Several server processes stopped as one (what benchmarks/serve.py's stop takes)."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], urls: dict[str, str]) -> None:
        self.procs = procs
        self.urls = urls  # the instances behind the proxy, by role

    def send_signal(self, sig: int) -> None:
        for p in reversed(self.procs):  # the proxy first
            p.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return max(p.wait(timeout) for p in self.procs)

    def kill(self) -> None:
        for p in self.procs:
            p.kill()


def start(args: list[str], cpus: set[int] | None) -> tuple[subprocess.Popen[bytes], str]:
    """`sluice serve args` on a free port, pinned to `cpus` (None: not pinned)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "sluice.cli", "serve", "--port", str(port), *args]
    print("starting:", " ".join(cmd), f"(CPUs {sorted(cpus) if cpus else 'any'})", flush=True)

    def pin() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)

    proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr, preexec_fn=pin)
    return proc, f"http://127.0.0.1:{port}"


def start_side(name: str, cpus: tuple[int, int], common: list[str]) -> tuple[Any, str]:
    if name == "colocated":
        proc, url = start(["--num-threads", "2", *common], set(cpus))
        return proc, wait_healthy(proc, url, "colocated")
    pre, pre_url = start(["--role", "prefill", "--num-threads", "1", *common], {cpus[0]})
    dec, dec_url = start(["--role", "decode", "--num-threads", "1", *common], {cpus[1]})
    procs = [pre, dec]
    try:
        wait_healthy(pre, pre_url, "prefill")
        wait_healthy(dec, dec_url, "decode")
        proxy_args = ["--role", "proxy", "--prefill-url", pre_url, "--decode-url", dec_url]
        proxy, url = start(proxy_args, None)
        procs.append(proxy)
        group = Processes(procs, {"prefill": pre_url, "decode": dec_url})
        return group, wait_healthy(proxy, url, "proxy")
    except BaseException:
        Processes(procs, {}).kill()
        raise


def prompts_of(n: int, length: int) -> list[list[int]]:
    """n distinct, consecutive `length`-token slices of the plays (token ids)."""
    from sluice.loader import load_tokenizer

    _, tok = load_tokenizer(None)
    ids = tok.encode(long_text(n * length * 6))
    if len(ids) < n * length:
        raise SystemExit(f"the plays give {len(ids)} tokens, fewer than {n} x {length}")
    return [ids[i * length : (i + 1) * length] for i in range(n)]


def measure(
    name: str, args: argparse.Namespace, prompts: list[list[int]], common: list[str]
) -> dict[str, Any]:
    cpus = (args.cpus[0], args.cpus[1])
    proc, url = start_side(name, cpus, common)
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        warm = asyncio.run(run_level(url, model, ["Hello there"], 1, 8, {}))
        if warm.errors:
            raise SystemExit(f"{name} warm-up failed: {warm.error_samples}")
        # Token-id prompts go in the same "prompt" field as text.
        ids: list[Any] = list(prompts)
        res = asyncio.run(run_level(url, model, ids, args.streams, args.max_tokens, {}))
        urls = proc.urls if isinstance(proc, Processes) else {"colocated": url}
        stats = {role: _stats(u) for role, u in urls.items()}
    finally:
        stop(proc)
    print(
        f"  {name:<10} {res.output_tok_per_s:7.1f} tok/s, TTFT p50 {res.ttft_p50_ms:.0f} / p99 "
        f"{res.ttft_p99_ms:.0f} ms, TPOT p50 {res.tpot_p50_ms:.1f} / p99 {res.tpot_p99_ms:.1f} "
        f"ms ({res.completed}/{res.num_prompts} ok, {res.duration_s:.1f} s)",
        flush=True,
    )
    pulls = stats.get("decode", {})
    if pulls.get("pd_pulled_transfers"):
        mean = pulls["pd_pull_seconds"] / pulls["pd_pulled_transfers"]
        print(f"  {'':<10} mean KV pull {mean * 1e3:.0f} ms per request", flush=True)
    return {**vars(res), "stats": stats}


def _stats(url: str) -> dict[str, Any]:
    """The instance's /stats: KV use, and the pd_* counters (pull times, held blocks)."""
    return dict(httpx.get(f"{url}/stats", timeout=10).json())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=None, help="default: --streams")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--cpus", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1])
    ap.add_argument("--server-args", default="", help="more `sluice serve` arguments, all sides")
    add_rounds_arg(ap)
    add_output_arg(ap, "pd_disagg")
    args = ap.parse_args()
    n = args.num_prompts or args.streams
    ctx = args.prompt_tokens + args.max_tokens + 64
    common = ["--max-model-len", str(ctx), *args.server_args.split()]
    prompts = prompts_of(n, args.prompt_tokens)
    runs = interleave(
        ["colocated", "disagg"], args.rounds, lambda name: measure(name, args, prompts, common)
    )
    cmp = compare(runs, METRICS, baseline="colocated")
    # The raw runs too: compare() keeps only the metrics, not each instance's /stats.
    result = {"config": vars(args), "common_server_args": common, "comparison": cmp}
    result["runs"] = runs
    print(
        f"\n== {n} prompts of {args.prompt_tokens} tokens, {args.streams} streams, "
        f"{args.max_tokens} output tokens: median (min-max) of {cmp['rounds']} rounds =="
    )
    for side in cmp["sides"]:
        s = cmp["summary"][side]
        print(
            f"  {side:<10} {fmt_spread(s['output_tok_per_s'])} tok/s, "
            f"TTFT p50 {fmt_spread(s['ttft_p50_ms'], digits=0)} p99 "
            f"{fmt_spread(s['ttft_p99_ms'], digits=0)} ms, TPOT p50 "
            f"{fmt_spread(s['tpot_p50_ms'])} p99 {fmt_spread(s['tpot_p99_ms'])} ms"
        )
    r = cmp["ratio_of_medians"]["disagg"]
    print(
        f"  disagg / colocated: TTFT p50 {r['ttft_p50_ms']:.2f}x, "
        f"TPOT p50 {r['tpot_p50_ms']:.2f}x, TPOT p99 {r['tpot_p99_ms']:.2f}x, "
        f"output tok/s {r['output_tok_per_s']:.2f}x"
    )
    path = write_result("pd_disagg", result, args.output, threads=2)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
