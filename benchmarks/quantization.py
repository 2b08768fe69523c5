"""Accuracy of weight-only quantization (none / int8 / int4).

For each method: perplexity on packaged Wikipedia text (teacher-forced, windows of
--window tokens), top-1 agreement with the fp32 model at every position of that text,
and greedy agreement on chat prompts with the unquantized model (`none`, same dtype;
the reference itself gets no agreement figure). These are deterministic, so one run
says it all; speed per method is single_stream.py's job (`--methods none,int8,int4`),
where the methods run interleaved. Writes benchmarks/results/quantization.json (--output).

    .venv/bin/python benchmarks/quantization.py [--windows 16] [--window 512]
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_output_arg, format_table, shown_path, write_result
from benchmarks.datasets import sharegpt_prompts, wiki_text
from sluice import LLM, SamplingParams
from sluice.layers.quantization import quantized_kernels_only


def teacher_forced(llm: LLM, windows: list[list[int]]) -> tuple[float, list[int]]:
    """Perplexity over all windows, and the model's top-1 token at every position."""
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    nll, count, top1 = 0.0, 0, []
    for out in llm.generate(windows, sp, use_tqdm=False):
        assert out.prompt_logprobs is not None
        for tok, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
            assert entry is not None
            nll -= entry[tok].logprob
            count += 1
            top1.append(next(t for t, lp in entry.items() if lp.rank == 1))
    return math.exp(nll / count), top1


def greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=n, min_tokens=n)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--gen-tokens", type=int, default=64)
    add_output_arg(ap, "quantization")
    args = ap.parse_args()

    results: dict[str, dict[str, float]] = {}
    windows: list[list[int]] = []
    chats: list[list[int]] = []
    ref_top1: list[int] = []
    greedy_ref: list[list[int]] = []
    for name, dtype, quant in [
        ("fp32 reference", "float32", "none"),
        ("none", args.dtype, "none"),
        ("int8", args.dtype, "int8"),
        ("int4", args.dtype, "int4"),
    ]:
        print(f"{name} ...", flush=True)
        llm = LLM(model=args.model, dtype=dtype, quantization=quant, kv_cache_memory=1.0)
        if not windows:
            ids = llm.tokenizer.encode(wiki_text())
            w = args.window
            windows = [ids[i * w : (i + 1) * w] for i in range(args.windows)]
            chats = [
                llm.tokenizer.encode(
                    llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                    add_special_tokens=False,
                )
                for p in sharegpt_prompts(
                    args.prompts, max_prompt_tokens=256, tokenizer_encode=llm.tokenizer.encode
                )
            ]
        # Prefills of 32+ rows would take the dense weight: force the quantized kernels.
        with quantized_kernels_only(llm.engine.runner.model):
            ppl, top1 = teacher_forced(llm, windows)
        row: dict[str, float] = {"perplexity": ppl}
        if name == "fp32 reference":
            ref_top1 = top1
        else:
            row["top1_agreement_vs_fp32"] = sum(
                a == b for a, b in zip(top1, ref_top1, strict=True)
            ) / len(ref_top1)
            # 16 prompts decode 16 rows at a time, which would take the dense weight too.
            with quantized_kernels_only(llm.engine.runner.model):
                gen = greedy(llm, chats, args.gen_tokens)
            if name == "none":
                greedy_ref = gen  # the reference: agreement with itself says nothing
            else:
                tok_agree = [
                    next((i for i, (a, b) in enumerate(zip(g, r, strict=True)) if a != b), len(r))
                    for g, r in zip(gen, greedy_ref, strict=True)
                ]
                row["greedy_identical_vs_none"] = sum(
                    t == args.gen_tokens for t in tok_agree
                ) / len(tok_agree)
                row["greedy_mean_common_prefix"] = sum(tok_agree) / len(tok_agree)
        results[name] = row
        del llm
        gc.collect()

    cols = [
        "perplexity",
        "top1_agreement_vs_fp32",
        "greedy_identical_vs_none",
        "greedy_mean_common_prefix",
    ]
    rows = [
        [name] + [f"{r[c]:.4g}" if c in r else "-" for c in cols] for name, r in results.items()
    ]
    print(
        f"\n== weight-only quantization: {args.windows} x {args.window} Wikipedia tokens, "
        f"{args.prompts} chat prompts x {args.gen_tokens} greedy tokens =="
    )
    print(format_table(["method", *cols], rows))
    path = write_result("quantization", {"config": vars(args), "results": results}, args.output)
    print(f"\nwrote {shown_path(path)}")


if __name__ == "__main__":
    t = time.perf_counter()
    main()
    print(f"took {time.perf_counter() - t:.0f}s")
