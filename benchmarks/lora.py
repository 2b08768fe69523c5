"""LoRA serving: many adapters mixed in one batch against the base alone, one stream
with an adapter against the base and against llama.cpp, and loading an adapter.

Adapters: --adapters random PEFT adapters of rank --rank on all seven projections
(seeded; their speed does not depend on what they learned), written for the model's
shape. llama.cpp gets the first as GGUF, made by its own converter
(convert_lora_to_gguf.py, --llama-cpp-src), which sluice also loads: the run checks
that sluice gives the same greedy tokens from that file as from the PEFT folder.

1. Throughput (--streams concurrent streams, 2x as many ShareGPT prompts, --max-tokens
   each, ignore_eos): `sluice serve` without LoRA, every request for the base ("base"),
   against `sluice serve --enable-lora --max-loras N --lora-modules ...` with the
   requests spread round-robin over the N adapters and the base ("mixed").
2. One stream, --max-tokens tokens after a short prompt: decode tok/s (from the
   client's token times) of the base and of the first adapter on the LoRA server, and
   of llama-server with `--lora` on the same GGUF (its requests all get the adapter).
3. Loading: POST /v1/load_lora_adapter of the first adapter under new names, then
   unload, --loads times on the LoRA server; the client's round trip.

Every measurement starts its server and stops it (one server up at a time), in
interleaved rounds; medians.

    python benchmarks/lora.py --model smollm2-135m --llama-server PATH
    python benchmarks/lora.py --model qwen2.5-coder-0.5b --llama-server PATH
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from benchmarks.common import (
    add_output_arg,
    add_rounds_arg,
    compare,
    fmt_spread,
    format_table,
    interleave,
    llama_cpp_build,
    write_result,
)
from benchmarks.datasets import sharegpt_prompts
from benchmarks.random_models import write_random_adapter
from benchmarks.serve import _free_port, one_request, start_sluice, stop, wait_healthy
from sluice.loader import load_tokenizer
from sluice.loader.resolve import resolve_model_path


def llama_cpp_adapter(gguf: Path, adapter: Path, src: Path, work: Path) -> Path:
    """The adapter as llama.cpp's converter writes it (f32), the base's config.json
    taken from the GGUF by transformers."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    base = work / "base-config"
    config = transformers.AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A config read from a GGUF names no class; the converter picks its writer by it.
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.save_pretrained(base)
    out = work / "adapter.gguf"
    cmd = [sys.executable, str(src / "convert_lora_to_gguf.py"), "--base", str(base),
           "--outfile", str(out), "--outtype", "f32", str(adapter)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True)
    return out


def gguf_adapter_agrees(model: str, folder: Path, gguf_adapter: Path) -> dict[str, Any]:
    """sluice's greedy tokens (fp32) from llama.cpp's GGUF file and from the PEFT folder."""
    from sluice import LLM, LoRARequest, SamplingParams

    llm = LLM(model=model, dtype="float32", kv_cache_memory=0.25, enable_lora=True)
    sp = SamplingParams(temperature=0, max_tokens=32)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    runs = [
        [
            list(o.outputs[0].token_ids)
            for o in llm.generate(prompts, sp, use_tqdm=False, lora_request=r)
        ]
        for r in (LoRARequest("peft", 1, str(folder)), LoRARequest("gguf", 2, str(gguf_adapter)))
    ]
    return {"tokens_equal": runs[0] == runs[1], "tokens": sum(map(len, runs[0]))}


def _lora_args(adapters: list[Path]) -> list[str]:
    modules = [f"a{i}={p}" for i, p in enumerate(adapters)]
    return ["--enable-lora", "--max-loras", str(len(adapters)), "--lora-modules", *modules]


async def _stream_mix(
    url: str, models: list[str], prompts: list[str], streams: int, max_tokens: int
) -> dict[str, float]:
    """Output tok/s of `streams` concurrent streams over `prompts`, request i for
    models[i % len(models)]."""
    queue = list(enumerate(prompts))
    results = []
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=30)) as client:

        async def worker() -> None:
            while queue:
                i, prompt = queue.pop(0)
                model = models[i % len(models)]
                results.append(
                    await one_request(client, url, model, prompt, max_tokens, {"temperature": 0.0})
                )

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(streams)))
        duration = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    return {
        "output_tok_per_s": sum(r.output_tokens for r in ok) / duration,
        "errors": float(len(results) - len(ok)),
        "duration_s": duration,
    }


def _base_name(url: str) -> str:
    return str(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])


def measure_throughput(
    args: argparse.Namespace, adapters: list[Path], side: str
) -> dict[str, float]:
    threads = ["--num-threads", str(args.threads)]
    extra = _lora_args(adapters) if side == "mixed" else []
    proc, url = start_sluice(
        ["--model", args.model, *threads, "--no-enable-prefix-caching", *extra]
    )
    try:
        base = _base_name(url)
        models = [base] if side == "base" else [base, *(f"a{i}" for i in range(len(adapters)))]
        asyncio.run(_stream_mix(url, models, ["Hello"] * len(models), len(models), 8))  # warm-up
        prompts = sharegpt_prompts(2 * args.streams, seed=0, max_prompt_tokens=256,
                                   tokenizer_encode=args.tokenizer.encode)  # fmt: skip
        return asyncio.run(_stream_mix(url, models, prompts, args.streams, args.max_tokens))
    finally:
        stop(proc)


async def _decode_rate(url: str, model: str, max_tokens: int) -> float:
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30)) as client:
        r = await one_request(client, url, model, "Tell me a story about a dragon.", max_tokens,
                              {"temperature": 0.0})  # fmt: skip
    assert r.ok and r.tpot, r.error
    return 1.0 / r.tpot


def measure_single(args: argparse.Namespace, adapters: list[Path], side: str) -> dict[str, float]:
    """Decode tok/s of one stream: side "sluice" (base and adapter, each twice, on one
    LoRA server) or "llama.cpp" (llama-server --lora)."""
    if side == "sluice":
        flags = ["--num-threads", str(args.threads), "--no-enable-prefix-caching"]
        proc, url = start_sluice(["--model", args.model, *flags, *_lora_args(adapters[:1])])
        models = {"sluice_base": _base_name(url), "sluice_adapter": "a0"}
    else:
        port = _free_port()
        cmd = [str(args.llama_server), "-m", str(args.gguf), "--lora", str(args.gguf_adapter),
               "--port", str(port), "-t", str(args.threads), "-tb", str(args.threads), "-np", "1",
               "-c", "2048"]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = wait_healthy(proc, f"http://127.0.0.1:{port}", "llama-server")
        models = {"llama_adapter": "any"}
    try:
        out: dict[str, list[float]] = {k: [] for k in models}
        asyncio.run(_decode_rate(url, next(iter(models.values())), 8))  # warm-up
        for k in range(2):
            for key in models if k % 2 == 0 else reversed(models):
                out[key].append(asyncio.run(_decode_rate(url, models[key], args.max_tokens)))
        return {key: statistics.median(v) for key, v in out.items()}
    finally:
        stop(proc)


def measure_loads(args: argparse.Namespace, adapter: Path) -> list[float]:
    """Round trips (ms) of POST /v1/load_lora_adapter, each followed by an unload."""
    proc, url = start_sluice(["--model", args.model, "--num-threads", str(args.threads),
                              "--enable-lora"])  # fmt: skip
    times = []
    try:
        for i in range(args.loads):
            t0 = time.perf_counter()
            body = {"lora_name": f"x{i}", "lora_path": str(adapter)}
            r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)
            times.append((time.perf_counter() - t0) * 1e3)
            assert r.status_code == 200, r.text
            httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": f"x{i}"}, timeout=60)
    finally:
        stop(proc)
    return times


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--loads", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", type=Path, default=None)
    ap.add_argument(
        "--llama-cpp-src",
        type=Path,
        default=Path(".venv/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp"),
        help="llama.cpp's source tree (its convert_lora_to_gguf.py)",
    )
    add_rounds_arg(ap)
    add_output_arg(ap, "lora")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    config, args.tokenizer = load_tokenizer(args.model)
    args.gguf = resolve_model_path(args.model)
    work = Path(tempfile.mkdtemp(prefix="sluice-lora-bench-"))
    adapters = [
        write_random_adapter(config, args.rank, seed, work / f"a{seed}")
        for seed in range(args.adapters)
    ]
    result: dict[str, Any] = {"model": args.model, "adapters": args.adapters, "rank": args.rank,
                              "streams": args.streams, "max_tokens": args.max_tokens}  # fmt: skip
    sides = ["sluice"]
    if args.llama_server is not None:
        args.gguf_adapter = llama_cpp_adapter(args.gguf, adapters[0], args.llama_cpp_src, work)
        result["gguf_adapter"] = gguf_adapter_agrees(args.model, adapters[0], args.gguf_adapter)
        result["llama_cpp"] = llama_cpp_build(args.llama_server)
        sides.append("llama.cpp")
    runs = interleave(
        ["base", "mixed"],
        args.rounds,
        lambda s: measure_throughput(args, adapters, s),
        "throughput",
    )
    result["throughput"] = compare(runs, ["output_tok_per_s", "errors"], baseline="base")
    single = interleave(
        sides, args.rounds, lambda s: measure_single(args, adapters, s), "one stream"
    )
    flat: dict[str, list[float]] = {}
    for measurements in single.values():
        for m in measurements:
            for key, value in m.items():
                flat.setdefault(key, []).append(value)
    result["single_stream"] = {
        k: {"runs": v, "median": statistics.median(v)} for k, v in flat.items()
    }
    loads = measure_loads(args, adapters[0])
    result["load_ms"] = {"runs": loads, "median": statistics.median(loads)}
    path = write_result("lora", result, args.output, threads=args.threads)
    report(result)
    print(f"wrote {path}")


def report(result: dict[str, Any]) -> None:
    t = result["throughput"]
    rows = [[side, fmt_spread(t["summary"][side]["output_tok_per_s"])] for side in t["sides"]]
    print(format_table(["side", "output tok/s"], rows))
    print(f"mixed / base: {t['ratio_of_medians']['mixed']['output_tok_per_s']:.2f}x")
    s = {k: v["median"] for k, v in result["single_stream"].items()}
    print("one stream, decode tok/s:", {k: round(v, 1) for k, v in s.items()})
    print(f"adapter / base: {s['sluice_adapter'] / s['sluice_base']:.2f}x")
    if "llama_adapter" in s:
        print(f"adapter, sluice / llama.cpp: {s['sluice_adapter'] / s['llama_adapter']:.2f}x")
    print(f"load: {result['load_ms']['median']:.0f} ms (median)")


if __name__ == "__main__":
    main()
