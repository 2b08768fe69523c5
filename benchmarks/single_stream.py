"""Single-stream decode: sluice (each weight format) and llama.cpp on the same GGUF, one run.

One ShareGPT first turn through the chat template, then 128 greedy tokens with EOS
suppressed. Decode tokens/s counts the tokens after the first (the first comes from the
prefill), the median of --repeats rounds; each round runs every system once, so drifts
in the machine's speed hit all of them alike. llama.cpp runs through `llama-cpp-python` when it
is installed (build it with the CMAKE_ARGS in docs/benchmarks.md), with as many threads
as sluice uses; its row is skipped otherwise. Writes benchmarks/results/single_stream.json.

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
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from benchmarks.common import REPO_ROOT, format_table, ratio, write_result  # noqa: E402
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
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="which ShareGPT prompt")
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--name", default="single_stream", help="results file stem")
    return ap.parse_args()


class SluiceSystem:
    def __init__(self, llm: LLM, prompt: list[int], n: int) -> None:
        self.llm, self.prompt, self.n = llm, prompt, n
        self.sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        llm.generate([prompt], self.sp.clone(max_tokens=8), use_tqdm=False)  # warm-up

    def run(self) -> tuple[float, float, list[int]]:
        self.llm.engine.reset_prefix_cache()
        (out,) = self.llm.generate([self.prompt], self.sp, use_tqdm=False)
        m = out.metrics
        assert m is not None and m.first_token_time is not None and m.finished_time is not None
        rate = (self.n - 1) / (m.finished_time - m.first_token_time)
        return rate, m.first_token_time - m.arrival_time, out.outputs[0].token_ids


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

    def run(self, count: int | None = None) -> tuple[float, float, list[int]]:
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
        return (count - 1) / (times[-1] - times[0]), times[0] - t0, ids


def main() -> None:
    args = parse_args()
    threads = torch.get_num_threads()
    result: dict[str, Any] = {"config": vars(args), "threads": threads, "sluice": {}}
    systems: dict[str, Any] = {}
    dtypes: dict[str, str] = {}
    prompt: list[int] | None = None
    gguf: Path | None = None
    for method in args.methods.split(","):
        for compiled in (False, True) if args.compile else (False,):
            label = method + (" +compile" if compiled else "")
            print(f"loading sluice {label} ...", flush=True)
            llm = LLM(args.model, quantization=method, compile=compiled)
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
            dtypes[label] = str(llm.engine.dtype).removeprefix("torch.")
    assert prompt is not None and gguf is not None
    result["prompt_tokens"] = len(prompt)
    if not args.skip_llamacpp and gguf.suffix == ".gguf":
        try:
            systems["llama.cpp"] = LlamaCppSystem(gguf, prompt, args.max_tokens, threads)
        except ImportError:
            print("llama-cpp-python is not installed: no llama.cpp row", flush=True)
    # Interleaved: round k runs every system once before round k + 1 starts, so drifts
    # in the machine's speed (shared cores) land on all systems alike.
    runs: dict[str, list[tuple[float, float, list[int]]]] = {name: [] for name in systems}
    for k in range(args.repeats):
        print(f"round {k + 1}/{args.repeats} ...", flush=True)
        for name, system in systems.items():
            runs[name].append(system.run())
    for name, rs in runs.items():
        entry = {
            "decode_tokens_per_s": statistics.median(r[0] for r in rs),
            "ttft_s": statistics.median(r[1] for r in rs),
            "runs": [r[0] for r in rs],
            "token_ids": rs[-1][2],
        }
        if name == "llama.cpp":
            entry |= {"threads": threads, "version": __import__("llama_cpp").__version__}
            result["llamacpp"] = entry
        else:
            result["sluice"][name] = entry | {"dtype": dtypes[name]}
    report(result)
    path = write_result(args.name, result)
    print(f"\nwrote {path.relative_to(REPO_ROOT)}")


def _agreement(a: list[int], b: list[int]) -> int:
    """Greedy tokens equal before the first difference."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def report(result: dict[str, Any]) -> None:
    lc = result.get("llamacpp")
    rows = []
    for label, r in result["sluice"].items():
        vs = f"{ratio(r['decode_tokens_per_s'], lc['decode_tokens_per_s']):.2f}x" if lc else "-"
        rows.append(
            [f"sluice {label} ({r['dtype']})", r["decode_tokens_per_s"], r["ttft_s"] * 1e3, vs]
        )
    if lc:
        rows.append(
            [
                f"llama.cpp {lc['version']} (Q4_1 GGUF)",
                lc["decode_tokens_per_s"],
                lc["ttft_s"] * 1e3,
                "1.00x",
            ]
        )
    n = result["config"]["max_tokens"]
    print(
        f"\n== Single-stream decode: {n} tokens, prompt {result['prompt_tokens']} tokens, "
        f"{result['threads']} threads =="
    )
    print(format_table(["system", "decode tok/s", "TTFT ms", "vs llama.cpp"], rows))
    best = max(r["decode_tokens_per_s"] for r in result["sluice"].values())
    verdict = "PASS" if best >= TARGET_TOK_S else "below target"
    print(f"\nbest sluice: {best:.1f} tok/s (target >= {TARGET_TOK_S:g}: {verdict})")
    if lc:
        for label, r in result["sluice"].items():
            same = _agreement(r["token_ids"], lc["token_ids"])
            print(
                f"greedy tokens equal to llama.cpp's before the first difference, "
                f"{label}: {same}/{n}"
            )


if __name__ == "__main__":
    main()
