"""Prefix caching: TTFT and total time with the cache on and off, interleaved in one run.

Two engines are loaded once, one with `enable_prefix_caching=False` and one with True.
Each workload runs --rounds interleaved rounds (off, on; on, off; ...), identical prompts
in identical submission order; the report gives each mode's median and min-max and
the ratio of the medians (off / on: the speed-up). The workloads:

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
Writes benchmarks/results/prefix_cache.json (--output).

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
import itertools  # noqa: E402
import time  # noqa: E402
from collections import deque  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.common import (  # noqa: E402
    add_engine_args,
    add_output_arg,
    add_rounds_arg,
    compare,
    engine_options,
    fmt_spread,
    format_table,
    interleave,
    percentile,
    ratio,
    shown_path,
    write_result,
)
from benchmarks.datasets import long_text, sharegpt_conversations, sharegpt_prompts  # noqa: E402
from sluice import LLM  # noqa: E402
from sluice.engine.engine import LLMEngine  # noqa: E402
from sluice.loader import Tokenizer  # noqa: E402
from sluice.outputs import RequestOutput  # noqa: E402
from sluice.sampling_params import SamplingParams  # noqa: E402

TARGET_TTFT_RATIO = 5.0
# Summarized per mode over rounds; the ratio of medians is off / on.
METRICS = (
    "ttft_p50_s",
    "ttft_p99_s",
    "ttft_mean_s",
    "total_s",
    "hit_rate",
    "cached_token_fraction",
    "num_preemptions",
)
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
    add_rounds_arg(ap)
    add_engine_args(ap)
    add_output_arg(ap, "prefix_cache")
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
        "num_preemptions": after["num_preemptions"] - before["num_preemptions"],
    }


def main() -> None:
    args = parse_args()
    opts = engine_options(args)
    result: dict[str, Any] = {"config": vars(args), "engine_options": opts}
    # Both engines stay loaded (one KV pool each), so rounds can alternate between them.
    llms: dict[str, LLM] = {}
    for mode in ("off", "on"):
        print(f"loading sluice (prefix caching {mode}) ...", flush=True)
        llms[mode] = LLM(args.model, enable_prefix_caching=mode == "on", **opts)
    tok = llms["off"].tokenizer
    workloads: dict[str, dict[str, Any]] = {}
    if not args.skip_shared:
        workloads["shared_prompt"] = shared_prompt_workload(tok, args)
    if not args.skip_chat:
        workloads["chat_replay"] = chat_replay_workload(tok, args)
    for llm in llms.values():  # warm-up: first calls pay for allocation
        first = workloads[next(iter(workloads))]["streams"][0][0]
        llm.generate([first], SamplingParams(max_tokens=4), use_tqdm=False)

    result["dtype"] = llms["off"].engine.stats().get("dtype")
    result["workloads"] = {}
    for name, workload in workloads.items():
        n = sum(len(s) for s in workload["streams"])
        runs = interleave(
            ["off", "on"],
            args.rounds,
            lambda mode, workload=workload: measure(llms[mode], workload),
            label=f"{name} ({n} requests)",
        )
        result["workloads"][name] = {
            "num_requests": n,
            "num_streams": len(workload["streams"]),
            "concurrency": workload["concurrency"],
            "max_tokens": workload["max_tokens"],
            "prompt_tokens": runs["off"][0]["prompt_tokens"],
            **({"system_tokens": workload["system_tokens"]} if "system_tokens" in workload else {}),
            "comparison": compare(runs, METRICS, baseline="on"),
        }
    report(result)
    path = write_result("prefix_cache", result, args.output)
    print(f"\nwrote {shown_path(path)}")


def report(result: dict[str, Any]) -> None:
    for name, w in result["workloads"].items():
        cmp = w["comparison"]
        off, on = cmp["summary"]["off"], cmp["summary"]["on"]
        speedup = cmp["ratio_of_medians"]["off"]
        extra = f", system prompt {w['system_tokens']} tokens" if "system_tokens" in w else ""
        print(
            f"\n== {name}: {w['num_requests']} requests in {w['num_streams']} streams, "
            f"concurrency {w['concurrency']}, max_tokens {w['max_tokens']}{extra} "
            f"({result['dtype']}); median (min-max) of {cmp['rounds']} interleaved rounds =="
        )
        rows = [
            [
                "TTFT p50 (ms)",
                fmt_spread(off["ttft_p50_s"], 1e3, 0),
                fmt_spread(on["ttft_p50_s"], 1e3, 0),
                f"{speedup['ttft_p50_s']:.2f}",
            ],
            [
                "TTFT p99 (ms)",
                fmt_spread(off["ttft_p99_s"], 1e3, 0),
                fmt_spread(on["ttft_p99_s"], 1e3, 0),
                f"{speedup['ttft_p99_s']:.2f}",
            ],
            [
                "total time (s)",
                fmt_spread(off["total_s"]),
                fmt_spread(on["total_s"]),
                f"{speedup['total_s']:.2f}",
            ],
            [
                "hit rate (%)",
                fmt_spread(off["hit_rate"], 100.0),
                fmt_spread(on["hit_rate"], 100.0),
                "",
            ],
            [
                "cached prompt tokens (%)",
                fmt_spread(off["cached_token_fraction"], 100.0),
                fmt_spread(on["cached_token_fraction"], 100.0),
                "",
            ],
        ]
        print(format_table(["metric", "cache off", "cache on", "off/on"], rows))
        if name == "shared_prompt":
            r = speedup["ttft_p50_s"]
            verdict = "PASS" if r >= TARGET_TTFT_RATIO else "below target"
            print(f"TTFT p50 speed-up {r:.2f}x (target >= {TARGET_TTFT_RATIO:g}x: {verdict})")


if __name__ == "__main__":
    main()
