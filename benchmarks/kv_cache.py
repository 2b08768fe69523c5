"""The int8 KV cache against the unquantized one (kv_cache_dtype int8 vs auto).

Accuracy (deterministic, one pass): perplexity on packaged Wikipedia text (windows of
--window tokens, teacher-forced: every position attends to K/V as the cache stores
them), the mean KL divergence of int8's next-token distributions from auto's at every
position of that text, and greedy agreement over --gen-tokens-token continuations of
ShareGPT chat prompts. Capacity: KV blocks (and tokens) the same kv_cache_memory holds.
Speed: decode steps with --streams sequences of --context tokens each (distinct
Wikipedia slices, so no block is shared), measured after every prefill has finished;
both engines stay loaded and decode in alternating bursts (A B A B), medians.
Writes benchmarks/results/kv_cache.json (--output).

    .venv/bin/python benchmarks/kv_cache.py [--dtype auto] [--streams 1,64] [--context 2048]
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_output_arg, format_table, shown_path, write_result
from benchmarks.datasets import sharegpt_prompts, wiki_text
from sluice import LLM, SamplingParams
from sluice.runner.model_runner import ModelOutput

KV_DTYPES = ("auto", "int8")


def prompt_logits(llm: LLM, window: list[int]) -> torch.Tensor:
    """Log-softmax of the model's next-token logits at every position of `window`
    ([len - 1, vocab]), read from the runner's output (the engine hands out only top-k
    prompt logprobs; the KL divergence needs whole distributions)."""
    runner = llm.engine.runner
    captured: list[tuple[int, torch.Tensor]] = []
    real = runner.execute

    def execute(scheduled: Any) -> ModelOutput:
        out = real(scheduled)
        captured.extend(out.prompt_logits.values())
        return out

    runner.execute = execute  # type: ignore[method-assign]
    try:
        sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        llm.generate([window], sp, use_tqdm=False)
    finally:
        del runner.execute
    chunks = [logits for _, logits in sorted(captured, key=lambda c: c[0])]
    return torch.log_softmax(torch.cat(chunks).float(), dim=-1)[: len(window) - 1]


def accuracy(llms: dict[str, LLM], windows: list[list[int]]) -> dict[str, dict[str, float]]:
    nll = dict.fromkeys(llms, 0.0)
    kld_sum, top1_same, count = 0.0, 0, 0
    for w in windows:
        logp = {kv: prompt_logits(llm, w) for kv, llm in llms.items()}
        targets = torch.tensor(w[1:])
        for kv, lp in logp.items():
            nll[kv] -= lp[torch.arange(len(targets)), targets].sum().item()
        ref, q = logp["auto"], logp["int8"]
        kld_sum += (ref.exp() * (ref - q)).sum(-1).sum().item()
        top1_same += (ref.argmax(-1) == q.argmax(-1)).sum().item()
        count += len(targets)
    out = {kv: {"perplexity": math.exp(nll[kv] / count)} for kv in llms}
    out["int8"]["mean_kld_vs_auto"] = kld_sum / count
    out["int8"]["top1_agreement_vs_auto"] = top1_same / count
    return out


def greedy_agreement(llms: dict[str, LLM], prompts: list[str], n: int) -> dict[str, float]:
    sp = SamplingParams(temperature=0, max_tokens=n, min_tokens=n)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    gen = {
        kv: [o.outputs[0].token_ids for o in llm.chat(chats, sp, use_tqdm=False)]
        for kv, llm in llms.items()
    }
    prefix = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), n)
        for x, y in zip(gen["int8"], gen["auto"], strict=True)
    ]
    return {
        "greedy_identical": sum(p == n for p in prefix) / len(prefix),
        "greedy_mean_common_prefix": statistics.mean(prefix),
        "greedy_token_agreement": sum(
            a == b
            for x, y in zip(gen["int8"], gen["auto"], strict=True)
            for a, b in zip(x, y, strict=True)
        )
        / (n * len(prompts)),
    }


def decode_speed(
    llms: dict[str, LLM], ids: list[int], streams: int, context: int, steps: int, rounds: int
) -> dict[str, Any]:
    """Milliseconds per decode step with `streams` sequences of `context` tokens."""
    sp = SamplingParams(temperature=0, max_tokens=steps * rounds + 8, ignore_eos=True)
    for kv, llm in llms.items():
        eng = llm.engine
        for s in range(streams):
            eng.add_request(f"{kv}-{streams}-{s}", ids[s * context : (s + 1) * context], sp)
        # Prefill everything: after this every step is `streams` decodes.
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running) or (
            eng.scheduler.waiting
        ):
            eng.step()
        eng.step()
    times: dict[str, list[float]] = {kv: [] for kv in llms}
    for k in range(rounds):
        order = list(llms) if k % 2 == 0 else list(reversed(llms))
        for kv in order:
            eng = llms[kv].engine
            t = time.perf_counter()
            for _ in range(steps):
                eng.step()
            times[kv].append((time.perf_counter() - t) / steps * 1e3)
    for llm in llms.values():  # drop the requests
        for r in list(llm.engine.scheduler.running):
            llm.engine.abort_request(r.request_id)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    med = {kv: statistics.median(v) for kv, v in times.items()}
    return {
        "step_ms_rounds": times,
        "step_ms": med,
        "tok_per_s": {kv: streams * 1e3 / m for kv, m in med.items()},
        "speedup_int8": med["auto"] / med["int8"],
    }


def load(args: argparse.Namespace, memory: float) -> dict[str, LLM]:
    return {
        kv: LLM(
            model=args.model,
            dtype=args.dtype,
            kv_cache_memory=memory,
            kv_cache_dtype=kv,
            max_model_len=args.context + 1024,
            enable_prefix_caching=False,
        )
        for kv in KV_DTYPES
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--streams", default="1,64")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8, help="decode steps per burst")
    ap.add_argument("--rounds", type=int, default=5, help="bursts per side")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument(
        "--kv-memory",
        type=float,
        default=4.0,
        help="GiB of KV cache per engine (pages are taken as used; 64 x 2k tokens of "
        "SmolLM2 in bf16 need 3)",
    )
    add_output_arg(ap, "kv_cache")
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",") if s]
    result: dict[str, Any] = {"config": vars(args)}

    llms = load(args, memory=args.kv_memory)
    ids = llms["auto"].tokenizer.encode(wiki_text())
    result["capacity"] = {
        kv: {"kv_blocks": llm.engine.stats()["kv_total_blocks"], **_kv_info(llm)}
        for kv, llm in llms.items()
    }
    if not args.skip_accuracy:
        w = args.window
        windows = [ids[i * w : (i + 1) * w] for i in range(args.windows)]
        result["accuracy"] = accuracy(llms, windows)
        prompts = sharegpt_prompts(
            args.prompts, max_prompt_tokens=256, tokenizer_encode=llms["auto"].tokenizer.encode
        )
        result["accuracy"]["int8"] |= greedy_agreement(llms, prompts, args.gen_tokens)
        print(_accuracy_table(result["accuracy"]), flush=True)
    speed_ids = ids[args.windows * args.window :]  # text the accuracy runs did not see
    result["speed"] = {}
    for n in streams:
        print(f"decode, {n} streams x {args.context} tokens ...", flush=True)
        result["speed"][str(n)] = decode_speed(
            llms, speed_ids, n, args.context, args.steps, args.rounds
        )
        gc.collect()
    if streams:
        print(_speed_table(result))
    path = write_result("kv_cache", result, args.output)
    print(f"\nwrote {shown_path(path)}")


def _kv_info(llm: LLM) -> dict[str, Any]:
    st = llm.engine.stats()
    return {
        "kv_cache_dtype": st["kv_cache_dtype"],
        "kv_tokens": st["kv_total_blocks"] * st["block_size"],
    }


def _accuracy_table(acc: dict[str, dict[str, float]]) -> str:
    cols = sorted({c for r in acc.values() for c in r})
    rows = [[kv] + [f"{r[c]:.4g}" if c in r else "-" for c in cols] for kv, r in acc.items()]
    return format_table(["kv_cache_dtype", *cols], rows)


def _speed_table(result: dict[str, Any]) -> str:
    cap = result["capacity"]
    rows = [
        [
            f"{n} streams",
            *(f"{s['step_ms'][kv]:.1f}" for kv in KV_DTYPES),
            f"{s['speedup_int8']:.2f}x",
        ]
        for n, s in result["speed"].items()
    ]
    blocks = "  ".join(f"{kv}: {c['kv_tokens']} tokens" for kv, c in cap.items())
    return f"\ncapacity at equal memory: {blocks}\n" + format_table(
        ["decode step ms", *KV_DTYPES, "int8 speed-up"], rows
    )


if __name__ == "__main__":
    t = time.perf_counter()
    main()
    print(f"took {time.perf_counter() - t:.0f}s")
