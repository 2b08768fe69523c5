"""Prefix caching: TTFT and total time with the cache on and off, in the same run.

Two workloads, each run on an engine with `enable_prefix_caching=False` and then on one
with it True (identical prompts, identical submission order):

1. shared system prompt: ~1,500 tokens of Shakespeare as the system message, followed by
   64 distinct short ShareGPT questions. One request with another question goes first, as
   in a live server that has seen the system prompt before (it also warms the model up in
   both runs); then the 64 arrive as a closed loop of `--concurrency` clients: each client
   sends its next request when its previous one finishes. Target: TTFT p50 >= 5x lower
   with the cache on.
2. multi-turn chat replay: `--num-conversations` ShareGPT chats of `--turns` user turns;
   turn k re-sends the whole history (the dataset's real assistant replies, so both runs
   see identical prompts). The chats run concurrently, each sending its next turn when
   the previous one finishes, like users waiting for a reply.

TTFT is per request, from its arrival in the engine (add_request) to its first token.
Writes benchmarks/results/prefix_cache.json.

Run from the repo root:
    .venv/bin/python benchmarks/prefix_cache.py
    .venv/bin/python benchmarks/prefix_cache.py --num-questions 8 --num-conversations 2 --turns 4
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script (`python benchmarks/prefix_cache.py`), `benchmarks` is not importable otherwise.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import gc  # noqa: E402
import itertools  # noqa: E402
import time  # noqa: E402
from collections import deque  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.common import (  # noqa: E402
    REPO_ROOT,
    add_engine_args,
    engine_options,
    format_table,
    percentile,
    ratio,
    write_result,
)
from benchmarks.datasets import long_text, sharegpt_conversations, sharegpt_prompts  # noqa: E402
from sluice import LLM  # noqa: E402
from sluice.engine.engine import LLMEngine  # noqa: E402
from sluice.loader import Tokenizer  # noqa: E402
from sluice.outputs import RequestOutput  # noqa: E402
from sluice.sampling_params import SamplingParams  # noqa: E402

TARGET_TTFT_RATIO = 5.0
Message = dict[str, str]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="sluice model (alias/path; default smollm2)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--seed", type=int, default=0, help="ShareGPT shuffle seed")
    g = ap.add_argument_group("shared system prompt")
    g.add_argument("--num-questions", type=int, default=64)
    g.add_argument("--system-tokens", type=int, default=1500)
    g.add_argument("--max-question-tokens", type=int, default=128)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--concurrency", type=int, default=8, help="clients in flight (0 = all at once)")
    g = ap.add_argument_group("multi-turn chat replay")
    g.add_argument("--num-conversations", type=int, default=8)
    g.add_argument("--turns", type=int, default=8, help="user turns per conversation")
    g.add_argument("--chat-max-tokens", type=int, default=16)
    g.add_argument(
        "--max-history-tokens",
        type=int,
        default=4096,
        help="a chat stops at the first turn whose prompt is longer",
    )
    ap.add_argument("--skip-shared", action="store_true")
    ap.add_argument("--skip-chat", action="store_true")
    add_engine_args(ap)
    ap.add_argument("--name", default="prefix_cache", help="results/<name>.json")
    return ap.parse_args()


# ---- workloads (token ids, built once so both runs see exactly the same prompts) -----------


def render(tok: Tokenizer, messages: list[Message]) -> list[int]:
    # The template already writes the special tokens, so none are added on top.
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def system_prompt(tok: Tokenizer, num_tokens: int) -> str:
    """Shakespeare trimmed to ~num_tokens tokens (decode/re-encode may move it by one or two)."""
    text = long_text(num_tokens * 8)  # English prose is ~4 chars/token; 8 leaves a margin
    ids = tok.encode(text, add_special_tokens=False)
    if len(ids) < num_tokens:
        raise ValueError(f"{len(ids)} tokens of text, {num_tokens} wanted")
    return tok.decode(ids[:num_tokens])


def shared_prompt_workload(tok: Tokenizer, args: argparse.Namespace) -> dict[str, Any]:
    system = system_prompt(tok, args.system_tokens)
    questions = sharegpt_prompts(
        args.num_questions + 1,
        seed=args.seed,
        max_prompt_tokens=args.max_question_tokens,
        tokenizer_encode=lambda s: tok.encode(s, add_special_tokens=False),
    )
    prompts = [
        render(tok, [{"role": "system", "content": system}, {"role": "user", "content": q}])
        for q in questions
    ]
    return {
        "system_tokens": len(tok.encode(system, add_special_tokens=False)),
        "warmup": prompts[0],
        # One request per client stream: a client sends its next question when one finishes.
        "streams": [[p] for p in prompts[1:]],
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
    }


def chat_replay_workload(tok: Tokenizer, args: argparse.Namespace) -> dict[str, Any]:
    # 2*turns-1 messages make `turns` user turns (the last reply is never needed).
    convs = sharegpt_conversations(args.num_conversations, seed=args.seed, min_turns=2 * args.turns)
    streams: list[list[list[int]]] = []
    for conv in convs:
        turns: list[list[int]] = []
        for k in range(1, args.turns + 1):
            history = conv[: 2 * k - 1]  # user, assistant, ..., user k
            if len(history) < 2 * k - 1:
                break  # the chat is shorter than asked
            ids = render(tok, history)
            if len(ids) > args.max_history_tokens:
                break  # later turns are longer still
            turns.append(ids)
        if turns:
            streams.append(turns)
    return {
        "warmup": None,
        "streams": streams,
        "concurrency": len(streams),  # every user chats at the same time
        "max_tokens": args.chat_max_tokens,
    }


# ---- driving the engine ---------------------------------------------------------------------


def run_streams(
    engine: LLMEngine, streams: list[list[list[int]]], concurrency: int, params: SamplingParams
) -> tuple[list[RequestOutput], float]:
    """Closed loop over the engine's add_request/step API, as a server would drive it.

    At most `concurrency` streams are active; each has one request in flight and sends its
    next one the moment the previous finishes (a new stream starts when one runs dry).
    Returns the finished outputs (completion order) and the wall time.
    """
    pending = deque(deque(s) for s in streams if s)
    limit = concurrency if concurrency > 0 else len(pending)
    ids = itertools.count()
    in_flight: dict[str, deque[list[int]]] = {}
    done: list[RequestOutput] = []

    def submit(stream: deque[list[int]]) -> None:
        rid = f"bench-{next(ids)}"
        engine.add_request(rid, stream.popleft(), params)  # arrival_time = now
        in_flight[rid] = stream

    t0 = time.perf_counter()
    while pending and len(in_flight) < limit:
        submit(pending.popleft())
    while in_flight:
        for out in engine.step():
            if not out.finished or out.request_id not in in_flight:
                continue
            done.append(out)
            stream = in_flight.pop(out.request_id)
            if stream:
                submit(stream)
            elif pending:
                submit(pending.popleft())
    return done, time.perf_counter() - t0


def _ttft(out: RequestOutput) -> float:
    m = out.metrics
    assert m is not None and m.first_token_time is not None
    return m.first_token_time - m.arrival_time


def measure(llm: LLM, workload: dict[str, Any]) -> dict[str, Any]:
    engine = llm.engine
    params = SamplingParams(max_tokens=workload["max_tokens"], temperature=0.0, ignore_eos=True)
    engine.reset_prefix_cache()  # nothing from an earlier workload may help this one
    if workload["warmup"] is not None:
        run_streams(engine, [[workload["warmup"]]], 1, params)
    before = engine.stats()
    outs, seconds = run_streams(engine, workload["streams"], workload["concurrency"], params)
    after = engine.stats()
    ttfts = [_ttft(o) for o in outs]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    queried = after["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"]
    hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    return {
        "num_requests": len(outs),
        "prompt_tokens": prompt_tokens,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "total_s": seconds,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "ttft_mean_s": sum(ttfts) / len(ttfts),
        # The engine's own counter over the measured requests (the warm-up excluded) ...
        "hit_rate": ratio(hits, queried) if queried else 0.0,
        # ... and the same from the outputs: the share of prompt tokens not recomputed.
        "cached_token_fraction": ratio(cached, prompt_tokens),
        "num_preemptions_total": after["num_preemptions"],
    }


def main() -> None:
    args = parse_args()
    opts = engine_options(args)
    result: dict[str, Any] = {"config": vars(args), "engine_options": opts}
    workloads: dict[str, dict[str, Any]] = {}
    runs: dict[str, dict[str, dict[str, Any]]] = {}

    # Cache off first, then on: the same order every time, so any drift is comparable.
    for caching in (False, True):
        mode = "on" if caching else "off"
        print(f"loading sluice (prefix caching {mode}) ...", flush=True)
        llm = LLM(args.model, enable_prefix_caching=caching, **opts)
        if not workloads:
            tok = llm.tokenizer
            if not args.skip_shared:
                workloads["shared_prompt"] = shared_prompt_workload(tok, args)
            if not args.skip_chat:
                workloads["chat_replay"] = chat_replay_workload(tok, args)
            if "shared_prompt" not in workloads:
                # No warm-up request would run: warm the model up with the first chat turn.
                first = workloads["chat_replay"]["streams"][0][0]
                llm.generate([first], SamplingParams(max_tokens=4), use_tqdm=False)
        for name, workload in workloads.items():
            n = sum(len(s) for s in workload["streams"])
            print(f"  {name}: {n} requests, cache {mode} ...", flush=True)
            runs.setdefault(name, {})[mode] = measure(llm, workload)
        result["dtype"] = llm.engine.stats().get("dtype")
        del llm
        gc.collect()  # one engine's KV pool at a time

    result["workloads"] = {
        name: {
            "num_requests": sum(len(s) for s in w["streams"]),
            "num_streams": len(w["streams"]),
            "concurrency": w["concurrency"],
            "max_tokens": w["max_tokens"],
            **({"system_tokens": w["system_tokens"]} if "system_tokens" in w else {}),
            "off": runs[name]["off"],
            "on": runs[name]["on"],
            "ttft_p50_ratio": ratio(
                runs[name]["off"]["ttft_p50_s"], runs[name]["on"]["ttft_p50_s"]
            ),
            "ttft_p99_ratio": ratio(
                runs[name]["off"]["ttft_p99_s"], runs[name]["on"]["ttft_p99_s"]
            ),
            "total_ratio": ratio(runs[name]["off"]["total_s"], runs[name]["on"]["total_s"]),
        }
        for name, w in workloads.items()
    }
    report(result)
    path = write_result(args.name, result)
    print(f"\nwrote {path.relative_to(REPO_ROOT)}")


def report(result: dict[str, Any]) -> None:
    for name, w in result["workloads"].items():
        off, on = w["off"], w["on"]
        extra = f", system prompt {w['system_tokens']} tokens" if "system_tokens" in w else ""
        print(
            f"\n== {name}: {w['num_requests']} requests in {w['num_streams']} streams, "
            f"concurrency {w['concurrency']}, max_tokens {w['max_tokens']}{extra} "
            f"({result['dtype']}) =="
        )
        rows = [
            ["TTFT p50 (ms)", off["ttft_p50_s"] * 1e3, on["ttft_p50_s"] * 1e3, w["ttft_p50_ratio"]],
            ["TTFT p99 (ms)", off["ttft_p99_s"] * 1e3, on["ttft_p99_s"] * 1e3, w["ttft_p99_ratio"]],
            ["total time (s)", off["total_s"], on["total_s"], w["total_ratio"]],
            ["prompt tokens", off["prompt_tokens"], on["prompt_tokens"], ""],
            ["hit rate", f"{off['hit_rate']:.1%}", f"{on['hit_rate']:.1%}", ""],
            [
                "cached prompt tokens",
                f"{off['cached_token_fraction']:.1%}",
                f"{on['cached_token_fraction']:.1%}",
                "",
            ],
        ]
        print(format_table(["metric", "cache off", "cache on", "off/on"], rows))
        if name == "shared_prompt":
            r = w["ttft_p50_ratio"]
            verdict = "PASS" if r >= TARGET_TTFT_RATIO else "below target"
            print(f"TTFT p50 speed-up {r:.2f}x (target >= {TARGET_TTFT_RATIO:g}x: {verdict})")


if __name__ == "__main__":
    main()
