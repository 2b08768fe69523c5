"""How the data-parallel router spreads a multi-turn chat workload over 8 replicas: the
prefix-cache hit rate with cache-aware routing against least-loaded and round robin.

    python benchmarks/router_sim.py                   # 8 replicas, 256 ShareGPT chats
    python benchmarks/router_sim.py --replicas 4 --capacity-blocks 512

A simulation, deterministic and cheap (no model runs): sluice's own Router decides,
and each replica's prefix cache is modelled as its KV pool is, an LRU of named full
blocks (the same hash chain) of --capacity-blocks. Chats are ShareGPT conversations
tokenized by the bundled model's tokenizer; turn t's prompt is every message before
the t-th user message's answer (messages concatenated: a chat template adds the same
few tokens per message, which changes nothing here). Turns of different chats
interleave at random (seeded), a chat's next turn comes only after its previous
answer, and --in-flight requests run at once (a request ends that many arrivals
later), which is what the router's loads count. A replica caches a request's prompt and
its answer (decoded blocks are named too), so a chat's next turn hits there.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import format_table, write_result
from benchmarks.datasets import sharegpt_conversations
from sluice.distributed.router import Router
from sluice.engine.prefix_cache import extend_block_hashes
from sluice.loader import load_tokenizer

BLOCK = 16


def chats(n: int, max_turns: int, seed: int) -> list[list[tuple[list[int], list[int]]]]:
    """Per chat, its turns as (prompt ids, answer ids)."""
    _, tok = load_tokenizer(None)
    out = []
    for conv in sharegpt_conversations(n, seed=seed):
        ids = [tok.encode(m["content"][:4000], add_special_tokens=False) for m in conv]
        turns, context = [], []
        for t in range(0, len(ids) - 1, 2):
            prompt = context + ids[t]
            turns.append((prompt, ids[t + 1]))
            context = prompt + ids[t + 1]
            if len(turns) == max_turns:
                break
        out.append(turns)
    return out


def arrivals(work: list[list[Any]], seed: int) -> list[tuple[int, int]]:
    """(chat, turn) in arrival order: a random chat with turns left goes next."""
    rng = random.Random(seed)
    nxt = [0] * len(work)
    active = [c for c in range(len(work)) if work[c]]
    order = []
    while active:
        c = rng.choice(active)
        order.append((c, nxt[c]))
        nxt[c] += 1
        if nxt[c] == len(work[c]):
            active.remove(c)
    return order


def simulate(
    work: list[list[tuple[list[int], list[int]]]],
    order: list[tuple[int, int]],
    policy: str,
    replicas: int,
    capacity: int,
    in_flight: int,
) -> dict[str, Any]:
    router = Router(replicas, BLOCK, capacity_blocks=capacity, cache_aware=policy == "cache-aware")
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(replicas)]
    loads = [0] * replicas
    running: deque[int] = deque()
    hit = total = 0
    routed = [0] * replicas
    for k, (c, t) in enumerate(order):
        if len(running) == in_flight:
            loads[running.popleft()] -= 1
        prompt, answer = work[c][t]
        if policy == "round-robin":
            r = k % replicas
        else:
            r = router.choose(prompt, loads, [True] * replicas)
        hashes = extend_block_hashes([], prompt, len(prompt), BLOCK)
        n = 0
        while n < len(hashes) and hashes[n] in caches[r]:
            n += 1
        hit, total = hit + n * BLOCK, total + len(prompt)
        cache = caches[r]
        whole = prompt + answer
        for h in extend_block_hashes([], whole, len(whole), BLOCK):
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity:
            cache.popitem(last=False)
        loads[r] += 1
        routed[r] += 1
        running.append(r)
    by_prefix = sum(x.routed_by_prefix for x in router.counts)
    return {
        "policy": policy,
        "hit_rate": hit / total,
        "routed_min": min(routed),
        "routed_max": max(routed),
        "routed_by_prefix": by_prefix if policy == "cache-aware" else 0,
        "requests": len(order),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--chats", type=int, default=256)
    ap.add_argument("--max-turns", type=int, default=8)
    ap.add_argument("--capacity-blocks", default="1024,4096", help="per replica; comma-separated")
    ap.add_argument("--in-flight", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", type=Path, default=None, help="also write the results as JSON")
    args = ap.parse_args()
    work = chats(args.chats, args.max_turns, args.seed)
    order = arrivals(work, args.seed)
    rows, results = [], []
    for capacity in [int(x) for x in args.capacity_blocks.split(",")]:
        for policy in ("cache-aware", "least-loaded", "round-robin"):
            r = simulate(work, order, policy, args.replicas, capacity, args.in_flight)
            results.append(r | {"capacity_blocks": capacity})
            rows.append(
                [capacity, policy, f"{r['hit_rate']:.1%}", f"{r['routed_min']}-{r['routed_max']}",
                 r["routed_by_prefix"]]
            )  # fmt: skip
    # What any router could reach: every turn finds its whole history (one cache, no limit).
    bound = simulate(work, order, "round-robin", 1, 1 << 30, args.in_flight)["hit_rate"]
    rows.append(["unbounded", "one replica (upper bound)", f"{bound:.1%}", "-", "-"])
    results.append({"policy": "upper bound", "hit_rate": bound})
    print(
        f"{args.replicas} replicas, {len(work)} chats, {len(order)} requests, "
        f"{args.in_flight} in flight, blocks of {BLOCK} tokens"
    )
    headers = ["capacity (blocks)", "policy", "prefix hit rate", "requests/replica", "by prefix"]
    print(format_table(headers, rows))
    if args.output:
        write_result("router_sim", {"config": vars(args), "results": results}, args.output)


if __name__ == "__main__":
    main()
