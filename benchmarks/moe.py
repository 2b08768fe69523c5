"""GGUF models beside llama.cpp on the same file: Mixture-of-Experts (issue 35) and the
3B-8B dense shapes (issue 34). Prompt processing (a long prompt, and a short one: a
chat turn after a cached system prompt, a handful of streams), single-stream decode
against the machine's read bandwidth, and memory.

No MoE model is packaged; the files are random-weight GGUFs in real models' shapes
(benchmarks/random_gguf.py: OLMoE-1B-7B whole, Qwen3-30B-A3B's layers), which
llama.cpp runs as it runs the released files, so the side by side is fair though the
text is meaningless. Each round runs both sides, one process at a time, alternating
which goes first (benchmarks/common.py's interleave), 2 threads each:

* sluice: a fresh process loads the file (quantization auto: the blocks as stored),
  warms up, then times a --prompt-token prompt (max_tokens=1: prompt tokens / time to
  the first token), the median of 5 --short-prompt prompts (0: none) the same way,
  and --gen greedy tokens after a 16-token prompt (decode tok/s from the first to the
  last token); peak RSS at the end;
* llama.cpp: `llama-bench -p SHORT,PROMPT -n GEN -t 2 -r 1` (its pp and tg rates; tg
  decodes from an empty context, sluice's after 16 tokens: the same bytes per token).

The bytes a decode step reads: each layer's attention, MLP, norms and router, k/E of
its expert stacks (the experts a token picks; all different for one token) and the
output head, from the file's tensor table (the embedding row lookup is left out).
Read bandwidth is measured in the same run: torch's sum over a 1 GiB fp32 tensor of
random values in huge pages on 2 threads, the best of 6 (memory, not arithmetic,
bounds it; results before bf8be50 summed ones in 4 KiB pages). decode tok/s x bytes /
bandwidth is the fraction of the limit each side reaches.

Run (a quiet machine; `make llama-server` builds llama.cpp's llama-server and
llama-bench and links them into .venv/bin, where --llama-bench defaults to):
    .venv/bin/python benchmarks/random_gguf.py shaped --shape olmoe-1b-7b --out /tmp/olmoe.gguf
    .venv/bin/python benchmarks/moe.py --model /tmp/olmoe.gguf --rounds 3 \\
        --output docs/results/moe-olmoe.json
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.common import (  # noqa: E402
    REPO_ROOT,
    add_output_arg,
    add_rounds_arg,
    compare,
    format_table,
    interleave,
    llama_cpp_build,
    write_result,
)

LLAMA_BENCH = REPO_ROOT / ".venv/bin/llama-bench"
METRICS = ("pp_tok_s", "pp_short_tok_s", "tg_tok_s")


def decode_bytes(path: Path) -> dict[str, int]:
    """Bytes a one-token decode step reads (see the module docstring), and the file's."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = str(reader.fields["general.architecture"].contents())
    moe = f"{arch}.expert_count" in reader.fields
    experts = int(reader.fields[f"{arch}.expert_count"].contents()) if moe else 1
    used = int(reader.fields[f"{arch}.expert_used_count"].contents()) if moe else 1
    total = step = 0
    for t in reader.tensors:
        n = int(t.n_bytes)
        total += n
        if t.name == "token_embd.weight":
            continue
        step += n * used // experts if re.search(r"_exps\.", t.name) else n
    if "output.weight" not in {t.name for t in reader.tensors}:  # tied: the head reads it
        step += next(int(t.n_bytes) for t in reader.tensors if t.name == "token_embd.weight")
    return {"tensor_bytes": total, "decode_step_bytes": step, "file_bytes": path.stat().st_size}


def read_bandwidth(threads: int) -> float:
    """GB/s of torch's sum over 1 GiB (best of 6), on `threads` threads, from memory
    in huge pages as the engine holds its weights (the faster of the page sizes here)
    and of random values (pages of one repeated value are what a host merges)."""
    import torch

    from sluice.core import host_memory

    torch.set_num_threads(threads)
    x = host_memory.zeroed((1 << 28,), torch.float32).uniform_()
    best = 0.0
    for _ in range(6):
        t0 = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return best


# ---- the two sides ---------------------------------------------------------------------------


def _sluice_worker(args: argparse.Namespace) -> dict[str, Any]:
    """In a fresh process: load, warm up, time a prompt and a decode; peak RSS."""
    import resource

    import torch

    from sluice import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        num_threads=args.threads,
        enable_prefix_caching=False,
        kv_cache_memory=args.kv_cache_memory,
        max_num_batched_tokens=max(512, args.prompt_tokens),
    )
    load_s = time.perf_counter() - t0
    vocab = llm.engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, vocab, (args.prompt_tokens,), generator=gen).tolist()
    short = torch.randint(100, vocab, (16,), generator=gen).tolist()
    one = SamplingParams(temperature=0, max_tokens=1)
    decode = SamplingParams(temperature=0, max_tokens=args.gen, min_tokens=args.gen)
    llm.generate([short], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm
    t0 = time.perf_counter()
    llm.generate([prompt], one, use_tqdm=False)
    pp_s = time.perf_counter() - t0
    short_s = []
    for _ in range(5 if args.short_prompt else 0):  # distinct prompts: no cache to hit
        ids = torch.randint(100, vocab, (args.short_prompt,), generator=gen).tolist()
        t0 = time.perf_counter()
        llm.generate([ids], one, use_tqdm=False)
        short_s.append(time.perf_counter() - t0)
    out = llm.generate([short], decode, use_tqdm=False)[0]
    m = out.metrics
    assert m is not None and m.first_token_time is not None and m.finished_time is not None
    tg = (len(out.outputs[0].token_ids) - 1) / (m.finished_time - m.first_token_time)
    return {
        "pp_tok_s": args.prompt_tokens / pp_s,
        "pp_short_tok_s": args.short_prompt / statistics.median(short_s) if short_s else None,
        "tg_tok_s": tg,
        "load_s": load_s,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "kv_pool_bytes": sum(p.numel() * p.element_size() for p in llm.engine.runner.kv_pools),
        "weight_bytes": llm.stats()["weight_bytes"],
    }


def _run_sluice(args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", "--model", args.model]
    cmd += ["--threads", str(args.threads), "--prompt-tokens", str(args.prompt_tokens)]
    cmd += ["--short-prompt", str(args.short_prompt)]
    cmd += ["--gen", str(args.gen), "--kv-cache-memory", str(args.kv_cache_memory)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _llama_bench_command(args: argparse.Namespace) -> list[str]:
    cmd = [str(args.llama_bench), "-m", args.model, "-t", str(args.threads), "-r", "1"]
    prompts = [args.short_prompt] if args.short_prompt else []
    cmd += ["-p", ",".join(map(str, [*prompts, args.prompt_tokens]))]
    return [*cmd, "-n", str(args.gen), "-o", "json"]


def _run_llama_cpp(args: argparse.Namespace) -> dict[str, Any]:
    cmd = _llama_bench_command(args)
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rows = json.loads(done.stdout)
    rate = {int(r["n_prompt"]): float(r["avg_ts"]) for r in rows}  # 0: the decode row
    return {
        "pp_tok_s": rate[args.prompt_tokens],
        "pp_short_tok_s": rate.get(args.short_prompt) if args.short_prompt else None,
        "tg_tok_s": rate[0],
        "build": rows[0].get("build_commit"),
    }


def _report(result: dict[str, Any]) -> str:
    stats, b = result["comparison"]["summary"], result["bytes"]
    bw = result["read_bandwidth_gb_s"]
    rows = []
    for side in ("sluice", "llama.cpp"):
        tg = stats[side]["tg_tok_s"]["median"]
        pp, short = stats[side]["pp_tok_s"]["median"], stats[side]["pp_short_tok_s"]["median"]
        share = tg * b["decode_step_bytes"] / 1e9 / bw
        rows.append([side, f"{pp:.1f}", f"{short:.1f}", f"{tg:.2f}", f"{share:.2f}"])
    r = result["comparison"]["ratio_of_medians"]["sluice"]
    ratios = [f"{r[m]:.2f}" for m in ("pp_tok_s", "pp_short_tok_s", "tg_tok_s")]
    rows.append(["sluice / llama.cpp", *ratios, ""])
    headers = ["", "prompt tok/s", "short prompt tok/s", "decode tok/s", "of read bandwidth"]
    return format_table(headers, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--short-prompt", type=int, default=16, help="tokens; 0: not measured")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--kv-cache-memory", type=float, default=0.5, help="GiB")
    ap.add_argument("--llama-bench", type=Path, default=LLAMA_BENCH)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    add_rounds_arg(ap)
    add_output_arg(ap, "moe")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(_sluice_worker(args)))
        return
    run = {"sluice": _run_sluice, "llama.cpp": _run_llama_cpp}
    runs = interleave(list(run), args.rounds, lambda side: run[side](args), label="moe")
    result = {
        "model": Path(args.model).name,
        "prompt_tokens": args.prompt_tokens,
        "short_prompt_tokens": args.short_prompt,
        "bytes": decode_bytes(Path(args.model)),
        "read_bandwidth_gb_s": read_bandwidth(args.threads),
        "comparison": compare(runs, [*METRICS], baseline="llama.cpp"),
        "runs": runs,
        # The peer as it ran: its build (commit, instruction-set level) and command.
        "llama_cpp": {**llama_cpp_build(args.llama_bench), "command": _llama_bench_command(args)},
    }
    print(_report(result))
    print("wrote", write_result("moe", result, args.output, threads=args.threads))


if __name__ == "__main__":
    main()
