"""Gemma 3's split KV cache (a local pool for the windowed layers) against one pool.

Memory: one sequence of --context prompt tokens (synthetic prose) prefilled,
then --decode greedy steps; the blocks it holds in each pool at the end, and their
bytes (each pool's block holds only its own layers' K/V). Speed: --tokens greedy
tokens of single-stream decode from a short prompt, both engines loaded, interleaved
A B A B over --rounds rounds; medians of ms per token. Writes
benchmarks/results/swa_pool.json (--output).

    nice -n 10 .venv/bin/python benchmarks/swa_pool.py [--context 4096] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_output_arg, add_rounds_arg, interleave, write_result
from sluice import LLM, SamplingParams
from sluice.config import GLOBAL_KV_GROUP, LOCAL_KV_GROUP
from sluice.runner.kv_layout import kv_bytes_per_block

SIDES = ("split", "single")


def prose(num_lines: int) -> str:
    """Varied synthetic prose (no download): numbered sentences about walks."""
    animals = ["fox", "heron", "badger", "otter", "lynx", "wren", "hare", "stoat"]
    places = ["river", "hill", "orchard", "harbour", "meadow", "forest", "village"]
    return " ".join(
        f"On day {i}, the {animals[i % 8]} walked from the {places[i % 7]} to the "
        f"{places[(3 * i + 1) % 7]} and counted {i * 7 % 23} stones along the way."
        for i in range(num_lines)
    )


def bytes_per_block(llm: LLM) -> dict[int, int]:
    """Bytes of one block of each cache group (a group's block holds its layers' K/V)."""
    eng = llm.engine
    mc, bs = eng.model_config, eng.config.block_size
    local = set(mc.split_kv_local_layers()) if eng.kv.local_pool is not None else set()
    layers = {
        GLOBAL_KV_GROUP: [i for i in range(mc.num_layers) if i not in local],
        LOCAL_KV_GROUP: sorted(local),
    }
    return {g: kv_bytes_per_block(mc, bs, eng.dtype, layers=ls) for g, ls in layers.items()}


def held_at_length(llm: LLM, ids: list[int], decode: int) -> dict[str, Any]:
    """Blocks and bytes one sequence holds after its prompt and `decode` steps."""
    eng = llm.engine
    per_block = bytes_per_block(llm)
    eng.add_request("mem", ids, SamplingParams(temperature=0, max_tokens=decode + 1))
    held: dict[str, Any] = {}
    while eng.has_unfinished_requests():
        eng.step()
        for req in eng.scheduler.running:  # the last state before it finishes
            blocks = {g: eng.kv.num_held_blocks(req, g) for g in range(len(eng.kv.groups))}
            held = {
                "tokens": req.num_computed_tokens,
                "global_blocks": blocks[GLOBAL_KV_GROUP],
                "local_blocks": blocks.get(LOCAL_KV_GROUP, 0),
                "bytes": sum(n * per_block[g] for g, n in blocks.items()),
            }
    return held


def decode_ms(llm: LLM, tokens: int) -> float:
    sp = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens)
    t0 = time.perf_counter()
    out = llm.generate(["The history of the river begins"], sp, use_tqdm=False)[0]
    elapsed = time.perf_counter() - t0
    return 1000 * elapsed / len(out.outputs[0].token_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    add_rounds_arg(ap)
    add_output_arg(ap, "swa_pool")
    args = ap.parse_args()
    llms = {side: LLM(model=args.model, split_kv_pool=side == "split") for side in SIDES}
    tok = llms["split"].engine.tokenizer
    ids = tok.encode(prose(args.context // 20))[: args.context]
    assert len(ids) == args.context, "make the prose longer"
    memory = {side: held_at_length(llm, ids, args.decode) for side, llm in llms.items()}
    for side in SIDES:
        print(f"{side}: {memory[side]}")
    decode_ms(llms["split"], 8)  # warm both
    decode_ms(llms["single"], 8)
    runs = interleave(SIDES, args.rounds, lambda side: decode_ms(llms[side], args.tokens))
    speed = {
        side: {"ms_per_token": ms, "median": statistics.median(ms)} for side, ms in runs.items()
    }
    for side in SIDES:
        print(f"{side}: median {speed[side]['median']:.2f} ms/token over {runs[side]}")
    path = write_result("swa_pool", {"memory": memory, "decode": speed}, args.output)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
