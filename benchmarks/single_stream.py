"""Single-stream decode: sluice (each weight format) and llama.cpp on the same GGUF, one run.

One ShareGPT first turn through the chat template, then 128 greedy tokens with EOS
suppressed. Decode tokens/s counts the tokens after the first (the first comes from the
prefill): median and min-max of --rounds interleaved rounds; every system is loaded
once and each round runs every system once, so drifts in the machine's speed hit all
of them alike. llama.cpp runs through `llama-cpp-python` when it is installed
(`make llamacpp`), with as many threads as sluice uses; its row is skipped otherwise.
Writes benchmarks/results/single_stream.json (--output).

Run from the repo root:
    .venv/bin/python benchmarks/single_stream.py
    .venv/bin/python benchmarks/single_stream.py --methods int4 --compile
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    add_output_arg,
    add_rounds_arg,
    compare,
    fmt_spread,
    format_table,
    interleave,
    shown_path,
    write_result,
)
from benchmarks.datasets import sharegpt_prompts  # noqa: E402
from sluice import LLM  # noqa: E402
from sluice.sampling_params import SamplingParams  # noqa: E402

TARGET_TOK_S = 120.0


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="sluice model (alias/path; default smollm2)")
    ap.add_argument("--methods", default="none,int8,int4", help="sluice quantization methods")
    ap.add_argument("--compile", action="store_true", help="also run each method compiled")
    ap.add_argument("--max-tokens", type=int, default=128)
    add_rounds_arg(ap)
    ap.add_argument(
        "--repeats", dest="rounds", type=int, default=argparse.SUPPRESS, help="old name of --rounds"
    )
    ap.add_argument("--seed", type=int, default=0, help="which ShareGPT prompt")
    ap.add_argument("--skip-llamacpp", action="store_true")
    add_output_arg(ap, "single_stream")
    return ap.parse_args()


class SluiceSystem:
    def __init__(self, llm: LLM, prompt: list[int], n: int) -> None:
        self.llm, self.prompt, self.n = llm, prompt, n
        self.sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        llm.generate([prompt], self.sp.clone(max_tokens=8), use_tqdm=False)  # warm-up

    def run(self) -> dict[str, Any]:
        self.llm.engine.reset_prefix_cache()
        (out,) = self.llm.generate([self.prompt], self.sp, use_tqdm=False)
        m = out.metrics
        assert m is not None and m.first_token_time is not None and m.finished_time is not None
        return {
            "decode_tokens_per_s": (self.n - 1) / (m.finished_time - m.first_token_time),
            "ttft_s": m.first_token_time - m.arrival_time,
            "token_ids": out.outputs[0].token_ids,
        }


class LlamaCppSystem:
    def __init__(self, gguf: Path, prompt: list[int], n: int, threads: int) -> None:
        from llama_cpp import Llama

        self.lm = Llama(
            model_path=str(gguf),
            n_ctx=2048,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
        self.prompt, self.n = prompt, n
        eos = self.lm.token_eos()

        def no_eos(_ids: Any, logits: Any) -> Any:
            logits[eos] = -float("inf")  # ignore_eos, as on the sluice side
            return logits

        self.processors = [no_eos]
        self.run(8)  # warm-up

    def run(self, count: int | None = None) -> dict[str, Any]:
        count = count or self.n
        self.lm.reset()
        t0 = time.perf_counter()
        times, ids = [], []
        gen = self.lm.generate(
            self.prompt, temp=0.0, top_k=1, reset=True, logits_processor=self.processors
        )
        for tok in gen:
            times.append(time.perf_counter())
            ids.append(int(tok))
            if len(ids) == count:
                break
        return {
            "decode_tokens_per_s": (count - 1) / (times[-1] - times[0]),
            "ttft_s": times[0] - t0,
            "token_ids": ids,
        }


def llamacpp_isa() -> str:
    """The x86 instruction-set level llama.cpp's CPU backend was built for (from its
    system info: which ggml library the loader found, see benchmarks/cpu_levels.py)."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    if "AVX512 = 1" in info:
        return "avx512"
    return "avx2" if "AVX2 = 1" in info else "generic"


def main() -> None:
    args = parse_args()
    threads = torch.get_num_threads()
    result: dict[str, Any] = {"config": vars(args), "threads": threads, "systems": {}}
    systems: dict[str, Any] = {}
    prompt: list[int] | None = None
    gguf: Path | None = None
    for method in args.methods.split(","):
        for compiled in (False, True) if args.compile else (False,):
            label = method + (" +compile" if compiled else "")
            print(f"loading sluice {label} ...", flush=True)
            llm = LLM(args.model, quantization=method, compile=compiled)
            threads = torch.get_num_threads()  # what the engine set
            if prompt is None:
                tok = llm.tokenizer
                (raw,) = sharegpt_prompts(
                    1,
                    seed=args.seed,
                    max_prompt_tokens=256,
                    tokenizer_encode=lambda s, tok=tok: tok.encode(s, add_special_tokens=False),
                )
                text = tok.apply_chat_template(
                    [{"role": "user", "content": raw}], add_generation_prompt=True
                )
                prompt = tok.encode(text, add_special_tokens=False)
                gguf = Path(llm.engine.model_path)
            systems[label] = SluiceSystem(llm, prompt, args.max_tokens)
            result["systems"][label] = {
                "kind": "sluice",
                "quantization": method,
                "compile": compiled,
                "dtype": str(llm.engine.dtype).removeprefix("torch."),
            }
    assert prompt is not None and gguf is not None
    result["prompt_tokens"] = len(prompt)
    result["threads"] = threads
    if not args.skip_llamacpp and gguf.suffix == ".gguf":
        try:
            systems["llama.cpp"] = LlamaCppSystem(gguf, prompt, args.max_tokens, threads)
            result["systems"]["llama.cpp"] = {
                "kind": "llama.cpp",
                "version": __import__("llama_cpp").__version__,
                "model": gguf.name,
                "threads": threads,
                "isa": llamacpp_isa(),
            }
        except ImportError:
            print("llama-cpp-python is not installed: no llama.cpp row", flush=True)
    runs = interleave(list(systems), args.rounds, lambda name: systems[name].run())
    result["comparison"] = compare(
        runs,
        ["decode_tokens_per_s", "ttft_s"],
        baseline="llama.cpp" if "llama.cpp" in systems else None,
    )
    # Greedy tokens of the last round: how long each system agrees with llama.cpp.
    result["token_ids"] = {name: rs[-1]["token_ids"] for name, rs in runs.items()}
    report(result)
    path = write_result("single_stream", result, args.output, threads=threads)
    print(f"\nwrote {shown_path(path)}")


def _agreement(a: list[int], b: list[int]) -> int:
    """Greedy tokens equal before the first difference."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def report(result: dict[str, Any]) -> None:
    cmp = result["comparison"]
    summary, ratios = cmp["summary"], cmp["ratio_of_medians"]
    rows = []
    for name, info in result["systems"].items():
        if info["kind"] == "sluice":
            label = f"sluice {name} ({info['dtype']})"
        else:
            label = f"llama.cpp {info['version']} ({info['model']})"
        vs = "1.00x" if name == cmp["baseline"] else "-"
        if name in ratios:
            vs = f"{ratios[name]['decode_tokens_per_s']:.2f}x"
        s = summary[name]
        rows.append(
            [label, fmt_spread(s["decode_tokens_per_s"]), fmt_spread(s["ttft_s"], 1e3, 0), vs]
        )
    n = result["config"]["max_tokens"]
    print(
        f"\n== Single-stream decode: {n} tokens, prompt {result['prompt_tokens']} tokens, "
        f"{result['threads']} threads; median (min-max) of {cmp['rounds']} interleaved rounds =="
    )
    print(format_table(["system", "decode tok/s", "TTFT ms", "vs llama.cpp"], rows))
    best = max(
        summary[name]["decode_tokens_per_s"]["median"]
        for name, info in result["systems"].items()
        if info["kind"] == "sluice"
    )
    verdict = "PASS" if best >= TARGET_TOK_S else "below target"
    print(f"\nbest sluice: {best:.1f} tok/s (target >= {TARGET_TOK_S:g}: {verdict})")
    ids = result["token_ids"]
    if "llama.cpp" in ids:
        for name in ids:
            if name != "llama.cpp":
                same = _agreement(ids[name], ids["llama.cpp"])
                print(
                    f"greedy tokens equal to llama.cpp's before the first difference, "
                    f"{name}: {same}/{n}"
                )


if __name__ == "__main__":
    main()
