"""The disk tier under the prefix cache (--kv-offload-dir): TTFT of a prompt loaded from
disk against recomputing it, and the hit rate of a multi-turn chat replay whose RAM pool
is too small for all its conversations.

Two engines stay loaded with the same small KV pool (--kv-blocks): "ram" without the
disk tier and "disk" with one (a fresh temporary directory, or --offload-dir).

1. repeat TTFT: a ~--prompt-tokens chat prompt (Shakespeare as the system message, one
   question). The disk engine runs it once and writes its blocks; then each of --rounds
   interleaved rounds empties both engines' RAM prefix cache and sends it again: the
   ram engine recomputes it, the disk engine loads every block but the last. Target:
   disk / recompute TTFT <= 0.5.
2. chat replay: --num-conversations ShareGPT chats of --turns user turns, each turn
   re-sending the whole history (the dataset's replies), all chats concurrently; the
   pool holds fewer blocks than the chats' histories together, so RAM evicts what a
   later turn needs. Each round gives the disk engine a fresh, empty directory. The
   share of prompt tokens not recomputed (RAM hits plus disk loads) is the hit rate.

Writes benchmarks/results/kv_offload.json (--output).

Run from the repo root:
    .venv/bin/python benchmarks/kv_offload.py
    .venv/bin/python benchmarks/kv_offload.py --prompt-tokens 300 --num-conversations 2 \\
        --turns 2 --rounds 1      # a smoke run
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script (`python benchmarks/kv_offload.py`), `benchmarks` is not importable otherwise.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import tempfile  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.common import (  # noqa: E402
    add_output_arg,
    add_rounds_arg,
    compare,
    fmt_spread,
    format_table,
    interleave,
    percentile,
    ratio,
    shown_path,
    write_result,
)
from benchmarks.prefix_cache import (  # noqa: E402
    chat_replay_workload,
    render,
    run_streams,
    system_prompt,
)
from sluice import LLM  # noqa: E402
from sluice.engine.kv_connector import disk_tier  # noqa: E402
from sluice.sampling_params import SamplingParams  # noqa: E402

TARGET_TTFT_RATIO = 0.5
TTFT_METRICS = ("ttft_s", "cached_tokens")
REPLAY_METRICS = ("cached_token_fraction", "ram_hit_rate", "disk_tokens", "ttft_p50_s", "total_s")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="sluice model (alias/path; default smollm2)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--seed", type=int, default=0, help="ShareGPT shuffle seed")
    ap.add_argument("--kv-blocks", type=int, default=256, help="RAM pool of both engines")
    ap.add_argument("--offload-dir", type=Path, default=None, help="default: a temporary one")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    g = ap.add_argument_group("chat replay")
    g.add_argument("--num-conversations", type=int, default=16)
    g.add_argument("--turns", type=int, default=6, help="user turns per conversation")
    g.add_argument("--chat-max-tokens", type=int, default=16)
    g.add_argument("--max-history-tokens", type=int, default=2048)
    add_rounds_arg(ap)
    add_output_arg(ap, "kv_offload")
    return ap.parse_args()


def load(args: argparse.Namespace, directory: Path | None) -> LLM:
    """An engine whose pool holds --kv-blocks blocks (sized from a block's bytes)."""
    probe = LLM(args.model, dtype=args.dtype, kv_cache_memory=0.01)
    per_block = probe.engine.kv_block_format().nbytes
    del probe
    memory = args.kv_blocks * per_block / 2**30
    offload = {"kv_offload_dir": str(directory)} if directory else {}
    return LLM(args.model, dtype=args.dtype, kv_cache_memory=memory, **offload)


def repeat_ttft(llm: LLM, prompt: list[int]) -> dict[str, float]:
    llm.engine.reset_prefix_cache()  # out of RAM: recompute, or load from disk
    out = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    llm.engine.wait_for_kv_saves()
    m = out.metrics
    assert m is not None and m.first_token_time is not None
    return {"ttft_s": m.first_token_time - m.arrival_time, "cached_tokens": out.num_cached_tokens}


def replay(llm: LLM, workload: dict[str, Any], directory: Path | None) -> dict[str, float]:
    engine = llm.engine
    engine.reset_prefix_cache()
    if directory is not None:  # a fresh, empty tier for every round
        directory.mkdir(parents=True)
        engine.attach_kv_connector(
            disk_tier(directory, 2**34, engine.kv_block_format(), engine.runner)
        )
    params = SamplingParams(max_tokens=workload["max_tokens"], temperature=0.0, ignore_eos=True)
    before = engine.stats()
    outs, seconds = run_streams(engine, workload["streams"], workload["concurrency"], params)
    after = engine.stats()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    queried = after["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"]
    hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs if o.metrics]  # type: ignore[operator]
    return {
        "cached_token_fraction": ratio(sum(o.num_cached_tokens for o in outs), prompt_tokens),
        "ram_hit_rate": ratio(hits, queried) if queried else 0.0,
        "disk_tokens": after.get("kv_offload_loaded_tokens", 0)
        - before.get("kv_offload_loaded_tokens", 0),
        "ttft_p50_s": percentile(ttfts, 50),
        "total_s": seconds,
    }


def main() -> None:
    args = parse_args()
    root = args.offload_dir or Path(tempfile.mkdtemp(prefix="sluice-kv-offload-"))
    print(f"disk tier under {root}", flush=True)
    llms = {"ram": load(args, None), "disk": load(args, root / "repeat")}
    tok = llms["ram"].tokenizer
    system = system_prompt(tok, args.prompt_tokens)
    prompt = render(
        tok, [{"role": "system", "content": system}, {"role": "user", "content": "Summarize."}]
    )
    repeat_ttft(llms["disk"], prompt)  # writes the prompt's blocks; warms both up
    repeat_ttft(llms["ram"], prompt)
    runs = interleave(
        ["ram", "disk"], args.rounds, lambda s: repeat_ttft(llms[s], prompt), "repeat"
    )
    result: dict[str, Any] = {"config": vars(args), "dtype": llms["ram"].stats()["dtype"]}
    result["repeat"] = {"prompt_tokens": len(prompt), **compare(runs, TTFT_METRICS, baseline="ram")}

    workload = chat_replay_workload(tok, args)
    counter = iter(range(10**6))
    runs = interleave(
        ["ram", "disk"],
        args.rounds,
        lambda s: replay(
            llms[s], workload, root / f"replay-{next(counter)}" if s == "disk" else None
        ),
        "chat replay",
    )
    result["replay"] = {
        "num_requests": sum(len(s) for s in workload["streams"]),
        "prompt_tokens": sum(len(t) for s in workload["streams"] for t in s),
        **compare(runs, REPLAY_METRICS, baseline="ram"),
    }
    for llm in llms.values():
        llm.engine.close()
    report(result, args)
    print(f"\nwrote {shown_path(write_result('kv_offload', result, args.output))}")


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    rep = result["repeat"]
    ram, disk = rep["summary"]["ram"], rep["summary"]["disk"]
    r = rep["ratio_of_medians"]["disk"]["ttft_s"]
    print(
        f"\n== repeat of a {rep['prompt_tokens']}-token prompt out of RAM ({result['dtype']}), "
        f"median (min-max) of {rep['rounds']} interleaved rounds =="
    )
    print(
        format_table(
            ["", "recompute", "from disk", "disk/recompute"],
            [
                [
                    "TTFT (ms)",
                    fmt_spread(ram["ttft_s"], 1e3, 0),
                    fmt_spread(disk["ttft_s"], 1e3, 0),
                    f"{r:.2f}",
                ],
                [
                    "cached tokens",
                    fmt_spread(ram["cached_tokens"], 1, 0),
                    fmt_spread(disk["cached_tokens"], 1, 0),
                    "",
                ],
            ],
        )
    )
    verdict = "PASS" if r <= TARGET_TTFT_RATIO else "above target"
    print(f"TTFT disk/recompute {r:.2f} (target <= {TARGET_TTFT_RATIO}: {verdict})")
    rp = result["replay"]
    ram, disk = rp["summary"]["ram"], rp["summary"]["disk"]
    print(
        f"\n== chat replay: {rp['num_requests']} requests, {rp['prompt_tokens']} prompt tokens, "
        f"{args.kv_blocks} RAM blocks of {args.kv_blocks * 16} tokens =="
    )
    rows = [
        [
            "prompt tokens not recomputed (%)",
            fmt_spread(ram["cached_token_fraction"], 100.0),
            fmt_spread(disk["cached_token_fraction"], 100.0),
        ],
        [
            "RAM prefix-cache hit rate (%)",
            fmt_spread(ram["ram_hit_rate"], 100.0),
            fmt_spread(disk["ram_hit_rate"], 100.0),
        ],
        [
            "tokens loaded from disk",
            fmt_spread(ram["disk_tokens"], 1, 0),
            fmt_spread(disk["disk_tokens"], 1, 0),
        ],
        [
            "TTFT p50 (ms)",
            fmt_spread(ram["ttft_p50_s"], 1e3, 0),
            fmt_spread(disk["ttft_p50_s"], 1e3, 0),
        ],
        ["total (s)", fmt_spread(ram["total_s"]), fmt_spread(disk["total_s"])],
    ]
    print(format_table(["", "RAM only", "RAM + disk"], rows))


if __name__ == "__main__":
    main()
