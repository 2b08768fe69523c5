"""GGUF weights kept quantized (issue 13): memory, decode speed and perplexity, each model
beside llama.cpp on the same GGUF, in one run.

Why: `quantization="auto"` is to keep a GGUF's quantized blocks in memory instead of a
dense copy, so a model should cost about its file size. This script measures that
claim and what it costs in speed and accuracy, for each packaged model, against
llama.cpp (llama-cpp-python, `make llamacpp`) as the reference:

1. Memory: one fresh process per system and model loads the model and generates
   --memory-tokens greedy tokens. Reported: the GGUF's size, the RSS right after
   `import torch, sluice` (the baseline: torch alone is ~250 MB, which no model-size
   target can include), the peak RSS (ru_maxrss at the end), peak minus baseline, the
   KV pool (sluice: --kv-cache-memory GiB; llama.cpp: n_ctx = the tokens that pool
   holds, f16) and sluice's weight bytes. Target: (peak - baseline - resident KV) /
   file <= 1.3. The KV cache's resident bytes are taken off on both sides: sluice's
   pool is mapped lazily (the pages of blocks never written are not resident, measured
   from /proc/self/smaps), llama.cpp clears its cache (all of it is resident).
2. Decode, single stream: 128 greedy tokens after a short ShareGPT chat prompt, 2
   threads each; at every --levels kernel level one `single_stream.py --rounds 1` process
   per round (set up as cpu_levels.py does: SLUICE_CPU_ISA, ATEN_CPU_CAPABILITY,
   ONEDNN_MAX_CPU_ISA), which times sluice and then llama.cpp (as built) in the same
   minute; the levels alternate by round (A B, B A, ...), medians and min-max reported.
3. Perplexity (--perplexity, slower): llama-perplexity's method on the packaged
   Wikipedia text: the first --ppl-chunks chunks of --ppl-ctx tokens (BOS in place of
   each chunk's first token when the model adds one), scoring the second half of each
   chunk; ppl and its standard error as llama-perplexity computes them. sluice's worker
   tokenizes the text and hands the chunks to llama.cpp's worker, so both score
   identical tokens. sluice runs with quantization auto, its quantized kernels forced
   for the prefills (as benchmarks/quantization.py does: what decoding multiplies by).

Writes docs/results/gguf_models.json (--output); benchmarks/report.py renders it.

Run from the repo root (the full run, on a quiet machine):
    .venv/bin/python benchmarks/gguf_models.py --rounds 5 --levels avx512,avx2 --perplexity
Smoke test:
    .venv/bin/python benchmarks/gguf_models.py --models smollm2-135m --rounds 1 \\
        --max-tokens 8 --perplexity --ppl-chunks 2 --output /tmp/gguf_models.json
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import hashlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.common import (  # noqa: E402
    DOC_RESULTS_DIR,
    add_output_arg,
    add_rounds_arg,
    compare,
    fmt_spread,
    format_table,
    interleave,
    shown_path,
    write_result,
)

MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
MEMORY_TARGET = 1.3  # (peak - baseline - KV) / file size
PROMPT = "Explain in three sentences why rivers meander."
RESULT_TAG = "GGUF_MODELS_RESULT "  # a worker's answer: the one stdout line with this prefix
MIB = 2**20


# ---- worker side: each runs in a fresh process and prints one RESULT_TAG line -----------------


def rss_bytes() -> int:
    """This process's resident memory now (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_rss_bytes() -> int:
    """The most resident memory this process has had (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def resident_bytes(spans: list[tuple[int, int]]) -> int:
    """The resident bytes of the memory at `spans` (address, length): the Rss of each
    mapping in /proc/self/smaps, in proportion to how much of it the spans cover. A
    large tensor is a mapping of its own, so this is the pages it has touched."""
    total = 0
    region: tuple[int, int] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                region = (lo, hi)
            elif head == "Rss:" and region is not None:
                lo, hi = region
                cover = sum(max(0, min(hi, a + n) - max(lo, a)) for a, n in spans)
                if cover:
                    total += int(line.split()[1]) * 1024 * cover // (hi - lo)
    return total


def baseline_rss() -> int:
    """RSS after `import torch, sluice`: what every process pays before any model."""
    import torch  # noqa: F401

    import sluice  # noqa: F401

    return rss_bytes()


def sluice_weight_bytes(model: Any) -> int | None:
    """sluice's own count of its weight bytes (issue 13's helper; None before it lands)."""
    try:
        from sluice.layers.block_quant import weight_bytes
    except ImportError:
        return None
    return int(weight_bytes(model))


def llamacpp_kv_bytes(metadata: dict[str, str], n_ctx: int) -> int:
    """llama.cpp's K and V cache for n_ctx tokens at its default f16, from GGUF metadata."""
    arch = metadata["general.architecture"]

    def meta(key: str, default: int | None = None) -> int:
        value = metadata.get(f"{arch}.{key}")
        if value is None:
            if default is None:
                raise KeyError(f"{arch}.{key}")
            return default
        return int(value)

    heads = meta("attention.head_count")
    head_dim = meta("embedding_length") // heads
    width = meta("attention.key_length", head_dim) + meta("attention.value_length", head_dim)
    kv_heads = meta("attention.head_count_kv", heads)
    return meta("block_count") * n_ctx * kv_heads * width * 2


def memory_sluice(job: dict[str, Any]) -> dict[str, Any]:
    base = baseline_rss()
    import torch

    from sluice import LLM, SamplingParams

    llm = LLM(model=job["model"], kv_cache_memory=job["kv_gib"])
    loaded = rss_bytes()
    tok, eng = llm.tokenizer, llm.engine
    chat = [{"role": "user", "content": PROMPT}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    sp = SamplingParams(temperature=0, max_tokens=job["tokens"], ignore_eos=True)
    llm.generate([ids], sp, use_tqdm=False)
    blocks, bs = eng.kv.pool.num_blocks, eng.config.block_size
    return {
        "baseline_rss": base,
        "loaded_rss": loaded,
        "end_rss": rss_bytes(),
        "peak_rss": peak_rss_bytes(),
        # Every pool's reserved bytes (a split cache's local pool included), and what
        # of them is resident: the pool is mapped lazily, so blocks never written take
        # no memory (llama.cpp clears its cache, so all of its cache is resident).
        "kv_bytes": sum(p.numel() * p.element_size() for p in eng.runner.kv_pools),
        "kv_resident": resident_bytes(
            [(p.data_ptr(), p.numel() * p.element_size()) for p in eng.runner.kv_pools]
        ),
        "kv_tokens": blocks * bs,
        "weight_bytes": sluice_weight_bytes(eng.runner.model),
        "dtype": str(eng.dtype).removeprefix("torch."),
        "quantization": eng.quantization,
        "kernels": eng.cpu_kernels,
        "threads": torch.get_num_threads(),
        "prompt_ids": ids,
    }


def memory_llamacpp(job: dict[str, Any]) -> dict[str, Any]:
    base = baseline_rss()
    from llama_cpp import Llama

    lm = Llama(
        model_path=job["gguf"],
        n_ctx=job["n_ctx"],
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        verbose=False,
    )
    loaded = rss_bytes()
    for i, _ in enumerate(lm.generate(job["prompt_ids"], temp=0.0, top_k=1), start=1):
        if i == job["tokens"]:
            break
    return {
        "baseline_rss": base,
        "loaded_rss": loaded,
        "end_rss": rss_bytes(),
        "peak_rss": peak_rss_bytes(),
        "kv_bytes": llamacpp_kv_bytes(lm.metadata, lm.n_ctx()),
        "kv_resident": llamacpp_kv_bytes(lm.metadata, lm.n_ctx()),  # cleared at creation
        "kv_tokens": lm.n_ctx(),
        "threads": job["threads"],
    }


def make_chunks(tokenizer: Any, n_chunks: int, n_ctx: int) -> list[list[int]]:
    """llama-perplexity's chunks: consecutive n_ctx-token slices of the text, each
    starting with BOS (in place of its first token) when the model adds one."""
    from benchmarks.datasets import wiki_text

    ids = tokenizer.encode(wiki_text(), add_special_tokens=False)
    if len(ids) < n_chunks * n_ctx:
        raise ValueError(f"the text has {len(ids)} tokens, {n_chunks} x {n_ctx} asked")
    chunks = [ids[i * n_ctx : (i + 1) * n_ctx] for i in range(n_chunks)]
    if tokenizer.add_bos and tokenizer.bos_token_id is not None:
        for chunk in chunks:
            chunk[0] = tokenizer.bos_token_id
    return chunks


def nll_summary(nlls: Sequence[float]) -> dict[str, float]:
    """Perplexity and its standard error, as llama-perplexity reports them."""
    n = len(nlls)
    mean = sum(nlls) / n
    var = sum(x * x for x in nlls) / n - mean * mean
    ppl = math.exp(mean)
    se = ppl * math.sqrt(var / (n - 1)) if n > 1 and var > 0 else float("nan")
    return {"perplexity": ppl, "stderr": se, "scored_tokens": n}


def ppl_sluice(job: dict[str, Any]) -> dict[str, Any]:
    from sluice import LLM, SamplingParams

    llm = LLM(model=job["model"], kv_cache_memory=1.0)
    chunks = make_chunks(llm.tokenizer, job["chunks"], job["ctx"])
    Path(job["chunks_file"]).write_text(json.dumps(chunks))
    try:
        from sluice.layers.quantization import quantized_kernels_only
    except ImportError:
        quantized_kernels_only = None
    first = job["ctx"] // 2
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    nlls: list[float] = []
    for chunk in chunks:  # one at a time: each holds ctx rows of vocabulary logits
        model = llm.engine.runner.model
        if quantized_kernels_only is not None:
            with quantized_kernels_only(model):
                (out,) = llm.generate([chunk], sp, use_tqdm=False)
        else:
            (out,) = llm.generate([chunk], sp, use_tqdm=False)
        lps = out.prompt_logprobs
        assert lps is not None
        nlls += [-lps[j][chunk[j]].logprob for j in range(first + 1, len(chunk))]
    return {
        **nll_summary(nlls),
        "quantization": llm.engine.quantization,
        "dtype": str(llm.engine.dtype).removeprefix("torch."),
        "quantized_kernels_forced": quantized_kernels_only is not None,
        "tokens_sha256": tokens_digest(chunks),
    }


def ppl_llamacpp(job: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    from llama_cpp import Llama

    chunks = json.loads(Path(job["chunks_file"]).read_text())
    ctx = job["ctx"]
    lm = Llama(
        model_path=job["gguf"],
        n_ctx=ctx,
        n_batch=ctx,
        n_ubatch=ctx,
        logits_all=True,
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        verbose=False,
    )
    first = ctx // 2
    nlls: list[float] = []
    for chunk in chunks:
        lm.reset()
        lm.eval(chunk)
        logits = np.asarray(lm.scores[first : len(chunk) - 1], dtype=np.float64)
        top = logits.max(axis=1)
        lse = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
        targets = np.asarray(chunk[first + 1 :])
        nlls += (lse - logits[np.arange(len(targets)), targets]).tolist()
    return {**nll_summary(nlls), "tokens_sha256": tokens_digest(chunks)}


def tokens_digest(chunks: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(chunks).encode()).hexdigest()[:16]


WORKERS = {
    "memory-sluice": memory_sluice,
    "memory-llamacpp": memory_llamacpp,
    "ppl-sluice": ppl_sluice,
    "ppl-llamacpp": ppl_llamacpp,
}


def run_worker(name: str, job: dict[str, Any]) -> dict[str, Any]:
    """Run WORKERS[name](job) in a fresh process; its stderr (logs, progress) passes through."""
    cmd = [sys.executable, __file__, "--worker", name, "--job", json.dumps(job)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT_TAG)]
    if not lines:
        raise RuntimeError(f"worker {name} gave no result; stdout:\n{proc.stdout[-2000:]}")
    return dict(json.loads(lines[-1].removeprefix(RESULT_TAG)))


# ---- the three measurements, per model -------------------------------------------------------


def measure_memory(alias: str, gguf: Path, args: argparse.Namespace) -> dict[str, Any]:
    print(f"{alias}: memory, sluice ...", flush=True)
    job = {"model": alias, "kv_gib": args.kv_cache_memory, "tokens": args.memory_tokens}
    ours = run_worker("memory-sluice", job)
    sides = {"sluice": ours}
    if args.llamacpp:
        print(f"{alias}: memory, llama.cpp ...", flush=True)
        job = {
            "gguf": str(gguf),
            "n_ctx": ours["kv_tokens"],
            "threads": ours["threads"],
            "prompt_ids": ours["prompt_ids"],
            "tokens": args.memory_tokens,
        }
        sides["llama.cpp"] = run_worker("memory-llamacpp", job)
    ours["prompt_tokens"] = len(ours.pop("prompt_ids"))
    size = gguf.stat().st_size
    for side in sides.values():
        side["peak_minus_baseline"] = side["peak_rss"] - side["baseline_rss"]
        # The KV cache's resident bytes come off on both sides alike (issue 36: taking
        # sluice's whole reserved pool off made its ratio look smaller than it is).
        side["ratio_to_file"] = (side["peak_minus_baseline"] - side["kv_resident"]) / size
    return sides


def measure_speed(alias: str, args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.cpu_levels import run_level

    opts = argparse.Namespace(method="auto", max_tokens=args.max_tokens, model=alias)
    runs = interleave(args.levels, args.rounds, lambda lvl: run_level(lvl, opts), alias)
    for level, rs in runs.items():
        assert all(r["variant"] == level for r in rs), (level, rs)
    metrics = ["sluice_tok_s", "llamacpp_tok_s", "ratio_to_llamacpp"]
    cmp = compare(runs, metrics, args.levels[0])
    return {
        "comparison": cmp,
        "dtype": {lvl: rs[0]["dtype"] for lvl, rs in runs.items()},
        # Which ggml CPU backend llama.cpp ran at each level (make llamacpp-levels).
        "llamacpp_isa": {lvl: rs[0].get("llamacpp_isa") for lvl, rs in runs.items()},
    }


def measure_perplexity(
    alias: str, gguf: Path, threads: int, args: argparse.Namespace
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:  # sluice's worker writes the chunks here
        job = {"model": alias, "chunks": args.ppl_chunks, "ctx": args.ppl_ctx}
        job |= {"chunks_file": f"{tmp}/chunks.json", "gguf": str(gguf), "threads": threads}
        print(f"{alias}: perplexity, sluice ...", flush=True)
        sides = {"sluice": run_worker("ppl-sluice", job)}
        if args.llamacpp:
            print(f"{alias}: perplexity, llama.cpp ...", flush=True)
            sides["llama.cpp"] = run_worker("ppl-llamacpp", job)
    return {"chunks": args.ppl_chunks, "ctx": args.ppl_ctx, "systems": sides}


def measure_model(alias: str, args: argparse.Namespace) -> dict[str, Any]:
    from sluice.loader import resolve_model_path

    gguf = resolve_model_path(alias)
    row: dict[str, Any] = {"gguf": gguf.name, "file_bytes": gguf.stat().st_size}
    if not args.skip_memory:
        row["memory"] = measure_memory(alias, gguf, args)
    if not args.skip_speed:
        row["speed"] = measure_speed(alias, args)
    if args.perplexity:
        threads = row.get("memory", {}).get("sluice", {}).get("threads", args.threads)
        row["perplexity"] = measure_perplexity(alias, gguf, threads, args)
    return row


# ---- tables ----------------------------------------------------------------------------------


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / MIB:,.0f}"


def memory_rows(models: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for alias, m in models.items():
        for system, s in m.get("memory", {}).items():
            rows.append(
                [
                    alias,
                    system,
                    _mib(m["file_bytes"]),
                    _mib(s["baseline_rss"]),
                    _mib(s["peak_rss"]),
                    _mib(s["peak_minus_baseline"]),
                    f"{_mib(s['kv_bytes'])} ({s['kv_tokens']:,} tok)",
                    _mib(s.get("weight_bytes")),
                    f"{s['ratio_to_file']:.2f}",
                ]
            )
    return rows


MEMORY_HEADERS = [
    "model",
    "system",
    "file MiB",
    "baseline MiB",
    "peak MiB",
    "peak-base MiB",
    "KV MiB",
    "weights MiB",
    f"(peak-base-KV)/file (<= {MEMORY_TARGET})",
]


def speed_rows(models: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for alias, m in models.items():
        if "speed" not in m:
            continue
        cmp = m["speed"]["comparison"]
        for level in cmp["sides"]:
            s = cmp["summary"][level]
            rows.append(
                [
                    alias,
                    level,
                    m["speed"]["dtype"][level],
                    fmt_spread(s["sluice_tok_s"]),
                    m["speed"].get("llamacpp_isa", {}).get(level) or "-",
                    fmt_spread(s["llamacpp_tok_s"]),
                    fmt_spread(s["ratio_to_llamacpp"], 1, 2),
                ]
            )
    return rows


SPEED_HEADERS = [
    *("model", "level", "dtype", "sluice tok/s", "llama.cpp built for", "llama.cpp tok/s"),
    "sluice/llama.cpp",
]


def _ppl(p: dict[str, Any] | None) -> str:
    return "-" if p is None else f"{p['perplexity']:.3f} ± {p['stderr']:.3f}"


def perplexity_rows(models: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for alias, m in models.items():
        if "perplexity" in m:
            p = m["perplexity"]
            ours, peer = p["systems"]["sluice"], p["systems"].get("llama.cpp")
            same = peer is not None and peer["tokens_sha256"] == ours["tokens_sha256"]
            tokens = f"{p['chunks']} x {p['ctx']} ({ours['scored_tokens']:,} scored)"
            rows.append([alias, tokens, _ppl(ours), _ppl(peer), "yes" if same else "-"])
    return rows


PPL_HEADERS = ["model", "chunks", "sluice ppl", "llama.cpp ppl", "same tokens"]


def print_tables(result: dict[str, Any]) -> None:
    models, cfg = result["models"], result["config"]
    if rows := memory_rows(models):
        print(f"\n== Memory: load + {cfg['memory_tokens']} tokens, one process each ==")
        print(format_table(MEMORY_HEADERS, rows, left=2))
    if rows := speed_rows(models):
        print(
            f"\n== Single-stream decode, {cfg['max_tokens']} tokens; median (min-max) of "
            f"{cfg['rounds']} interleaved rounds =="
        )
        print(format_table(SPEED_HEADERS, rows, left=3))
    if rows := perplexity_rows(models):
        print("\n== Perplexity (llama-perplexity's method), ± standard error ==")
        print(format_table(PPL_HEADERS, rows, left=2))


# ---- command line ----------------------------------------------------------------------------


def default_levels() -> str:
    from sluice.kernels import cpu

    return ",".join(x for x in ("avx512", "avx2") if x in cpu.supported_levels())


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help="sluice model aliases")
    add_rounds_arg(ap)
    ap.add_argument("--levels", default=None, help="sluice kernel levels (default: avx512,avx2)")
    ap.add_argument("--max-tokens", type=int, default=128, help="decode tokens per round")
    ap.add_argument("--kv-cache-memory", type=float, default=0.25, help="sluice KV pool, GiB")
    ap.add_argument("--memory-tokens", type=int, default=16, help="tokens the memory runs make")
    ap.add_argument("--perplexity", action="store_true", help="also score perplexity (slower)")
    ap.add_argument("--ppl-chunks", type=int, default=20)
    ap.add_argument("--ppl-ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's, when memory is skipped")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-llamacpp", action="store_true")
    add_output_arg(ap, "gguf_models")
    ap.set_defaults(output=DOC_RESULTS_DIR / "gguf_models.json")
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.models = args.models.split(",")
    args.levels = (args.levels or default_levels()).split(",")
    has_llamacpp = importlib.util.find_spec("llama_cpp") is not None
    if not has_llamacpp and not args.skip_llamacpp:
        print("llama-cpp-python is not installed (make llamacpp): sluice only", flush=True)
    args.llamacpp = has_llamacpp and not args.skip_llamacpp
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        print(RESULT_TAG + json.dumps(WORKERS[args.worker](json.loads(args.job))), flush=True)
        return
    config = {k: v for k, v in vars(args).items() if k not in ("worker", "job")}
    result: dict[str, Any] = {"config": config | {"output": str(args.output)}, "models": {}}
    for alias in args.models:
        result["models"][alias] = measure_model(alias, args)
        write_result("gguf_models", result, args.output)  # after each model: keep what ran
    print_tables(result)
    print(f"\nwrote {shown_path(args.output)}")


if __name__ == "__main__":
    main()
